"""Kernels for the invariant backends: `fixed` (batch-invariant matmul, row sums, attention),
`tree` (TBIK tree matmul and tree sums) and `triton_mm` (the one Triton GEMM both use on GPU)."""
