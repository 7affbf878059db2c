"""What reads a state: found anywhere in an optax state, reported, checked.

* ``accessors``: ``find_state``, ``scale_loss``, ``stats``, ``state_summary``...
* ``placement``: where ``mixed_precision`` sits in the chain, checked.
* ``reports``: ``overflow_report`` and ``rounding_report``, side by side.
* ``rounding_report``: ``RoundingReport``: rows, advice per leaf, a table.
* ``health``: ``rollback_if_skipped`` and ``check_health``, host-side.

Imports ``state/``, ``scaling/`` and the root modules only.
"""
