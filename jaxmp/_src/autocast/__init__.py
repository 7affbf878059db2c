"""``jaxmp.autocast``: a jaxpr re-evaluated with per-op dtype rules.

* ``regions``: ``autocast``, ``no_autocast``: cached, named jits of pytrees.
* ``interpreter``: evaluates the traced jaxpr again, op by op.
* ``rules``: the dtype of each primitive (the table), op lists, region marks.
* ``report``: ``debug=True``'s per-op flags and ``AutocastReport``.
* ``_jaxpr_interp``: every use of JAX internals, behind a small surface.
* ``_jaxpr_custom``: ``custom_jvp``/``custom_vjp`` re-bound (JAX internals).
* ``fp8``: fp8 matrix products with per-tensor current scaling.
* ``block``: block-scaled formats (MXFP8, DeepSeek's fp8, NVFP4): ``quantize``.
* ``block_recipe``: ``BlockRecipe`` and its block-scaled products.
* ``products``: the ``grad_reduce`` products, weights' cotangents in fp32.
"""
