"""``jaxmp.autocast``: a jaxpr re-evaluated with per-op dtype rules.

* ``regions``: the public ``autocast`` and ``no_autocast``, each a cached,
  named ``jit`` of a function of pytrees (Flax NNX objects lifted).
* ``interpreter``: evaluates the traced jaxpr again, op by op.
* ``rules``: the dtype each primitive runs in (the table against Apex O1
  and ``torch.autocast``), the op lists and the region marks.
* ``report``: ``debug=True``'s per-op flags and ``AutocastReport``.
* ``_jaxpr_interp``: every use of JAX internals, behind a small surface.
* ``fp8``: fp8 matrix products with per-tensor current scaling.
* ``block``: block-scaled formats (MXFP8, DeepSeek's fp8 blocks, NVFP4):
  ``quantize`` and its codes and scales.
* ``products``: the ``grad_reduce`` products, whose weights' cotangents
  leave them in fp32 (so the cross-device sums at their outputs run in fp32).
"""
