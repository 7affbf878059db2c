"""The CIFAR ResNet18 of ``jaxmp.models.resnet18``, written in PyTorch.

Used by ``bench/cpu_vs_torch.py`` and ``bench/gpu_bench.py`` to time PyTorch
on the same network: 3x3 stride-1 stem conv, BatchNorm, ReLU, no max-pool;
four stages of two torchvision ``BasicBlock``s with ``num_filters * 2**i``
channels (stride 2 from the second stage, 1x1 conv + BatchNorm projection
shortcut when the shape changes); global average pool; linear classifier.
Convs have no bias; BatchNorm momentum 0.1 (flax's 0.9), epsilon 1e-5. With
64 filters and 10 classes it has 11,173,962 params, as the Flax model.
Not the torchvision package: it is not needed, and its ResNet has the
ImageNet stem.
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
