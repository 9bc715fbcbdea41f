"""Numba kernels, each with a plain numpy reference beside it.

Importing this package applies edgerun's Numba compiler switches first.
"""

from edgerun import _numba_env

_numba_env.configure()
