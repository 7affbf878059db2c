"""The default job in fp32 (Apex O0): the accuracy and speed baseline.

Run:

    python train.py --config configs/fp32.py --workdir /tmp/cifar10_fp32

Same recipe as configs/default.py; should reach >= 94% on a GPU, like O2.
"""

from configs import default


def get_config():
  """Returns the fp32 configuration."""
  config = default.get_config()
  config.policy = "O0"
  return config
