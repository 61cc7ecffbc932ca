"""The GPU primitives every kernel family builds on, and their only home.

numba.cuda leaves out what the kernels here need: vector loads and stores, ``cp.async``,
``redux``, ``mma``, bit casts, block reductions; and the CUDA simulator (the CI target) leaves
out every warp intrinsic.  Each module holds one kind, with the simulator twin next to the GPU
version:

* ``llvm``       -- the shared plumbing of the hand-written intrinsics (element pointers,
  PTX statements, forced inlining);
* ``memory``     -- 16-byte loads/stores, cp.async, shared/global addresses, stores without
  wraparound;
* ``bits``       -- bit reinterpretation and bf16 widening;
* ``warp``       -- shuffles, ballot, any, syncwarp, redux, warp max/sum (``WARP``,
  ``FULL_MASK``);
* ``reduce``     -- block, shared-memory tree and lane-group reductions, barrier helpers;
* ``tensorcore`` -- TF32 conversion and ``mma.sync`` m16n8k8;
* ``pool``       -- numba's device allocations from CuPy's memory pool (installed by compat);
* ``launch``     -- kernel launches without numba's per-call host work (compat wraps each
  kernel on a GPU).

Import from the module (``from kdtree_numba.gpu.memory import load_f32x4``); this package
imports nothing itself, so using one kind does not load the others.
"""
