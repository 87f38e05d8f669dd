"""Where the TACO kernels' time goes, on one GPU: compress and decompress of 128 MiB of BF16 with
each option switched off in turn (Hadamard, dual scales), the Triton kernels (at tile sizes, in
elements per program) against the CUDA ones (at register budgets, in blocks per SM), median kernel
time and the HBM rate it implies (BF16 side + wire side bytes).

    python bench/probe_taco_kernels.py [--iters 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_cli import probe_main  # noqa: E402  (bench/ is not a package)

from commweave.runtime.timers import cuda_median_us  # noqa: E402
from commweave.taco import cuda, kernels  # noqa: E402
from commweave.taco.quant import QuantConfig  # noqa: E402

MIB = 128
OPTIONS = [(True, True), (False, True), (True, False), (False, False)]
CASES = ([("triton", 2048, o) for o in OPTIONS] + [("cuda", b, o) for b in (2, 3, 4) for o in OPTIONS[:1]]
         + [("cuda", 4, o) for o in OPTIONS[1:]])


def probe(impl: str, setting: int, options: tuple[bool, bool], iters: int) -> dict:
    """impl 'triton': setting = tile elements; 'cuda': setting = the decompress kernel's blocks per SM
    (its register budget; compress keeps its default)."""
    hadamard, dual = options
    x = torch.randn((MIB << 20) // 2, device="cuda", dtype=torch.bfloat16)
    cfg = QuantConfig(128, hadamard=hadamard, dual_scale=dual)
    buf = torch.empty(cfg.wire_bytes(x.numel()), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    if impl == "triton":
        kernels._TILE_ELEMENTS["cuda"] = setting
        c = kernels.compress(x, cfg)
        compress_us = cuda_median_us(lambda: kernels.compress_into(x, cfg, buf), iters)
        decompress_us = cuda_median_us(lambda: kernels.decompress_into(c, out), iters)
        case = f"triton tile={setting}"
    else:
        cuda.MIN_BLOCKS_PER_SM["gather"] = setting
        cuda.specialization.cache_clear()
        c = cuda.compress(x, cfg)
        compress_us = cuda_median_us(lambda: cuda.compress_into(x, cfg, buf), iters)
        decompress_us = cuda_median_us(lambda: cuda.gather_into([c], out), iters)
        case = f"cuda gather blocks/SM={setting}"
    moved = x.numel() * 2 + cfg.wire_bytes(x.numel())
    return {"case": f"{case} hadamard={hadamard} dual_scale={dual}", "compress_us": compress_us,
            "decompress_us": decompress_us, "compress_GBps": moved / compress_us / 1e3,
            "decompress_GBps": moved / decompress_us / 1e3}


if __name__ == "__main__":
    probe_main(__doc__, "probe-taco-kernels-1gpu", f"{MIB} MiB BF16, G=128, E4M3", CASES, probe)
