"""The loss scale: its rule, the unscaled-gradients check, diagnostics.

* ``loss_scale``: the loss-scale rule (jmp's) and its static config.
* ``unscaled``: warns when ``update`` runs on gradients no loss scale touched.
* ``diagnostics``: per-leaf gradient overflow and underflow, in the state.

Imports only the root modules of ``jaxmp._src``.
"""
