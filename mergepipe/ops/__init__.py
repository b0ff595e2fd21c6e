"""Operators: one module per merge-operator family, plus the fused numba kernels."""
