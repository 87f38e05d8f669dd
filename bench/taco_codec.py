"""Figure: TACO's codec against the HBM roofline (taco/NOTES.md; taco-codec-1gpu-*.json).

TACO's CUDA codec against the HBM roofline on one GPU, in one process.

For each size (MiB of BF16 handled by a call, 4-256 by default) this times, with CUDA events
(`runtime.timers.cuda_median_us`: each call queued behind a spin kernel, so the time is the GPU's):
- a device-to-device copy of that size (torch `copy_`): the roofline's rate, bytes read + written;
- compress and decompress (the one-message gather) at TACO's defaults (Hadamard + dual scales),
  with the Hadamard transform and one scale ("single-scale": no RMS pre-scale) and with both off
  ("plain");
- the fused gather of W = 2 and 4 messages (one all-gather's output of that size, W messages of
  size / W: what a rank's gather reads in the rank simulation, every peer's message in this GPU's
  memory) and the fused sum of W = 2 and 4 messages of that size (one-shot all-reduce's sum);
- `torch.compile` of a plain per-group FP8 quantizer (absmax, scale, cast) and its dequantizer, the
  yardstick a user would write.
A kernel's roofline time is its bytes (each input read once, each output written once) over the
copy's rate at that size; the fraction reported is roofline time / measured time. Each timed call
(the copy's too) rotates over enough input sets that together they exceed twice the L2.

Every kernel setting in `--tunings` (`cuda.Tuning`: persistent grid, how 16-bit input is fetched,
transposed layout) is timed in the same process, after checking that it writes the same bytes as the
reference (`quant.py`, at 1 MiB) and as the first tuning (at every size).

    python bench/taco_codec.py [--sizes 4 16 64 256] [--tunings legacy default] [--iters 20] [--plot]

Writes bench/results/taco-codec-1gpu-<stamp>.json (and .png with --plot).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from commweave.evaluate.timing import input_sets_for
from commweave.runtime.timers import cuda_median_us
from commweave.report.results import write_results
from commweave.taco import cuda, quant
from commweave.taco.quant import QuantConfig

MIB = 1 << 20
CONFIGS = {"defaults": QuantConfig(128), "single-scale": QuantConfig(128, dual_scale=False),
           "plain": QuantConfig(128, hadamard=False, dual_scale=False)}
TUNINGS = {
    "legacy": cuda.Tuning(persistent=False, fetch16="load", transpose=False),
    "persistent": cuda.Tuning(fetch16="load", transpose=False),
    "load": cuda.Tuning(fetch16="load"),
    "async": cuda.Tuning(fetch16="async"),
    "default": cuda.Tuning(),
}
WORLDS = (2, 4)
FP8_MAX = 448.0
TINY = torch.finfo(torch.float32).smallest_normal


def plain_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (128) absmax FP8 E4M3 quantization, nothing else: the user's plain quantizer."""
    g = x.view(-1, 128).float()
    scale = (g.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(TINY)
    return (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def plain_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale).to(torch.bfloat16).view(-1)


def _precompile(tunings: list[str]) -> None:
    """Every cubin the timed calls use, compiled in parallel (disk-cached) before any timing."""
    from commweave.runtime.compile import compile_cubin

    sources = []
    for name in tunings:
        previous = cuda.set_tuning(TUNINGS[name])
        sources += [cuda.specialization(cfg, torch.bfloat16, n) for cfg in CONFIGS.values() for n in (1, *WORLDS)]
        cuda.set_tuning(previous)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(compile_cubin, sources))


def _messages(x: torch.Tensor, cfg: QuantConfig, count: int) -> list[quant.Compressed]:
    """`count` packed messages of x's size (x and x rolled), each in its own buffer."""
    return [cuda.compress(torch.roll(x, i * 4097) if i else x, cfg) for i in range(count)]


