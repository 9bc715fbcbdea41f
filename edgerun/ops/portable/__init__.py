"""The portable kernels: float32 Numba code for every format on any CPU.

kernels (matvec, GEMM and embedding rows of the GGML formats), batch (a few decode
vectors per pass over each weight row), lowbit (edgerun's G64 formats).
"""
