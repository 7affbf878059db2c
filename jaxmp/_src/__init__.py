"""jaxmp's implementation, one folder per concern.

The public names are in ``jaxmp``, ``jaxmp.nn`` and ``jaxmp.models``.

* ``dtypes``, ``frames``, ``nnx_support``, ``vma``: small pieces every
  concern uses; they import nothing of jaxmp.
* ``scaling/``: the loss-scale rule, the unscaled-gradients check and the
  per-leaf gradient diagnostics.
* ``reduction/``: the ``grad_reduce`` modes, ``pmean_grads`` and
  ``reduction_report`` (where a step sums across devices, in what dtype).
* ``autocast/``: ``autocast`` and its jaxpr interpreter, the op rules, fp8,
  the products whose weights' cotangents leave them in fp32.
* ``transform/``: the optax transforms (``mixed_precision``, ``multi_steps``),
  their master-weights modes, and the functions that read or feed their state
  (``value_and_grad`` runs half params' losses through autocast's
  interpreter, for ``grad_reduce``).
* ``nn/``: the Flax building blocks and ResNets (flax is imported there
  only), the CPU compiler options.
* ``presets/``: precision policies, presets and ``initialize``, which tie
  the transform and autocast together.

A folder imports only from folders listed above it (``nn/`` uses
``autocast/``'s normalisation mark); ``tests/test_layout.py`` checks that no
import, lazy ones included, closes a circle.
"""
