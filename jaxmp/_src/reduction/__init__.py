"""Where a step's gradients are summed across devices, and in which dtype.

* ``wire``: the ``grad_reduce`` modes, the half-wire sum, ``pmean_grads``.
* ``report``: ``reduction_report``: collectives, each with its layer and kind.
* ``hlo``: the partitioned program's text: instructions, op names, flows.

The products whose weight cotangents leave them in fp32 are autocast's
(``autocast/products.py``): they rewrite jaxprs.
"""
