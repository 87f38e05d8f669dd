"""TACO's device-initiated compressed collectives against NCCL BF16, 1 MiB to 256 MiB, side by side
on W GPUs (issue 5's table): algorithm bandwidth per op and size, per codec.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python bench/taco_bandwidth.py --gpus 4 [--mibs 1 4 16 64 256] [--codecs cuda triton]

Writes bench/results/taco-bandwidth-<W>gpu-<UTC>.json (rows of `commweave.taco.bandwidth.measure`,
with provenance) and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commweave.report.results import RESULTS_DIR, write_results
from commweave.runtime import WorkerPool, apply_safe_env
from commweave.taco.bandwidth import OPS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--mibs", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--codecs", nargs="+", default=["cuda"], choices=["cuda", "triton"])
    p.add_argument("--double-buffer", action="store_true", help="alternate two buffers per op (one barrier a call)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    apply_safe_env()
    with WorkerPool(args.gpus, device="cuda", job_timeout_s=900) as pool:
        result = pool.run("commweave.taco.bandwidth:measure", mibs=tuple(args.mibs), codecs=tuple(args.codecs),
                          double_buffer=args.double_buffer)
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
    print("results:", path)


if __name__ == "__main__":
    main()
