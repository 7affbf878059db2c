"""The ResNet18s of ``jaxmp.models``, written in PyTorch.

`ResNet18` is the CIFAR-stem ``jaxmp.models.resnet18``; `TorchvisionResNet18`
is ``torchvision.models.resnet18`` (the torchvision package is not installed
here: with torch 2.13.0 its wheel does not import), with torchvision's module
names and init, for ``jaxmp.models.resnet18_torchvision``.

Used by ``bench/cpu_vs_torch.py`` and ``bench/gpu_bench.py`` to time PyTorch
on the same network: 3x3 stride-1 stem conv, BatchNorm, ReLU, no max-pool;
four stages of two torchvision ``BasicBlock``s with ``num_filters * 2**i``
channels (stride 2 from the second stage, 1x1 conv + BatchNorm projection
shortcut when the shape changes); global average pool; linear classifier.
Convs have no bias; BatchNorm momentum 0.1 (flax's 0.9), epsilon 1e-5. With
64 filters and 10 classes it has 11,173,962 params, as the Flax model.
"""

import torch
from torch import nn


class BasicBlock(nn.Module):
  """Two 3x3 convs with BatchNorm, a (projection) shortcut and ReLU."""

  def __init__(self, in_ch: int, out_ch: int, stride: int):
    super().__init__()
    self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(out_ch)
    self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(out_ch)
    self.downsample = None
    if stride != 1 or in_ch != out_ch:
      self.downsample = nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 1, stride, 0, bias=False),
        nn.BatchNorm2d(out_ch),
      )

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(self.bn1(self.conv1(x)))
    y = self.bn2(self.conv2(y))
    shortcut = x if self.downsample is None else self.downsample(x)
    return torch.relu(y + shortcut)


class ResNet18(nn.Module):
  """ResNet18 with the CIFAR stem; NCHW input, logits out.

  Args:
    num_classes: Number of output classes.
    num_filters: Channels of the first stage (doubled at each stage).
  """

  def __init__(self, num_classes: int = 10, num_filters: int = 64):
    super().__init__()
    f = num_filters
    self.conv1 = nn.Conv2d(3, f, 3, 1, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(f)
    blocks, in_ch = [], f
    for i in range(4):
      out_ch = f * 2**i
      for j in range(2):
        blocks.append(BasicBlock(in_ch, out_ch, 2 if i > 0 and j == 0 else 1))
        in_ch = out_ch
    self.layers = nn.Sequential(*blocks)
    self.fc = nn.Linear(in_ch, num_classes)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = torch.relu(self.bn1(self.conv1(x)))
    x = self.layers(x)
    return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class TorchvisionResNet18(nn.Module):
  """``torchvision.models.resnet18(num_classes=...)``: the ImageNet stem.

  7x7 stride-2 conv, BatchNorm, ReLU, 3x3 stride-2 max-pool, four stages of
  two `BasicBlock` (``downsample`` shortcuts), average pool, ``fc``. The
  module names (``conv1``, ``bn1``, ``layer1.0.conv1``, ...,
  ``layer2.0.downsample.0``, ``fc``) and the init (kaiming-normal fan-out
  convs, unit BatchNorm) are torchvision's, so its state dicts load as is.
  With 10 classes it has 11,181,642 params.

  Args:
    num_classes: Number of output classes.
    num_filters: Channels of the first stage (64 in torchvision).
  """

  def __init__(self, num_classes: int = 1000, num_filters: int = 64):
    super().__init__()
    f = num_filters
    self.conv1 = nn.Conv2d(3, f, 7, 2, 3, bias=False)
    self.bn1 = nn.BatchNorm2d(f)
    self.maxpool = nn.MaxPool2d(3, 2, 1)
    in_ch = f
    for i in range(4):
      out_ch = f * 2**i
      stride = 2 if i > 0 else 1
      layer = nn.Sequential(
        BasicBlock(in_ch, out_ch, stride), BasicBlock(out_ch, out_ch, 1)
      )
      setattr(self, f"layer{i + 1}", layer)
      in_ch = out_ch
    self.fc = nn.Linear(in_ch, num_classes)
    for m in self.modules():
      if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
    for i in range(4):
      x = getattr(self, f"layer{i + 1}")(x)
    return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def torchvision_resnet18(num_classes: int = 1000) -> nn.Module:
  """``torchvision.models.resnet18`` when torchvision imports, else ours."""
  try:
    import torchvision  # pylint: disable=g-import-not-at-top

    return torchvision.models.resnet18(num_classes=num_classes)
  except Exception:  # pylint: disable=broad-except
    return TorchvisionResNet18(num_classes)
