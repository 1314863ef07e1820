"""Benchmarks: `detaudit bench engine|kernels|allreduce`."""
