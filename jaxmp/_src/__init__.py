"""jaxmp's implementation, one folder per concern, on floors.

The public names are in ``jaxmp``, ``jaxmp.nn`` and ``jaxmp.models``.

* ``backend``: what the default backend's GPUs run natively (fp8, blocks).
* ``dtypes``: the half dtypes, named once.
* ``frames``: the user's source line, the first frame outside libraries.
* ``nnx_support``: NNX variables unwrapped, aliased snapshots caught.
* ``vma``: which ``shard_map`` axes a value varies over.
* ``scaling/``: the loss-scale rule, finiteness, spikes, diagnostics.
* ``reduction/``: the ``grad_reduce`` modes, ``pmean_grads``, the report.
* ``autocast/``: ``autocast``, its jaxpr interpreter, op rules, fp8.
* ``state/``: the state pytrees, master-weight modes, codec, placement.
* ``inspect/``: what reads a state: accessors, reports, health checks.
* ``transform/``: ``mixed_precision``, ``multi_steps``, ``value_and_grad``.
* ``nn/``: the Flax building blocks and ResNets (flax only there).
* ``presets/``: precision policies, presets and ``initialize``.

The floors, bottom up: the root modules (they import nothing of jaxmp),
then each folder in the order above. A module imports only from its own
floor or the floors below it, never up, and no import closes a circle;
``tests/test_layout.py`` checks both (lazy imports included).
"""
