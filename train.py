"""Trains a Flax ResNet18 with jaxmp mixed precision.

    python train.py --config configs/smoke.py --workdir /tmp/smoke
    python train.py --config configs/default.py --workdir /tmp/cifar10 \
        --config.policy=O1 --config.num_epochs=10

See configs/ for the jobs and README.md for what each writes.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for metrics, plots, "
                    "TensorBoard events and checkpoints (resumed if present).")
config_flags.DEFINE_config_file(
    "config", None, "Training configuration file.", lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.config is None:
    raise app.UsageError("--config=configs/<name>.py is required")
  if not FLAGS.workdir:
    raise app.UsageError("--workdir=DIR is required")
  # Imported here so that flag errors come back in well under a second.
  from jaxmp._src import cli  # pylint: disable=g-import-not-at-top
  return cli.run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  try:
    app.run(main)
  except KeyboardInterrupt:
    sys.exit(130)
