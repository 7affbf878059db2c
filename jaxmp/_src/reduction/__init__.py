"""Where a step's gradients are summed across devices, and in which dtype.

* ``products``: the matrix products of ``autocast`` and ``value_and_grad``
  whose weight cotangents come out in fp32 (or on a half wire), so that the
  cross-device sum GSPMD places at their output runs in fp32.
* ``wire``: the three ``grad_reduce`` modes, the half-wire sum and
  ``pmean_grads`` for ``shard_map`` users.
* ``report``: ``reduction_report``, the collectives of a jitted function as
  XLA partitioned them.
"""
