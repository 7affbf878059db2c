"""Checkpoints with orbax: everything that decides the future of a run.

A checkpoint under ``<workdir>/checkpoints/<step>/`` holds the whole
`TrainState` (step, params, fp32 masters, optimizer state with the loss scale,
its counters and the skip statistics, BatchNorm statistics, the data key) and a
JSON record of the data position. The data order is a pure function of
``(seed, epoch)`` and the batch index within the epoch is ``step % steps per
epoch``, so a resumed run sees exactly the batches an uninterrupted one would.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a process killed during a save leaves the previous checkpoint
intact; leftovers are removed on the next start. A checkpoint that fails to
restore (truncated, a file missing) is skipped with a warning for the previous
one, and moved to ``<workdir>/unusable_checkpoints/``.
"""

import os
import re
import time
from typing import Any, Optional

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from cifar_train.errors import CheckpointError


def _state_handler() -> ocp.PyTreeCheckpointHandler:
  """The pytree handler of orbax, writing each replicated array from one device.

  orbax's default (on CPU and TPU) cuts every replicated array into one slice
  per replica so that several hosts share the write; each cut is an eager op,
  dispatched (and compiled, once per process) for each of the ~200 leaves on
  every save: ~1.5 s per save of a tiny ResNet on CPU for nothing, since the
  state is small. orbax already does without on GPU.
  """
  registry = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
    (np.ndarray, ocp.type_handlers.NumpyHandler()),
    (np.number, ocp.type_handlers.ScalarHandler()),
    (int, ocp.type_handlers.ScalarHandler()),
    (float, ocp.type_handlers.ScalarHandler()),
  )
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def create_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  """A manager keeping the newest ``keep`` checkpoints."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max(int(keep), 1),
    create=True,
    cleanup_tmp_directories=True,
    enable_async_checkpointing=True,
  )
  return ocp.CheckpointManager(
    os.path.abspath(os.path.join(workdir, "checkpoints")),
    options=options,
    item_handlers={
      "state": _state_handler(),
      "meta": ocp.JsonCheckpointHandler(),
    },
  )


def should_save(
  every: int, step: int, epoch_end: int, total_steps: int
) -> bool:
  """Every ``every`` steps (0: at each epoch end) and at the end."""
  if step == total_steps:
    return True
  return step % every == 0 if every > 0 else step == epoch_end


def _flatten(state) -> tuple[dict[str, Any], list[str]]:
  leaves = jax.tree_util.tree_leaves_with_path(state)
  flat = {f"leaf_{i:04d}": leaf for i, (_, leaf) in enumerate(leaves)}
  names = [jax.tree_util.keystr(path) for path, _ in leaves]
  return flat, names


def save(
  manager: ocp.CheckpointManager,
  state,
  step: int,
  end_of_epoch: bool,
  steps_per_epoch: int,
) -> None:
  """Starts an asynchronous save of ``state`` at ``step``.

  Raises:
    CheckpointError: the previous (asynchronous) save failed.
  """
  flat, names = _flatten(state)
  meta = {
    "step": step,
    "epoch": step // steps_per_epoch,
    "batch_in_epoch": step % steps_per_epoch,
    "steps_per_epoch": steps_per_epoch,
    "end_of_epoch": end_of_epoch,
    "leaves": names,
  }
  try:
    manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(flat), meta=ocp.args.JsonSave(meta)
      ),
    )
  except Exception as e:  # pylint: disable=broad-except
    raise _save_error(manager, e) from e


def wait_until_finished(manager: ocp.CheckpointManager) -> None:
  """Waits for the pending save; `CheckpointError` if it failed."""
  try:
    manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    raise _save_error(manager, e) from e


def _save_error(
  manager: ocp.CheckpointManager, error: Exception
) -> CheckpointError:
  """One line: what failed and which checkpoint a restart will use.

  orbax writes in a background thread and reports its failure (a full disk,
  a lost mount) on the next save or wait; the failed step is only in a
  temporary directory, so the newest renamed one is intact.
  """
  directory = str(manager.directory)
  complete = sorted(int(d) for d in os.listdir(directory) if d.isdigit())
  newest = os.path.join(directory, str(complete[-1])) if complete else "none"
  reason = (
    str(error).splitlines()[0][:300] if str(error) else type(error).__name__
  )
  return CheckpointError(
    f"saving a checkpoint failed: {reason}; the newest complete "
    f"checkpoint is {newest}"
  )


def _check_shapes(
  path: str, template_flat: dict, names: list[str], metadata: Any
) -> None:
  """Raises naming the first leaf whose stored shape differs from ours."""
  try:
    stored = metadata["state"]
  except (KeyError, TypeError):
    return
  if stored is None:
    return
  try:
    stored_keys = set(stored.keys())
  except Exception:  # pylint: disable=broad-except
    return
  if stored_keys != set(template_flat):
    raise CheckpointError(
      f"checkpoint {path} has {len(stored_keys)} arrays, the config builds "
      f"{len(template_flat)}: it was written by a different "
      "model/optimizer/policy"
    )
  for (key, leaf), name in zip(template_flat.items(), names):
    shape = getattr(stored[key], "shape", None)
    if shape is not None and tuple(shape) != tuple(np.shape(leaf)):
      raise CheckpointError(
        f"checkpoint {path} does not match the config at {name}: stored "
        f"shape {tuple(shape)}, config shape {tuple(np.shape(leaf))}"
      )


def _restore_error(error: Exception, names: list[str]) -> str:
  """The innermost cause, on one line, with ``leaf_NNNN`` given its name.

  TensorStore's outer error prints a whole spec; the cause says which array
  could not be read (a data file missing or truncated) and why.
  """
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  text = str(error).splitlines()[0] if str(error) else type(error).__name__
  text = re.sub(
    r"leaf_(\d{4})",
    lambda m: (
      f"{m.group(0)} = {names[int(m.group(1))]}"
      if int(m.group(1)) < len(names)
      else m.group(0)
    ),
    text,
    count=1,
  )
  return text[:300]


def _set_aside(manager: ocp.CheckpointManager, paths: list[str]) -> None:
  """Moves unusable checkpoints to ``<workdir>/unusable_checkpoints/``.

  orbax skips a save whose step is not newer than its latest one, so a broken
  checkpoint left in place would stay the newest: the resumed run would never
  replace it, and every restart would fall back again.
  """
  aside = os.path.join(
    os.path.dirname(str(manager.directory)), "unusable_checkpoints"
  )
  if jax.process_index() == 0:
    os.makedirs(aside, exist_ok=True)
    for path in paths:
      target = os.path.join(aside, os.path.basename(path))
      if os.path.exists(target):
        target += f".{time.time_ns()}"
      os.replace(path, target)
    print(
      f"WARNING: moved {len(paths)} unusable checkpoint(s) to {aside}",
      flush=True,
    )
  multihost_utils.sync_global_devices("jaxmp_set_aside_unusable_checkpoints")
  manager.reload()


def restore_latest(
  manager: ocp.CheckpointManager, template
) -> tuple[Any, Optional[str]]:
  """Restores the newest usable checkpoint into ``template``'s structure.

  Returns:
    ``(state, path)``; ``(template, None)`` when there is no checkpoint.

  Raises:
    CheckpointError: shapes do not match the config (naming the leaf), or no
      checkpoint is usable (naming the paths tried).
  """
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    return template, None
  flat, names = _flatten(template)
  treedef = jax.tree_util.tree_structure(template)
  # This process's own device: in a multi-process run jax.devices()[0]
  # belongs to process 0 and cannot receive data elsewhere.
  device = jax.local_devices()[0]
  abstract = {
    k: jax.ShapeDtypeStruct(
      np.shape(v), v.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    for k, v in flat.items()
  }
  failed = []
  for step in steps:
    path = os.path.join(str(manager.directory), str(step))
    try:
      metadata = manager.item_metadata(step)
    except Exception:  # pylint: disable=broad-except
      metadata = None
    _check_shapes(path, flat, names, metadata)
    try:
      restored = manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
            abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          ),
          meta=ocp.args.JsonRestore(),
        ),
      )
      if restored["meta"]["step"] != step or set(restored["state"]) != set(
        flat
      ):
        raise ValueError("incomplete checkpoint")
    except Exception as e:  # pylint: disable=broad-except
      reason = _restore_error(e, names)
      print(
        f"WARNING: checkpoint {path} is unusable ({reason}); "
        "falling back to an older one",
        flush=True,
      )
      failed.append(path)
      continue
    state = jax.tree_util.tree_unflatten(
      treedef, [restored["state"][k] for k in flat]
    )
    if failed:
      _set_aside(manager, failed)
    return state, path
  raise CheckpointError(
    "no usable checkpoint: " + ", ".join(failed) + " could not be "
    "restored; move them away to start afresh"
  )
