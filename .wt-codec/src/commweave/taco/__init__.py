"""TACO: FP8 group quantization (Hadamard transform, dual scales), compressed collectives, TP layers.

- `quant`: QuantConfig, compress/decompress, fwht, the wire format (pack/unpack)
- `kernels`: the fused Triton kernels (compress, compress_into, decompress, decompress_accumulate),
  bit for bit equal to `quant`; imported on demand (needs triton), or via `impl="triton"`
- `cuda`: the CUDA kernels (compress; gather or sum of every rank's message in one launch)
- `collectives`: compressed all-gather, reduce-scatter, all-reduce (one-shot, two-shot); backends
  "reference" (host), "device" (`device`: device-initiated), "auto" (`selector`: compressed only
  where measured faster than NCCL)
- `bandwidth`: the side-by-side measurement against NCCL BF16 the selector reads
- `tp`: Megatron-style column/row-parallel Linear with sequence parallelism over those collectives
"""

from commweave.taco.quant import Compressed, QuantConfig, compress, decompress, fwht

__all__ = ["Compressed", "QuantConfig", "compress", "decompress", "fwht"]