def _kernels(xs: list[torch.Tensor], cfg: QuantConfig) -> dict[str, tuple[list, int, list[torch.Tensor]]]:
    """name -> (one call per input set in xs, bytes a call moves, what set 0's call writes) for every
    codec kernel timed; the timer rotates over the sets, so no call finds its data in L2."""
    n = xs[0].numel()
    calls: dict[str, tuple[list, int, list[torch.Tensor]]] = {}

    def add(name: str, call, moved: int, outs: list[torch.Tensor]) -> None:
        entry = calls.setdefault(name, ([], moved, outs))
        entry[0].append(call)

    for x in xs:
        buf = torch.empty(cfg.wire_bytes(n), dtype=torch.uint8, device=x.device)
        c = cuda.compress(x, cfg)
        out = torch.empty_like(x)
        add("compress", lambda x=x, b=buf: cuda.compress_into(x, cfg, b), 2 * n + cfg.wire_bytes(n), [buf])
        add("decompress", lambda c=c, o=out: cuda.gather_into([c], o), cfg.wire_bytes(n) + 2 * n, [out])
        for w in WORLDS:
            parts = _messages(x.view(w, -1)[0].contiguous(), cfg, w)
            gathered = torch.empty_like(x)
            add(f"gather{w}", lambda p=parts, o=gathered: cuda.gather_into(p, o), w * cfg.wire_bytes(n // w) + 2 * n,
                [gathered])
            full = _messages(x, cfg, w)
            summed = torch.empty_like(x)
            add(f"sum{w}", lambda p=full, o=summed: cuda.sum_into(p, o), w * cfg.wire_bytes(n) + 2 * n, [summed])
    return calls


def _rotating(calls: list) -> callable:
    """One call per invocation, cycling through the input sets."""
    state = itertools.cycle(calls)
    return lambda: next(state)()


def _sets(mib: int) -> int:
    """Input sets rotated at this size: together past twice the L2 for the kernel that touches the
    fewest bytes a call (compress: the BF16 input and ~half its size of wire bytes)."""
    return input_sets_for(mib * MIB * 3 // 2)


def _check_reference(tuning: str) -> list[str]:
    """This tuning's compress / decompress / gather / sum bytes against the reference at 1 MiB."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(MIB // 2, generator=gen).to(torch.bfloat16)
    failures = []
    for name, cfg in CONFIGS.items():
        ref = quant.compress(x, cfg)
        got = cuda.compress(x.cuda(), cfg)
        if not torch.equal(quant.pack(got).cpu(), quant.pack(ref)):
            failures.append(f"{tuning} {name} compress")
        back = cuda.decompress(got).cpu()
        if not torch.equal(back.view(torch.int16), quant.decompress(ref).view(torch.int16)):
            failures.append(f"{tuning} {name} decompress")
        total = quant.decompress(ref, torch.float32)
        for _ in range(3):
            total = total + quant.decompress(ref, torch.float32)
        summed = cuda.sum_into([got] * 4, torch.empty_like(x, device="cuda")).cpu()
        if not torch.equal(summed.view(torch.int16), total.to(torch.bfloat16).view(torch.int16)):
            failures.append(f"{tuning} {name} sum4")
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64, 256], help="MiB of BF16 per call")
    p.add_argument("--tunings", nargs="+", default=["default"], choices=sorted(TUNINGS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions of every tuning (median kept)")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--once", action="store_true", help="run each kernel once per size, config and tuning, in "
                   "that order, no timing, inside the CUDA profiler's range and nothing else (for ncu "
                   "--profile-from-start off)")
    args = p.parse_args()
    torch.manual_seed(0)
    _precompile(args.tunings)
    if args.once:
        for mib in args.sizes:
            x = torch.randn(mib * MIB // 2, device="cuda").to(torch.bfloat16)
            built = []
            for tuning in args.tunings:
                cuda.set_tuning(TUNINGS[tuning])
                built += [(tuning, cname, _kernels([x], cfg)) for cname, cfg in CONFIGS.items()]  # setup launches
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for tuning, cname, kernels in built:
                cuda.set_tuning(TUNINGS[tuning])
                for kname, (calls, _, _) in kernels.items():
                    calls[0]()
                    print(f"launched: {mib} MiB {tuning} {cname} {kname}", flush=True)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        return
    failures = []
    for name in args.tunings:
        cuda.set_tuning(TUNINGS[name])
        failures += _check_reference(name)
    if failures:
        sys.exit("differs from the reference: " + "; ".join(failures))
    # static shapes: one kernel per size, as a user with fixed shapes gets (with automatic dynamic
    # shapes the kernel made at the second size ran at 0.15-0.2 of the roofline in one run of three)
    compiled_q = torch.compile(plain_quantize, dynamic=False)
    compiled_dq = torch.compile(plain_dequantize, dynamic=False)
    rows = []
    for mib in args.sizes:
        sets = _sets(mib)
        xs = [torch.randn(mib * MIB // 2, device="cuda").to(torch.bfloat16) for _ in range(sets)]
        n = xs[0].numel()
        dsts = [torch.empty_like(x) for x in xs]
        copy_us = cuda_median_us(_rotating([lambda x=x, d=d: d.copy_(x) for x, d in zip(xs, dsts)]), args.iters)
        del dsts
        rate = 2 * n * 2 / copy_us / 1e3  # GB/s, bytes read + written
        quantized = [compiled_q(x) for x in xs]
        compiled_dq(*quantized[0])
        base = {"MiB": mib, "input_sets": sets, "copy_us": copy_us, "copy_GBps": rate}
        for what, calls, moved in (("torch.compile quantize", [lambda x=x: compiled_q(x) for x in xs],
                                    2 * n + n + 4 * (n // 128)),
                                   ("torch.compile dequantize", [lambda qs=qs: compiled_dq(*qs) for qs in quantized],
                                    n + 4 * (n // 128) + 2 * n)):
            us = cuda_median_us(_rotating(calls), args.iters)
            rows.append({**base, "tuning": "-", "config": "plain per-group", "kernel": what, "us": us, "bytes": moved,
                         "roofline_fraction": moved / rate / 1e3 / us})
        del quantized
        first_bytes: dict[tuple[str, str], list[torch.Tensor]] = {}
        times: dict[tuple[str, str, str], list[float]] = {}
        moved_of: dict[tuple[str, str], int] = {}
        for rep in range(args.reps):
            for tuning in args.tunings:
                cuda.set_tuning(TUNINGS[tuning])
                for cname, cfg in CONFIGS.items():
                    for kname, (calls, moved, outs) in _kernels(xs, cfg).items():
                        calls[0]()
                        key = (cname, kname)
                        moved_of[key] = moved
                        if rep == 0:
                            if key not in first_bytes:
                                first_bytes[key] = [o.clone() for o in outs]
                            elif not all(torch.equal(a, b) for a, b in zip(first_bytes[key], outs)):
                                sys.exit(f"{tuning} {cname} {kname} at {mib} MiB writes other bytes than "
                                         f"{args.tunings[0]}")
                        times.setdefault((tuning, cname, kname), []).append(
                            cuda_median_us(_rotating(calls), args.iters))
        for (tuning, cname, kname), ts in times.items():
            us = sorted(ts)[len(ts) // 2]
            moved = moved_of[(cname, kname)]
            rows.append({**base, "tuning": tuning, "config": cname, "kernel": kname, "us": us, "us_reps": ts,
                         "bytes": moved, "roofline_fraction": moved / rate / 1e3 / us})
        del xs
        torch.cuda.empty_cache()
        for r in rows:
            if r["MiB"] == mib:
                print(f"{mib:4d} MiB copy {rate:6.0f} GB/s | {r['tuning']:10s} {r['config']:16s} {r['kernel']:25s} "
                      f"{r['us']:8.1f} us  {r['roofline_fraction']:.2f} of roofline")
    payload = {"note": "one H200: BF16, G=128, E4M3; roofline = bytes read+written / the copy's rate at the same "
                       "size in this process; every timed call (copy too) rotates over input_sets sets (together "
                       "past twice the L2); gather W: W messages of size/W into one output of size; sum W: W "
                       "messages of size each", "rows": rows}
    path = write_results("taco-codec-1gpu", payload, command=["python", "bench/taco_codec.py", *sys.argv[1:]],
                         out_dir=args.out_dir)
    print("results:", path)
    if args.plot:
        _plot(rows, path.with_suffix(".png"), args.tunings[-1])


def _plot(rows: list[dict], path: Path, tuning: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CONFIGS), figsize=(6 * len(CONFIGS), 4.5), sharey=True)
    for ax, cname in zip(axes, CONFIGS):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if (r["tuning"] == tuning and r["config"] == cname) or r["tuning"] == "-":
                series.setdefault(r["kernel"], []).append((r["MiB"], r["roofline_fraction"]))
        for kname, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kname,
                    linestyle="--" if kname.startswith("torch") else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("MiB of BF16 per call")
        ax.set_title(f"TACO CUDA codec, {cname} ({tuning})")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of copy roofline")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("plot:", path)


if __name__ == "__main__":
    main()
