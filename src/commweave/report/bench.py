"""How a bench report reads: `commweave bench`'s comparison table and the notes under it
(yardsticks' bandwidth, memory, failures), and the sweeps' ranking table. Presentation only:
every figure comes from `commweave.evaluate.bench.BenchReport`."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from commweave.evaluate.bench import BenchReport, ShapeBench


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value else "-"


def _program_cell(row: ShapeBench, name: str) -> str:
    """The median, or the failure class in red, or '-' when it was neither timed nor judged."""
    us = row.median_us(name)
    if us:
        return f"{us:,.1f}"
    verdict = row.verdict(name)
    return f"[red]{verdict.failure}[/]" if verdict is not None and not verdict.ok else "-"


def subjects(report: BenchReport) -> list[str]:
    """The programs compared with the baselines: every program that is not one."""
    return [n for n in report.programs if n not in report.baselines]


def comparison_table(report: BenchReport) -> Table:
    """One row per job: each program's and yardstick's median, each subject's speedup over each
    baseline, yardstick / subject, the floor and floor / subject."""
    table = Table(title=f"{report.workload} on {report.gpus} GPUs (µs a call: median over timed batches of the "
                        "slowest rank's batch time over its calls)")
    table.add_column("shape")
    ours = subjects(report)
    for name in report.programs:
        table.add_column(name, justify="right")
    for name in report.yardsticks:
        table.add_column(f"{name} (yardstick)", justify="right")
    for name in ours:
        for base in report.baselines:
            table.add_column(f"{name} vs {base}", justify="right")
    for name in ours:
        for yard in report.yardsticks:
            table.add_column(f"{yard}/{name}", justify="right")
    table.add_column("floor", justify="right")
    for name in ours:
        table.add_column(f"floor/{name}", justify="right")
    for row in report.rows:
        table.add_row(row.shape, *[_program_cell(row, n) for n in report.programs],
                      *[_num(row.median_us(y), ",.1f") for y in report.yardsticks],
                      *[_num(row.speedup(n, b), ".2f") + ("x" if row.speedup(n, b) else "")
                        for n in ours for b in report.baselines],
                      *[_num(row.ratio(y, n), ".3f") for n in ours for y in report.yardsticks],
                      _num(row.floor_us, ",.1f"), *[_num(row.floor_fraction(n), ".2f") for n in ours])
    return table


#: what a one-GPU table is (and is not)
ONE_GPU_NOTE = ("1 GPU: nothing to communicate, so no communication was timed; these are the programs' "
                "compute sides alone (what overlap has to hide on more GPUs)")


def notes(report: BenchReport) -> list[str]:
    """Plain lines under the table: on one GPU that no communication was timed, what yardsticks
    are, each communication yardstick's bandwidth against the measured peer-copy rate, the judge's
    resolution (calls a batch, crossing cost), device memory, and every failure with its message."""
    lines = []
    if report.gpus == 1:
        lines.append(ONE_GPU_NOTE)
    if report.yardsticks:
        lines.append(f"yardsticks ({', '.join(report.yardsticks)}): timed in the same job, not checked "
                     "(see the workload's yardsticks)")
    link = report.rates.link_bytes_per_s
    for row in report.rows:
        for name in report.comm_yardsticks:
            gbps = row.gbps(name)
            if gbps:
                lines.append(f"{row.shape}: {name} moves the slowest rank's {row.comm_bytes / 2**20:,.1f} MiB at "
                             f"{gbps:,.0f} GB/s, {gbps * 1e9 / link:.2f} of the measured peer-copy rate "
                             f"({link / 1e9:,.0f} GB/s)")
    for row in report.rows:
        sized = {n: t for n, t in row.timings.items() if t.batch}
        if sized:
            worst = max(t.crossing_us or 0.0 for t in sized.values())
            lines.append(f"{row.shape}: the judge's resolution: calls a batch " + ", ".join(f"{n} {t.batch}" for n, t in
                         sized.items()) + f"; a batch's crossings cost at most {worst:,.0f} µs "
                         f"({worst / min(t.batch for t in sized.values()):,.2f} µs a call at the smallest batch), "
                         f"{max(t.subtracted_us or 0.0 for t in sized.values()):,.0f} µs of it taken off every batch")
            late = {n: t.hold_expired for n, t in sized.items() if t.hold_expired}
            if late:
                lines.append(f"{row.shape}: batches that started before they were queued (the program's CPU time "
                             "shows): " + ", ".join(f"{n} {k}" for n, k in late.items()))
    for row in report.rows:
        held = row.memory_bytes()
        if held:
            lines.append(f"{row.shape}: device memory per GPU beyond inputs and output (MiB): "
                         + ", ".join(f"{n} {b / 2**20:,.0f}" for n, b in held.items()))
    for shape, name, verdict in report.failures():
        lines.append(f"{shape} {name}: {verdict.failure}: {verdict.message}")
    return lines


def ranking_table(report: BenchReport, title: str, *, top: int | None = None, bandwidth: bool = False,
                  versus: str = "fitness") -> tuple[Table, int]:
    """Programs as rows (baselines first, then the others fastest first on the last shape), shapes
    as columns: median µs (with `bandwidth`, the GB/s of the call's received bytes) and the speedup
    over the row's fitness baseline (`versus="best"`: its fastest baseline). A program timed in
    several jobs of a shape (baselines, when timed in batches) shows its first. Returns the table
    and how many programs `top` left out."""
    if versus not in ("fitness", "best"):
        raise ValueError(f"versus must be 'fitness' or 'best', not {versus!r}")
    shapes = report.shapes()
    first: dict[tuple[str, str], ShapeBench] = {}
    for row in report.rows:
        for name in row.programs:
            first.setdefault((name, row.shape), row)

    def cell(name: str, shape: str) -> str:
        row = first.get((name, shape))
        if row is None:
            return "-"
        us = row.median_us(name)
        if not us:
            verdict = row.verdict(name)
            return escape(str(verdict.failure)) if verdict is not None and not verdict.ok else "-"
        extra = [f"{row.gbps(name):,.0f} GB/s"] if bandwidth else []
        base = row.baseline if versus == "fitness" else row.best_baseline
        if name not in report.baselines and base is not None and row.speedup(name, base):
            extra.append(f"{row.speedup(name, base):.2f}x {base}")
        return f"{us:,.1f}" + (f" ({', '.join(extra)})" if extra else "")

    def last_median(name: str) -> float:
        row = first.get((name, shapes[-1])) if shapes else None
        return (row.median_us(name) if row is not None else None) or float("inf")

    others = sorted((n for n in report.programs if n not in report.baselines), key=last_median)
    shown = others if top is None else others[:top]
    table = Table(title=title)
    table.add_column("program")
    for shape in shapes:
        floor = next(row.floor_us for row in report.rows if row.shape == shape)
        table.add_column(f"{shape} (floor {floor:,.1f})", justify="right")
    for name in [*report.baselines, *shown]:
        table.add_row(escape(name), *[cell(name, s) for s in shapes])
    return table, len(others) - len(shown)
