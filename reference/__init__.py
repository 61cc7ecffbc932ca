"""NumPy references: the simplest code that is obviously right (float64 where it helps).

Each module here states the contract (shapes, dtypes, semantics) of the kernels that
``kdtree_numba`` implements again on the GPU; tests tie the two together.
"""
