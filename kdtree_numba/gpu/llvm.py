"""The code-generation plumbing that every hand-written intrinsic in ``kdtree_numba.gpu`` shares.

numba exposes no vector loads, ``cp.async``, ``redux`` or ``mma``, so those are numba
``@intrinsic`` functions that emit LLVM IR or inline PTX.  Each needs the address of an array
element without numba's negative-index wraparound code (the kernels index with values known to
be in range, and the wraparound selects cost registers and instructions), and some need a bare
PTX statement.  Both are written once here; so is the decorator for device functions that NVVM
must inline.

The intrinsic helpers exist only on the GPU side: under the CUDA simulator (``SIMULATOR``) the
kernels run as Python and every primitive has a plain-Python twin instead, so this module then
defines just :func:`inline_device_function`.
"""
from __future__ import annotations

from kdtree_numba.compat import SIMULATOR, device_function

__all__ = ["inline_device_function", "array_item_pointer", "item_pointer", "element_pointer",
           "asm_statement"]


def inline_device_function(fn):
    """A device function that NVVM must inline (so its local arrays stay in registers)."""
    return fn if SIMULATOR else device_function(fn, forceinline=True)


if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def array_item_pointer(context, builder, arrty, arr, idx_types, idx_vals):
        """Pointer to ``arr[idx...]``: indices cast to intp, no wraparound, no bounds check."""
        idx_vals = [context.cast(builder, v, t, types.intp) for t, v in zip(idx_types, idx_vals)]
        ary = context.make_array(arrty)(context, builder, value=arr)
        return cgutils.get_item_pointer(context, builder, arrty, ary, idx_vals, wraparound=False)

    def item_pointer(context, builder, sig, args, n_index):
        """Pointer to a[i0, ..] for an intrinsic called as ``f(a, i0, .., i{n_index-1}, ...)``."""
        return array_item_pointer(context, builder, sig.args[0], args[0],
                                  sig.args[1:1 + n_index], args[1:1 + n_index])

    def element_pointer(context, builder, arrty, arr, idxty, idx):
        """Pointer to ``arr[idx]`` where ``idx`` is one integer or a tuple of them."""
        if isinstance(idxty, types.BaseTuple):
            idx_types, idx_vals = idxty.types, cgutils.unpack_tuple(builder, idx, len(idxty))
        else:
            idx_types, idx_vals = (idxty,), (idx,)
        return array_item_pointer(context, builder, arrty, arr, idx_types, idx_vals)

    def asm_statement(text):
        """An intrinsic ``f()`` that emits the PTX statement ``text`` (a memory clobber, never
        moved or dropped)."""
        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return types.void(), codegen
        return statement
