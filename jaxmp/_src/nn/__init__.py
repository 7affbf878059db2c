"""Building blocks behind ``jaxmp.nn`` and ``jaxmp.models``.

* ``conv``: convolution with fast CPU gradients.
* ``pool``: max-pool with fast CPU gradients.
* ``fused_norm``: BatchNorm(+add)(+ReLU) that saves only its half input.
* ``resnet``: the Flax ResNet18s, CIFAR and torchvision stems.
* ``torchvision``: PyTorch state dicts in and out (numpy only).
* ``compiler``: XLA:CPU options for convolutions at matmul speed (no flax).

flax is imported by ``fused_norm``, ``pool``, ``resnet`` and
``torchvision`` only, never by this file: ``import jaxmp`` stays light.
"""
