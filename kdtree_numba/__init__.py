"""kdtree-numba: DDTree speculative decoding on MLA+MoE models with numba.cuda kernels.

Kernel modules (``kdtree_numba.ddtree``, ``kdtree_numba.layers``) mirror the NumPy references
of the same names in ``reference``; ``kdtree_numba.compat`` is imported first by each of them.
"""
__version__ = "0.1.0"
