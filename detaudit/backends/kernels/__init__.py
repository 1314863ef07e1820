"""Kernels for the invariant backends: `fixed` (batch-invariant matmul, row sums, attention),
`tree` (TBIK tree matmul and tree sums) and `triton_mm` (the Triton GEMMs both use on GPU; `triton_swap`
for decode-size products)."""
