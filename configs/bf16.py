"""The default job with bfloat16 compute (fp32 params, no loss scaling).

Run:

    python train.py --config configs/bf16.py --workdir /tmp/cifar10_bf16

Same recipe as configs/default.py; should reach >= 94% on a GPU with bf16
support (A100, H100, H200).
"""

from configs import default


def get_config():
  """Returns the bf16 configuration."""
  config = default.get_config()
  config.policy = "bf16"
  return config
