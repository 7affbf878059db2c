"""Flax building blocks for mixed precision.

Needs flax: ``pip install 'jaxmp[flax]'``.

* `BatchNorm`: BatchNorm(+residual add)(+ReLU) whose backward pass keeps only
  its half-precision input.
* `conv_general_dilated`: ``lax.conv_general_dilated`` with faster CPU
  lowerings chosen per shape (im2col products on maps of a few pixels,
  matrix-product kernel gradients for 1x1 kernels, gradients that stay fast
  inside ``lax.fori_loop`` and ``lax.scan``); drop it into
  ``flax.linen.Conv(conv_general_dilated=...)``.
* `max_pool`: ``flax.linen.max_pool`` whose CPU gradient is elementwise work
  instead of XLA's select-and-scatter.
"""

try:
  import flax  # noqa: F401  pylint: disable=unused-import
except ImportError:
  raise ImportError("jaxmp.nn needs flax: pip install 'jaxmp[flax]'") from None

from jaxmp._src.nn.conv import conv_general_dilated
from jaxmp._src.nn.fused_norm import FusedBatchNorm as BatchNorm
from jaxmp._src.nn.pool import max_pool

__all__ = (
  "BatchNorm",
  "conv_general_dilated",
  "max_pool",
)
