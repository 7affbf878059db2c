"""The seed's Apex script, exactly: torchvision ResNet18, O1, SGD 0.1/0.9.

Run:

    python train.py --config configs/seed.py --workdir /tmp/seed

The PyTorch script it ports: ``torchvision.models.resnet18()`` (10 classes) on
CIFAR10, ``amp.initialize(model, optimizer, opt_level="O1")``, SGD lr 0.1,
momentum 0.9, no weight decay, constant learning rate, batch 128, 10 epochs,
``Normalize((0.5,) * 3, (0.5,) * 3)`` and no augmentation (ToTensor and
Normalize only). On the CIFAR10 test images it reaches about 71% in 10
epochs, in O1 as in fp32, as the seed's PyTorch script does on the same
images (three or four seeds each, AMD EPYC CPU, 2026-12-05; ``bench/fidelity.py
--recipe=seed`` and ``bench/seed_torch.py``): docs/performance.md, "Half
precision against fp32, on real images".
"""

from configs import default


def get_config():
  """Returns the seed configuration."""
  config = default.get_config()
  config.model = "resnet18_torchvision"
  config.policy = "O1"
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.weight_decay = 0.0
  config.lr_schedule = "constant"
  config.batch_size = 128
  config.num_epochs = 10
  config.mean = (0.5, 0.5, 0.5)
  config.std = (0.5, 0.5, 0.5)
  config.augment = False
  # The Apex script drops no step for a spike.
  config.spike_skip_window = 0
  # Gradients summed across devices in fp32 (the default, spelled out): as
  # torch DDP sums the fp32 gradients of an autocast model.
  config.grad_reduce = "fp32"
  # The default, spelled out: the split on the GPU when it fits, k steps a
  # call where the step is short.
  config.data_on_device = "auto"
  config.steps_per_call = "auto"
  return config
