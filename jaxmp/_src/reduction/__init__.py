"""Where a step's gradients are summed across devices, and in which dtype.

* ``wire``: the three ``grad_reduce`` modes, the half-wire sum and
  ``pmean_grads`` for ``shard_map`` users.
* ``report``: ``reduction_report``, the collectives of a jitted function as
  XLA partitioned them, each with its layer and kind.
* ``hlo``: the partitioned program's text read: instructions, jax's op
  names shortened to a model's path, where a value flows.

The products whose weight cotangents leave them in fp32 are autocast's
(``jaxmp._src.autocast.products``): they rewrite jaxprs.
"""
