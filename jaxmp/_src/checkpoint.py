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
one.
"""

import os
from typing import Any, Optional

from absl import logging
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
  """No usable checkpoint, or one that does not fit the config."""


def create_manager(workdir: str, config: ml_collections.ConfigDict
                   ) -> ocp.CheckpointManager:
  """A manager keeping the newest ``config.keep_checkpoints`` checkpoints."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max(int(config.keep_checkpoints), 1),
      create=True,
      cleanup_tmp_directories=True,
      enable_async_checkpointing=True)
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")), options=options,
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


def should_save(config: ml_collections.ConfigDict, step: int, epoch_end: int,
                total_steps: int) -> bool:
  """Every ``checkpoint_every_steps`` steps (0: each epoch end) and the end."""
  every = int(config.checkpoint_every_steps)
  if step == total_steps:
    return True
  return step % every == 0 if every > 0 else step == epoch_end


def _flatten(state) -> tuple[dict[str, Any], list[str]]:
  leaves = jax.tree_util.tree_leaves_with_path(state)
  flat = {f"leaf_{i:04d}": leaf for i, (_, leaf) in enumerate(leaves)}
  names = [jax.tree_util.keystr(path) for path, _ in leaves]
  return flat, names


def save(manager: ocp.CheckpointManager, state, step: int,
         end_of_epoch: bool, steps_per_epoch: int) -> None:
  """Starts an asynchronous save of ``state`` at ``step``."""
  flat, names = _flatten(state)
  meta = {"step": step, "epoch": step // steps_per_epoch,
          "batch_in_epoch": step % steps_per_epoch,
          "steps_per_epoch": steps_per_epoch, "end_of_epoch": end_of_epoch,
          "leaves": names}
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)))


def _check_shapes(path: str, template_flat: dict, names: list[str],
                  metadata: Any) -> None:
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
        "model/optimizer/policy")
  for (key, leaf), name in zip(template_flat.items(), names):
    shape = getattr(stored[key], "shape", None)
    if shape is not None and tuple(shape) != tuple(np.shape(leaf)):
      raise CheckpointError(
          f"checkpoint {path} does not match the config at {name}: stored "
          f"shape {tuple(shape)}, config shape {tuple(np.shape(leaf))}")


def restore_latest(manager: ocp.CheckpointManager, template,
                   workdir: str) -> tuple[Any, Optional[str]]:
  """Restores the newest usable checkpoint into ``template``'s structure.

  Returns:
    ``(state, path)``; ``(template, None)`` when there is no checkpoint.

  Raises:
    CheckpointError: shapes do not match the config (naming the leaf), or no
      checkpoint is usable (naming the paths tried).
  """
  del workdir
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    return template, None
  flat, names = _flatten(template)
  treedef = jax.tree_util.tree_structure(template)
  device = jax.devices()[0]
  abstract = {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype,
                                      sharding=jax.sharding.SingleDeviceSharding(
                                          device))
              for k, v in flat.items()}
  failed = []
  for step in steps:
    path = os.path.join(str(manager.directory), str(step))
    try:
      metadata = manager.item_metadata(step)
    except Exception:  # pylint: disable=broad-except
      metadata = None
    _check_shapes(path, flat, names, metadata)
    try:
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          meta=ocp.args.JsonRestore()))
      if restored["meta"]["step"] != step or set(restored["state"]) != set(flat):
        raise ValueError("incomplete checkpoint")
    except Exception as e:  # pylint: disable=broad-except
      reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
      logging.warning("checkpoint %s is unusable (%s); trying an older one",
                      path, reason)
      print(f"WARNING: checkpoint {path} is unusable ({reason}); "
            "falling back to an older one", flush=True)
      failed.append(path)
      continue
    state = jax.tree_util.tree_unflatten(
        treedef, [restored["state"][k] for k in flat])
    return state, path
  raise CheckpointError(
      "no usable checkpoint: " + ", ".join(failed) + " could not be "
      "restored; move them away to start afresh")
