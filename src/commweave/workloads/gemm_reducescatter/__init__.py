"""Tensor-parallel GEMM with the product reduce-scattered over rows: out = reduce_scatter(A_local @ B_local)."""
