"""How the transforms' state stores the params and moments, and where it lives.

* ``pytrees``: ``MixedPrecisionState``, ``AccumulationState``: what is saved.
* ``master_weights``: one object per master-weights mode and its buffers.
* ``modes``: ``master_weights=`` to its mode object, one for all or per leaf.
* ``rounding``: stochastic rounding and Kahan's split, bit for bit.
* ``rounding_figures``: what each leaf's half dtype loses, measured in a step.
* ``state_codec``: the inner optimizer's state in bf16 or int8 blocks.
* ``sharding``: ``state_shardings``; each state leaf placed like its param.
* ``checks``: a state given to ``update`` fits the params (tree, mesh, dtype).
* ``eager``: per-leaf functions as one compiled program outside ``jit``.

Imports the root modules and ``scaling/``; nothing above them.
"""
