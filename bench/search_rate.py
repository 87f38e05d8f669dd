"""Figure: bench/results/search-rate-*.json, how many candidates a search judged per minute, from its run databases.

    python bench/search_rate.py runs/evolve-gemm-allgather-1gpu-*.sqlite --label after

Per run database (`commweave evolve`): evaluations, the run's elapsed seconds, the steady rate
(evaluations after the first over the time from its result to the last: the pool start, the seed
and the baselines' one-time checks left out), the mean judge time per evaluation (`evaluate_s`),
and per evaluation the host baseline's median, the candidate's and the judge's calls per timed
batch (where the database records the judge's resolution).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from commweave.report.results import write_results  # noqa: E402


def summarize(path: Path) -> dict[str, Any]:
    """One run database's rate and per-evaluation figures."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM run")}
        rows = db.execute("SELECT id, timings, created_at, fitness, status FROM programs ORDER BY id").fetchall()
    if len(rows) < 2:
        raise SystemExit(f"{path}: {len(rows)} evaluation(s); a rate needs two")
    stamps = [datetime.fromisoformat(created) for _, _, created, _, _ in rows]
    span_s = (stamps[-1] - stamps[0]).total_seconds()
    evaluations = []
    for (ident, timings, _, fitness, status) in rows:
        t = json.loads(timings or "{}")
        resolution = t.get("resolution", {})
        evaluations.append({"id": ident, "status": status, "fitness": fitness, "evaluate_s": t.get("evaluate_s"),
                            "candidate_us": t.get("candidate_us"), "host_us": (t.get("baselines_us") or {}).get("host"),
                            "batch": {n: r.get("batch") for n, r in resolution.items()} or None})
    judged = [e["evaluate_s"] for e in evaluations if e["evaluate_s"] is not None]
    return {"database": path.name, "workload": meta.get("workload"), "shape": meta.get("shape"), "gpus": meta.get("gpus"),
            "evaluations": len(rows), "elapsed_s": meta.get("elapsed_s"),
            "steady_per_min": 60.0 * (len(rows) - 1) / span_s if span_s > 0 else None,
            "mean_evaluate_s": statistics.mean(judged) if judged else None, "per_evaluation": evaluations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("databases", type=Path, nargs="+")
    parser.add_argument("--label", default="", help="a tag for the results file name")
    parser.add_argument("--note", default="", help="what the runs were (device, commits), kept in the JSON")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    missing = [str(p) for p in args.databases if not p.is_file()]
    if missing:
        raise SystemExit(f"no such run database: {', '.join(missing)}")
    runs = [summarize(p) for p in args.databases]
    label = f"-{args.label}" if args.label else ""
    path = write_results(f"search-rate{label}", {"note": args.note, "runs": runs},
                         command=["python", "bench/search_rate.py", *sys.argv[1:]], out_dir=args.out_dir)
    for run in runs:
        print(f"{run['database']}: {run['evaluations']} evaluations in {run['elapsed_s']:.0f} s, "
              f"steady {run['steady_per_min']:.1f}/min, judge {run['mean_evaluate_s']:.2f} s each")
    print(path)


if __name__ == "__main__":
    main()
