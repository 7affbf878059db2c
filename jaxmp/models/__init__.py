"""Flax models built from `jaxmp.nn`: ResNet18, CIFAR and torchvision stems.

PyTorch weights in and out: `from_torchvision`, `to_torchvision`,
`read_state_dict`.

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

from jaxmp._src.nn.resnet import get_model
from jaxmp._src.nn.resnet import ResNet
from jaxmp._src.nn.resnet import resnet18
from jaxmp._src.nn.resnet import resnet18_torchvision
from jaxmp._src.nn.torchvision import from_torchvision
from jaxmp._src.nn.torchvision import read_state_dict
from jaxmp._src.nn.torchvision import to_torchvision

__all__ = (
  "from_torchvision",
  "get_model",
  "ResNet",
  "resnet18",
  "read_state_dict",
  "resnet18_torchvision",
  "to_torchvision",
)
