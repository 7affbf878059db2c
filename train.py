"""Trains a Flax ResNet18 with jaxmp mixed precision.

    python train.py --config configs/smoke.py --workdir /tmp/smoke
    python train.py --config configs/default.py --workdir /tmp/cifar10 \
        --config.policy=O1 --config.num_epochs=10

See configs/ for the jobs and README.md for what each writes. Needs the app
extra: ``pip install -e '.[app]'``.
"""

import importlib.util
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "workdir",
  None,
  "Directory for metrics, plots, "
  "TensorBoard events and checkpoints (resumed if present).",
)
config_flags.DEFINE_config_file(
  "config", None, "Training configuration file.", lock_config=True
)


def _config_path(argv):
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _load_config(path: str):
  spec = importlib.util.spec_from_file_location("_train_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _config_file_error(argv):
  """Why the ``--config`` file cannot be used, or None."""
  path = _config_path(argv)
  if path is None:
    return None
  file = path.split(":", 1)[0]
  if not os.path.isfile(file):
    return f"config file {file!r} not found"
  try:
    _load_config(file)
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).splitlines()[0] if str(e) else ""
    return (
      f"config file {file!r} could not be loaded: {type(e).__name__}: {first}"
    )
  return None


def _flag_error(argv, error) -> str:
  """The one line to print for a flag that could not be parsed."""
  from cifar_train import cli  # pylint: disable=g-import-not-at-top

  path = _config_path(argv)
  if path is not None:
    config = _load_config(path.split(":", 1)[0])
    for key in cli.config_override_keys(argv):
      if key not in config:
        return cli.unknown_key_message(key, config)
  text = str(error).strip()
  if text[:1] in "'\"" and text[-1:] == text[:1]:
    text = text[1:-1]
  return text.splitlines()[0] if text else type(error).__name__


def main(argv):
  """Checks the flags and runs the job."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.config is None:
    raise app.UsageError("--config=configs/<name>.py is required")
  if not FLAGS.workdir:
    raise app.UsageError("--workdir=DIR is required")
  # Imported here so that flag errors come back in well under a second.
  from cifar_train import cli  # pylint: disable=g-import-not-at-top
  from cifar_train import startup  # pylint: disable=g-import-not-at-top

  if FLAGS.config.get("reuse_host_memory"):
    # Before JAX starts its CPU thread pools.
    startup.keep_freed_host_memory()
  return cli.run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  problem = _config_file_error(sys.argv)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    sys.exit(2)
  try:
    parsed = FLAGS(sys.argv)
  except Exception as e:  # pylint: disable=broad-except
    print(f"error: {_flag_error(sys.argv, e)}", file=sys.stderr)
    sys.exit(2)
  try:
    app.run(main, argv=sys.argv, flags_parser=lambda _: parsed)
  except KeyboardInterrupt:
    sys.exit(130)
