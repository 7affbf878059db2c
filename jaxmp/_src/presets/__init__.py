"""Apex-style presets: ``get_policy``, ``get_preset`` and ``initialize``.

* ``policy``: precision policies and the presets O0-O3, bf16...
* ``initialize``: params cast, optimizer and forward wrapped by a preset.
"""
