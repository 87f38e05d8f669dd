"""A/B of two versions of the TACO CUDA kernels on one GPU, in one process: the committed
`taco_kernels.cu` against another copy of it (e.g. `git show REV:src/commweave/taco/taco_kernels.cu
> old.cu`), compress and decompress of 128 MiB, BF16 and FP32, TACO's defaults and everything off,
interleaved repetitions (the lent machines differ by up to ~30 % run to run, so only a same-run
comparison says whether a kernel change helped). Checks that both write the same bytes first.

    python bench/ab_taco_kernels.py old.cu [--reps 3] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from commweave.runtime.timers import cuda_median_us
from commweave.report.results import write_results
from commweave.taco import cuda
from commweave.taco.quant import QuantConfig

CONFIGS = {"defaults": QuantConfig(128), "plain": QuantConfig(128, hadamard=False, dual_scale=False)}


def _use(source: Path) -> None:
    cuda.SOURCE = source
    cuda.specialization.cache_clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("other", type=Path, help="the other version of taco_kernels.cu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    sources = {"committed": cuda.SOURCE, "other": args.other.resolve()}
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64 << 20, device="cuda").to(dtype)
        for name, cfg in CONFIGS.items():
            bufs, outs = {}, {}
            for version, source in sources.items():
                _use(source)
                bufs[version] = cuda.compress_into(x, cfg, torch.empty(cfg.wire_bytes(x.numel()), dtype=torch.uint8,
                                                                       device="cuda"))
                outs[version] = cuda.decompress(cuda.compress(x, cfg))
            if not (torch.equal(bufs["committed"], bufs["other"]) and torch.equal(outs["committed"], outs["other"])):
                sys.exit(f"{dtype} {name}: the two versions write different bytes")
            row = {"case": f"{str(dtype).split('.')[-1]} {name}"}
            for rep in range(args.reps):
                for version, source in sources.items():
                    _use(source)
                    c = cuda.compress(x, cfg)
                    row.setdefault(f"{version}_compress_us", []).append(
                        cuda_median_us(lambda: cuda.compress_into(x, cfg, bufs[version]), 20))
                    row.setdefault(f"{version}_decompress_us", []).append(
                        cuda_median_us(lambda: cuda.gather_into([c], outs[version]), 20))
            rows.append(row)
            print(row["case"], {k: [round(v) for v in vs] for k, vs in row.items() if k != "case"})
    path = write_results("ab-taco-kernels-1gpu", {"note": f"committed vs {args.other.name}, µs per repetition", "rows": rows},
                         command=["python", "bench/ab_taco_kernels.py", *sys.argv[1:]], out_dir=args.out_dir)
    print("results:", path)


if __name__ == "__main__":
    main()
