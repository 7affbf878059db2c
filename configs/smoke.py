"""Smoke test: a narrow ResNet18 on the synthetic data set, offline, on CPU.

Run:

    python train.py --config configs/smoke.py --workdir /tmp/smoke

No download: the procedural 10-class 32x32 data set is generated through the
same tfds (ArrayRecord) and numpy path as CIFAR10. Takes about a minute on two CPU cores and
should reach >= 90% test accuracy, in fp16 (O2) with dynamic loss scaling.
"""

from configs import default


def get_config():
  """Returns the smoke configuration."""
  config = default.get_config()
  config.dataset = "synthetic"
  config.synthetic_train_examples = 4096
  config.synthetic_test_examples = 1000
  config.num_filters = 8
  config.batch_size = 64
  config.eval_batch_size = 500
  config.num_epochs = 2
  config.learning_rate = 0.05
  config.weight_decay = 5e-4
  config.lr_schedule = "cosine"
  config.warmup_epochs = 0.0
  config.log_every_steps = 16
  config.mean = (0.5, 0.5, 0.5)
  config.std = (0.5, 0.5, 0.5)
  return config
