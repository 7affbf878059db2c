"""Param shapes of the CIFAR ResNet18 (11,173,962 params), for benchmarks."""

import numpy as np


def resnet18_param_shapes(num_classes: int = 10, width: int = 64) -> dict:
  """Returns {name: (shape, is_batchnorm)} for a CIFAR-stem ResNet18."""
  shapes = {"conv_init/kernel": ((3, 3, 3, width), False)}
  shapes["bn_init/scale"] = ((width,), True)
  shapes["bn_init/bias"] = ((width,), True)
  cin = width
  for stage, mult in enumerate((1, 2, 4, 8)):
    cout = width * mult
    for block in range(2):
      stride = 2 if stage > 0 and block == 0 else 1
      name = f"stage{stage}_block{block}"
      shapes[f"{name}/conv1/kernel"] = ((3, 3, cin, cout), False)
      shapes[f"{name}/conv2/kernel"] = ((3, 3, cout, cout), False)
      for bn in ("bn1", "bn2"):
        shapes[f"{name}/{bn}/scale"] = ((cout,), True)
        shapes[f"{name}/{bn}/bias"] = ((cout,), True)
      if stride != 1 or cin != cout:
        shapes[f"{name}/proj/kernel"] = ((1, 1, cin, cout), False)
        shapes[f"{name}/proj_bn/scale"] = ((cout,), True)
        shapes[f"{name}/proj_bn/bias"] = ((cout,), True)
      cin = cout
  shapes["head/kernel"] = ((cin, num_classes), False)
  shapes["head/bias"] = ((num_classes,), False)
  return shapes


def num_params(shapes: dict) -> int:
  return sum(int(np.prod(s)) for s, _ in shapes.values())
