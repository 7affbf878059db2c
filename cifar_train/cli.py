"""The command line's job: validate, then train.

Only the app's `UserError` becomes ``error: <message>`` with exit code 2;
any other exception is a bug and keeps its traceback.
"""

import difflib
import sys
from typing import Any, Optional, Sequence

import ml_collections

from cifar_train import settings
from cifar_train.errors import Preempted
from cifar_train.errors import UserError


def run(
  config: ml_collections.ConfigDict, workdir: str, *, data: Optional[Any] = None
) -> int:
  """Runs `loop.train_and_evaluate`; a `UserError` becomes one line.

  Args:
    config: the job's config.
    workdir: its output directory.
    data: a `data_sources.Dataset` to train on instead of the config's.

  Returns:
    The exit code: 0, or 2 after printing ``error: <message>``.
  """
  from absl import logging  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  try:
    # Validated before the heavy imports: a bad value fails at once.
    resolved = settings.resolve(config)
    if resolved.reuse_host_memory:
      from cifar_train import startup  # pylint: disable=g-import-not-at-top

      # Before JAX starts its CPU client (its thread pools): nothing above
      # has touched a device.
      startup.keep_freed_host_memory()
    from cifar_train import loop  # pylint: disable=g-import-not-at-top

    loop.train(resolved, workdir, data=data, config_record=config.to_dict())
  except UserError as e:
    return fail(str(e))
  except Preempted:  # Saved; the same command resumes.
    return 0
  return 0


def fail(message: str) -> int:
  """Prints ``error: message`` on stderr; returns the exit code 2."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  return 2


def unknown_key_message(key: str, config: ml_collections.ConfigDict) -> str:
  """``unknown config key 'x'``, with the nearest valid keys."""
  valid = sorted(config.keys())
  near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
  hint = (
    f"; did you mean {', '.join(near)}?"
    if near
    else f"; valid keys: {', '.join(valid)}"
  )
  return f"unknown config key {key!r}{hint}"


def config_override_keys(argv: Sequence[str]) -> list[str]:
  """The top-level keys of ``--config.KEY=VALUE`` overrides in ``argv``."""
  keys = []
  for arg in argv:
    if arg.startswith("--config."):
      keys.append(arg[len("--config.") :].split("=", 1)[0].split(".")[0])
  return keys
