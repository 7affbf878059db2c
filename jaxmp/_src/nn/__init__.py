"""Building blocks behind ``jaxmp.nn`` and ``jaxmp.models``.

* ``conv``, ``pool``: convolution and max-pool with fast CPU gradients.
* ``fused_norm``: BatchNorm(+add)(+ReLU) that saves only its half input.
* ``resnet``, ``torchvision``: the ResNet18s, PyTorch state dicts in and out.
* ``compiler``: XLA:CPU options for convolutions at matmul speed (no flax).

flax is imported by ``fused_norm``, ``pool``, ``resnet`` and
``torchvision`` only, never by this file: ``import jaxmp`` stays light.
"""
