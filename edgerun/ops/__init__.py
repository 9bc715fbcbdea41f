"""Numba kernels, each with a plain numpy reference beside it.

Importing this package applies edgerun's Numba compiler switches first.
"""

from edgerun.runtime import numba_env

numba_env.configure()
