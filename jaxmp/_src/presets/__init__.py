"""Apex-style presets: ``get_policy``, ``get_preset`` and ``initialize``.

* ``policy``: precision policies and the presets O0-O3, bf16...
* ``initialize``: casts params and wraps an optimizer and a forward function
  by a preset, as Apex's ``amp.initialize``.
"""
