"""Figure: TACO's bandwidth table (README, docs/results.md; taco-bandwidth-*.json and its plot).

TACO's device-initiated compressed collectives against NCCL BF16, 1 MiB to 256 MiB, side by side
on W GPUs (issue 5's table): algorithm bandwidth per op and size, per codec.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python bench/taco_bandwidth.py --gpus 4 [--mibs 1 4 16 64 256] [--codecs cuda cuda-fused triton]

Writes bench/results/taco-bandwidth-<W>gpu-<UTC>.json (rows of `commweave.taco.bandwidth.measure`,
with provenance) and a PNG beside it (bandwidth against message size, one panel per op), and prints
the table. `--plot RESULTS.json` redraws the PNG of an earlier run without measuring.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from commweave.report.results import RESULTS_DIR, write_results
from commweave.runtime import WorkerPool, apply_safe_env
from commweave.taco import bandwidth
from commweave.taco.bandwidth import OPS


def plot(rows: list[dict], path: Path) -> Path:
    """Algorithm bandwidth against message size per op: NCCL BF16 and each codec measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = sorted(k[: -len("_GBps")] for k in rows[0] if k.endswith("_GBps") and k != "nccl_GBps")
    fig, axes = plt.subplots(1, len(OPS), figsize=(4 * len(OPS), 3.4), sharey=True)
    for ax, op in zip(axes, OPS):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["mib"])
        sizes = [r["mib"] for r in mine]
        ax.plot(sizes, [r["nccl_GBps"] for r in mine], "k-o", ms=3, label="NCCL BF16")
        for codec in codecs:
            ax.plot(sizes, [r[f"{codec}_GBps"] for r in mine], "-o", ms=3, label=f"TACO E4M3 ({codec})")
        ax.set_xscale("log", base=2)
        ax.set_title(op.replace("_", " "), fontsize=10)
        ax.set_xlabel("message (MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("algorithm bandwidth (GB/s)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{rows[0]['world']} GPUs: compressed collectives vs NCCL", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _variant(name: str) -> str:
    try:
        bandwidth.variant(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--mibs", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--codecs", nargs="+", default=["cuda"], type=_variant,
                   help="variants: cuda, triton, cuda-fused (the reading kernels perform the read barrier)")
    p.add_argument("--single-buffer", action="store_true",
                   help="one buffer per op (two barriers a call back to back; default: two alternated, one barrier)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--plot", type=Path, help="only redraw the PNG of this results JSON")
    args = p.parse_args()
    if args.plot:
        print("plot:", plot(json.loads(args.plot.read_text())["rows"], args.plot.with_suffix(".png")))
        return
    apply_safe_env()
    with WorkerPool(args.gpus, device="cuda", job_timeout_s=900) as pool:
        result = pool.run("commweave.taco.bandwidth:measure", mibs=tuple(args.mibs), codecs=tuple(args.codecs),
                          double_buffer=not args.single_buffer)
        if not result.ok:
            failure = result.first_failure()
            sys.exit(f"the measurement failed: {failure.traceback if failure else result.status}")
        rows = result.values[0]
    method = ("algorithm bandwidth = full BF16 message bytes / median over 30 (<= 16 MiB) or 10 iterations of the "
              "slowest rank's GPU time (timing.gated_seconds); device backend E4M3, G=128, Hadamard + dual scales "
              "(TACO's defaults) vs NCCL BF16 on the same ranks, in one run")
    path = write_results(f"taco-bandwidth-{args.gpus}gpu", {"method": method, "rows": rows},
                         command=["python", "bench/taco_bandwidth.py", *sys.argv[1:]], out_dir=args.out_dir)
    print(f"{'op':22}{'MiB':>6}{'NCCL GB/s':>11}" + "".join(f"{c + ' GB/s':>13}{'x':>7}" for c in args.codecs))
    for op in OPS:
        for r in (r for r in rows if r["op"] == op):
            print(f"{op:22}{r['mib']:>6g}{r['nccl_GBps']:>11.0f}"
                  + "".join(f"{r[c + '_GBps']:>13.0f}{r[c + '_speedup']:>7.2f}" for c in args.codecs))
    print("results:", path, "plot:", plot(rows, Path(path).with_suffix(".png")))


if __name__ == "__main__":
    main()
