"""TACO: FP8 group quantization (Hadamard transform, dual scales), compressed collectives, TP layers.

- `wire`: QuantConfig, Compressed and their bytes (pack / packed_view / unpack)
- `codec`: the Codec interface and its Triton (`kernels`) and CUDA (`cuda`) implementations
- `quant`: the torch reference (compress / decompress with `impl=`, fwht, ReferenceCodec)
- `collectives`: compressed all-gather, reduce-scatter, all-reduce (one-shot, two-shot) over a
  `group=`; backends "reference" (host), "device" (`device`: device-initiated), "auto" (`selector`)
- `transport`, `hazards`, `buffers`, `replay`: the device backend's windows, rewrite barriers,
  double buffering and recorded launches
- `bandwidth`: the side-by-side measurement against NCCL BF16 the selector reads
- `tp`: Megatron-style column/row-parallel Linear with sequence parallelism over those collectives
"""

from commweave.taco.quant import Compressed, QuantConfig, compress, decompress, fwht

__all__ = ["Compressed", "QuantConfig", "compress", "decompress", "fwht"]
