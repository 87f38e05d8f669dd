"""The training-step table of `commweave bench` (commweave.ops.train_bench's timings): per shape the
slowest rank's forward, ring forward, training step and torch's, against the step's floor."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from commweave.contracts.profile import H200


def train_rows(per_shape: dict[str, list[dict[str, float]]], on_gpus: bool) -> list[dict[str, Any]]:
    """One row a shape: each timing's slowest rank (ms), the floor (the step's FLOPs at the H200's
    matmul rate; GPUs only) and the training step over it."""
    rows = []
    for label, ranks in per_shape.items():
        row: dict[str, Any] = {"shape": label}
        for key in ranks[0]:
            if key != "train_flops":
                row[key] = max(r[key] for r in ranks)
        floor = max(r["train_flops"] for r in ranks) / H200.matmul_flops_per_s * 1e3
        row["train_floor"] = floor if on_gpus else None
        row["train_over_floor"] = row["train"] / floor if on_gpus else None
        rows.append(row)
    return rows


def train_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="training step (forward + backward), ms, slowest rank")
    columns = ("forward", "ring_forward", "train", "torch_cp_train", "train_floor", "train_over_floor")
    table.add_column("shape")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for row in rows:
        cells = [row.get(c) for c in columns]
        table.add_row(row["shape"], *("-" if c is None else f"{c:.3f}" for c in cells))
    return table
