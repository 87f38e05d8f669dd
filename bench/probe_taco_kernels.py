"""Where the TACO Triton kernels' time goes, on one GPU: compress and decompress of 128 MiB of BF16
with each option switched off in turn (Hadamard, dual scales) and at several tile sizes (elements
per program), median kernel time and the HBM rate it implies (BF16 side + wire side bytes).

    python bench/probe_taco_kernels.py [--iters 20]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_cli import probe_main  # noqa: E402  (bench/ is not a package)

from commweave.evaluate.timing import cuda_median_us  # noqa: E402
from commweave.taco import kernels  # noqa: E402
from commweave.taco.quant import QuantConfig  # noqa: E402

MIB = 128
CASES = list(itertools.product([1024, 2048, 8192], [(True, True), (False, True), (True, False), (False, False)]))


def probe(tile: int, options: tuple[bool, bool], iters: int) -> dict:
    hadamard, dual = options
    kernels._TILE_ELEMENTS["cuda"] = tile
    x = torch.randn((MIB << 20) // 2, device="cuda", dtype=torch.bfloat16)
    cfg = QuantConfig(128, hadamard=hadamard, dual_scale=dual)
    buf = torch.empty(cfg.wire_bytes(x.numel()), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    c = kernels.compress(x, cfg)
    compress_us = cuda_median_us(lambda: kernels.compress_into(x, cfg, buf), iters)
    decompress_us = cuda_median_us(lambda: kernels.decompress_into(c, out), iters)
    moved = x.numel() * 2 + cfg.wire_bytes(x.numel())
    return {"case": f"tile={tile} hadamard={hadamard} dual_scale={dual}", "compress_us": compress_us,
            "decompress_us": decompress_us, "compress_GBps": moved / compress_us / 1e3,
            "decompress_GBps": moved / decompress_us / 1e3}


if __name__ == "__main__":
    probe_main(__doc__, "probe-taco-kernels-1gpu", f"{MIB} MiB BF16, G=128, E4M3", CASES, probe)
