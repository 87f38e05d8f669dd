"""Tensor-parallel GEMM with the A operand all-gathered: out = all_gather(A) @ B_local."""
