"""The command line's error handling: one clear line and a non-zero exit."""

import sys

import ml_collections


def run(config: ml_collections.ConfigDict, workdir: str) -> int:
  """Runs `train_and_evaluate`; turns expected failures into one-line errors."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  # TensorFlow (tf.data, tfds) must never take GPU memory from JAX.
  from jaxmp._src import input_pipeline  # pylint: disable=g-import-not-at-top
  from jaxmp._src import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxmp._src import train  # pylint: disable=g-import-not-at-top
  import jaxmp  # pylint: disable=g-import-not-at-top
  expected = (train.ConfigError, input_pipeline.DatasetUnavailableError,
              checkpoint.CheckpointError, jaxmp.LossScaleCollapseError,
              PermissionError, ValueError)
  try:
    train.validate_config(config)
    train.initialize_distributed(config)
    train.train_and_evaluate(config, workdir)
  except expected as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  return 0
