"""``embedding`` on the GPU: a gather of table rows (an out-of-range id gives a NaN row).

Twin: reference/layers/embedding.py; docs/LAYERS.md.
"""
from __future__ import annotations

import math

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, kernel, kernel_factory, to_device
from kdtree_numba.gpu.bits import bf16_bits_to_f32
from kdtree_numba.layers.workspace import device_weight, result_array

__all__ = ["embedding"]


@kernel_factory
def _embedding_kernel(is_bf16: bool):
    @kernel
    def embed(ids, table, y):
        """y[m, d] = table[ids[m], d]; an id outside [0, V) yields a NaN row (no host check)."""
        d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        row = cuda.blockIdx.x
        if d < y.shape[1]:
            tok = ids[row]
            if tok < 0 or tok >= table.shape[0]:
                y[row, d] = np.float32(math.nan)
            elif is_bf16:
                y[row, d] = bf16_bits_to_f32(table[tok, d])
            else:
                y[row, d] = table[tok, d]
    return embed


def embedding(ids, table, *, out=None, stream=0, workspace=None):
    """See reference.embedding (out-of-range ids give NaN rows here instead of raising)."""
    idd = to_device(ids, stream=stream)
    td, kind = device_weight(table, stream)
    m, d = idd.shape[0], td.shape[1]
    y = result_array(out, (m, d), np.float32, stream)
    if m:
        threads = 32 if SIMULATOR else 256
        _embedding_kernel(kind == "bf16")[(m, -(-d // threads)), threads, stream](idd, td, y)
    return y
