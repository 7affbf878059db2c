"""Where a step's gradients are summed across devices, and in which dtype.

* ``wire``: the three ``grad_reduce`` modes, the half-wire sum and
  ``pmean_grads`` for ``shard_map`` users.
* ``report``: ``reduction_report``, the collectives of a jitted function as
  XLA partitioned them.

The products whose weight cotangents leave them in fp32 are autocast's
(``jaxmp._src.autocast.products``): they rewrite jaxprs.
"""
