"""Which steps are skipped: the loss-scale rule, spikes, checks, diagnostics.

* ``loss_scale``: the loss-scale rule (jmp's) and its static config.
* ``finite``: ``all_finite``, exact on every platform, and over devices.
* ``unscaled``: warns when ``update`` gets gradients no loss scale touched.
* ``diagnostics``: per-leaf gradient overflow and underflow, in the state.
* ``spikes``: spike skipping, a step against a window of recent ones.

Imports only the root modules of ``jaxmp._src``.
"""
