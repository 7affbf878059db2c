"""``jaxmp.autocast``: a jaxpr re-evaluated with per-op dtype rules.

* ``regions``: ``autocast``, its interpreter and rules (split next).
* ``_jaxpr_interp``: every use of JAX internals, behind a small surface.
* ``fp8``: fp8 matrix products with per-tensor current scaling.
"""
