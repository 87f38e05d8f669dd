"""What the one-GPU probes share beyond the timer (`evaluate.timing.cuda_median_us`): their
command line (--iters, --out-dir; one results JSON with provenance, a line per case printed)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commweave.report.results import write_results


def probe_main(doc: str, name: str, note: str, cases: Sequence[tuple], probe: Callable[..., dict[str, Any]]) -> None:
    """Parse --iters/--out-dir, run `probe(*case, iters)` per case, write the rows to
    `<out-dir>/<name>-<stamp>.json` and print each row (floats rounded, errors on their own line)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    rows = [probe(*case, args.iters) for case in cases]
    path = write_results(name, {"note": note, "rows": rows}, command=["python", sys.argv[0], *sys.argv[1:]],
                         out_dir=args.out_dir)
    for row in rows:
        values = {k: v for k, v in row.items() if k != "case" and not k.endswith("_error")}
        print(row["case"], " ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))
        for key in (k for k in row if k.endswith("_error")):
            print("  ", key, row[key])
    print("results:", path)
