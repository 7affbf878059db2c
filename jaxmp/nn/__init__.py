"""Flax building blocks for mixed precision.

Needs flax: ``pip install 'jaxmp[flax]'``.

* `BatchNorm`: BatchNorm(+residual add)(+ReLU) whose backward pass keeps only
  its half-precision input.
* `conv_general_dilated`: ``lax.conv_general_dilated`` whose kernel gradient
  is one matrix product per kernel tap on CPU; drop it into
  ``flax.linen.Conv(conv_general_dilated=...)``.
"""

try:
  import flax  # noqa: F401  pylint: disable=unused-import
except ImportError:
  raise ImportError("jaxmp.nn needs flax: pip install 'jaxmp[flax]'") from None

from jaxmp._src.conv import conv_general_dilated
from jaxmp._src.fused_norm import FusedBatchNorm as BatchNorm

__all__ = (
  "BatchNorm",
  "conv_general_dilated",
)
