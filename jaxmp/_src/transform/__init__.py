"""The optax transforms and what reads or feeds their state.

* ``mixed_precision``: fp32 masters and dynamic loss scaling; its state.
* ``master_weights``, ``rounding``: one object per master-weights mode, and
  the stochastic and Kahan rounding they use.
* ``rounding_report``: what each leaf's half dtype alone loses of its
  update (``rounding_every``), and the rows ``jaxmp.rounding_report`` reads.
* ``accumulation``: ``multi_steps``, gradient accumulation around it.
* ``sharding``: ``state_shardings``, the state placed like the params.
* ``state_codec``: the optimizer state in bf16 or int8 blocks.
* ``eager``: their per-leaf functions as one compiled program outside ``jit``.
* ``placement``: where ``mixed_precision`` sits, checked at trace time (it
  is handed the state types and imports neither transform).
* ``accessors``: ``scale_loss``, ``loss_scaler``, ``stats``, ``find_state``...
* ``value_and_grad``, ``calibrate``: the scaled gradients of a step, and an
  initial loss scale from a few of them.
"""
