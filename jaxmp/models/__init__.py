"""Flax models built from `jaxmp.nn`: ResNet18, CIFAR and torchvision stems.

Needs flax: ``pip install 'jaxmp[flax]'``.

>>> from jaxmp import models
>>> models.get_model("resnet18", num_classes=100).num_classes
100
"""

try:
  import flax  # noqa: F401  pylint: disable=unused-import
except ImportError:
  raise ImportError(
    "jaxmp.models needs flax: pip install 'jaxmp[flax]'"
  ) from None

from jaxmp._src.resnet import get_model
from jaxmp._src.resnet import ResNet
from jaxmp._src.resnet import resnet18
from jaxmp._src.resnet import resnet18_torchvision

__all__ = (
  "get_model",
  "ResNet",
  "resnet18",
  "resnet18_torchvision",
)
