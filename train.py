"""Trains a Flax ResNet18 with jaxmp mixed precision.

    python train.py --config configs/smoke.py --workdir /tmp/smoke
    python train.py --config configs/default.py --workdir /tmp/cifar10 \
        --config.policy=O1 --config.num_epochs=10

See configs/ for the jobs and README.md for what each writes. Needs the app
extra: ``pip install -e '.[app]'``.

The config file is executed once, here: its ``get_config()`` (or
``get_config(ARG)`` for ``--config=FILE:ARG``) becomes the default of a
`config_flags.DEFINE_config_dict` flag, which applies the
``--config.KEY=VALUE`` overrides. A missing or broken file, an unknown key
or a bad value is one ``error:`` line and exit code 2.
"""

import importlib.util
import os
import sys
from typing import Optional

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


def split_config_arg(argv: list[str]) -> tuple[Optional[str], list[str]]:
  """``(the --config value, argv without it)``."""
  rest, path, i = [], None, 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      path = argv[i + 1]
      i += 1
    else:
      rest.append(arg)
    i += 1
  return path, rest


class ConfigFileError(Exception):
  """The ``--config`` file cannot be used; the message says why."""


def load_config(path: str):
  """Executes the config file once; its ``get_config()``.

  Raises:
    ConfigFileError: the file is missing, or executing it or its
      ``get_config`` raised (the message names the file and the error).
  """
  file, _, arg = path.partition(":")
  if not os.path.isfile(file):
    raise ConfigFileError(f"config file {file!r} not found")
  try:
    spec = importlib.util.spec_from_file_location("_train_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()
  except Exception as e:  # pylint: disable=broad-except
    # The user's own code, whatever it raised: name the file and the error.
    first = str(e).splitlines()[0] if str(e) else ""
    raise ConfigFileError(
      f"config file {file!r} could not be loaded: {type(e).__name__}: {first}"
    ) from e


def override_error(argv: list[str], config) -> Optional[str]:
  """The line for an override of a key that ``config`` lacks, or None."""
  from cifar_train import cli  # pylint: disable=g-import-not-at-top

  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config.") :].split("=", 1)[0].split(".")
    if path[0] not in config:
      return cli.unknown_key_message(path[0], config)
    if len(path) > 1:  # The app's config is flat: no key has fields.
      return f"config key {path[0]!r} has no field {'.'.join(path[1:])!r}"
  return None


def parse(argv: list[str]) -> list[str]:
  """Loads the config once, defines ``--config`` with it, parses ``argv``.

  Returns:
    The arguments that are not flags (absl's ``argv``).

  Raises:
    ConfigFileError: no usable config, or an override it rejects.
  """
  path, rest = split_config_arg(argv)
  if path is None:
    raise ConfigFileError("--config=configs/<name>.py is required")
  config = load_config(path)
  problem = override_error(rest, config)
  if problem:
    raise ConfigFileError(problem)
  # DEFINE_config_dict applies the overrides of sys.argv when defined.
  sys.argv = rest
  try:
    config_flags.DEFINE_config_dict(
      "config", config, "Training configuration.", lock_config=True
    )
    return FLAGS(rest)
  except flags.Error as e:
    text = str(e).strip()
    if text[:1] in "'\"" and text[-1:] == text[:1]:
      text = text[1:-1]
    raise ConfigFileError(
      text.splitlines()[0] if text else type(e).__name__
    ) from e


def main(argv):
  """Checks the flags and runs the job."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.workdir:
    raise app.UsageError("--workdir=DIR is required")
  # Imported here so that flag errors come back in well under a second.
  from cifar_train import cli  # pylint: disable=g-import-not-at-top

  return cli.run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  try:
    parsed = parse(sys.argv)
  except ConfigFileError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    app.run(main, argv=sys.argv, flags_parser=lambda _: parsed)
  except KeyboardInterrupt:
    sys.exit(130)
