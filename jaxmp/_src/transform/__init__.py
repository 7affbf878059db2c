"""The transforms a user composes, and the step functions around them.

* ``mixed_precision``: the transform: fp32 masters, loss scaling, ``update``.
* ``accumulation``: ``multi_steps``, gradient accumulation around it.
* ``value_and_grad``: a step's loss and scaled gradients in one call.
* ``calibrate``: ``calibrate_loss_scale``, a first scale from a few steps.
"""
