"""TACO: FP8 group quantization (Hadamard transform, dual scales), compressed collectives, TP layers.

- `quant`: QuantConfig, compress/decompress, fwht, the wire format (pack/unpack)
- `kernels`: the fused Triton kernels (compress, compress_into, decompress, decompress_accumulate),
  bit for bit equal to `quant`; imported on demand (needs triton), or via `impl="triton"`
- `collectives`: compressed all-gather, reduce-scatter, all-reduce (one-shot, two-shot), selector
- `tp`: Megatron-style column/row-parallel Linear with sequence parallelism over those collectives
"""

from commweave.taco.quant import Compressed, QuantConfig, compress, decompress, fwht

__all__ = ["Compressed", "QuantConfig", "compress", "decompress", "fwht"]
