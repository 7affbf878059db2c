"""Checkpoints with orbax: everything that decides the future of a run.

A checkpoint under ``<workdir>/checkpoints/<step>/`` holds the whole
`TrainState` (step, params, fp32 masters, optimizer state with the loss scale,
its counters and the skip statistics, BatchNorm statistics, the data key) and a
JSON record of the data position. The data order is a pure function of
``(seed, epoch)`` and the batch index within the epoch is ``step % steps per
epoch``, so a resumed run sees exactly the batches an uninterrupted one would.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a process killed during a save leaves the previous checkpoint
intact; leftovers are removed on the next start. Only a checkpoint that is
positively corrupt (a file missing or truncated, unreadable JSON: orbax and
TensorStore say so, see `corruption`; or an array whose CRC-32 differs from
the one recorded at save time, since neither stores checksums) is skipped
with a warning for the previous one, and moved to
``<workdir>/unusable_checkpoints/``. Any other
error of a restore (an I/O error such as ``EIO``, a timeout, a bug) stops the
run with that error, every checkpoint left where it is: the next run, once
the storage answers again, resumes from the newest.
"""

import contextlib
import errno
import json
import os
import re
import sys
import time
from typing import Any, Optional
import zlib

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from cifar_train import mesh as mesh_lib
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


def checksums(flat: dict[str, Any]) -> dict[str, str]:
  """CRC-32 of each leaf's bytes, fetched whole to the host (`mesh.to_host`).

  Orbax and TensorStore store none: a flipped bit in an array's data file
  restores silently. `save` records them; `restore_latest` checks them.
  """
  out = {}
  for key, leaf in flat.items():
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
      leaf.dtype, jax.dtypes.prng_key
    ):
      leaf = jax.random.key_data(leaf)
    data = np.ascontiguousarray(mesh_lib.to_host(leaf))
    out[key] = f"{zlib.crc32(data.tobytes()):08x}"
  return out


def _verify(restored: dict[str, Any], recorded: Optional[dict]) -> None:
  """Raises `CorruptCheckpointError` at the first leaf whose CRC differs.

  A checkpoint written before checksums were recorded has none: not checked.
  """
  if not recorded:
    return
  found = checksums(restored)
  for key in sorted(recorded):
    if found.get(key) != recorded[key]:
      raise CorruptCheckpointError(
        f"checksum mismatch in {key}: recorded {recorded[key]}, "
        f"read {found.get(key)}"
      )


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
    # One host fetch of the state per save (orbax makes its own copy for the
    # asynchronous write); ~0.1 s for the ResNet18 state on a CPU.
    "checksums": checksums(flat),
  }
  try:
    manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(flat), meta=ocp.args.JsonSave(meta)
      ),
    )
  except Exception as e:  # pylint: disable=broad-except
    if _is_io_error(e):
      raise _save_error(manager, e) from e
    raise


def wait_until_finished(manager: ocp.CheckpointManager) -> None:
  """Waits for the pending save; `CheckpointError` if it failed."""
  try:
    manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    if _is_io_error(e):
      raise _save_error(manager, e) from e
    raise


def close(manager: ocp.CheckpointManager) -> None:
  """Waits for the pending save and closes; `CheckpointError` if it failed."""
  try:
    manager.close()
  except Exception as e:  # pylint: disable=broad-except
    if _is_io_error(e):
      raise _save_error(manager, e) from e
    raise


@contextlib.contextmanager
def open_manager(workdir: str, keep: int):
  """`create_manager` as a context manager: closed on every exit.

  On the way out of a failed run the pending save is still finished (orbax's
  writer thread must not outlive the run); an error of that save is printed
  as a warning, and the run's own error is the one raised.
  """
  manager = create_manager(workdir, keep)
  try:
    yield manager
  except BaseException as error:
    try:
      manager.close()
    except Exception as e:  # pylint: disable=broad-except
      if _chain(e)[-1] is not _chain(error)[-1]:  # Not the same failure.
        print(
          f"WARNING: closing the checkpoints after an error: {_reason(e)}",
          file=sys.stderr,
          flush=True,
        )
    raise
  close(manager)


def _chain(error: BaseException) -> list[BaseException]:
  """``error`` and its causes and contexts, outermost first."""
  chain = [error]
  while True:
    nxt = chain[-1].__cause__ or chain[-1].__context__
    if nxt is None or nxt in chain:
      return chain
    chain.append(nxt)


def _reason(error: BaseException) -> str:
  text = str(error).splitlines()[0][:300] if str(error) else ""
  return text or type(error).__name__


def _is_io_error(error: BaseException) -> bool:
  """Whether ``error`` comes from the storage (an `OSError` in its chain)."""
  return any(isinstance(e, OSError) for e in _chain(error))


def _save_error(
  manager: ocp.CheckpointManager, error: Exception
) -> CheckpointError:
  """One line: what failed and which checkpoint a restart will use.

  orbax writes in a background thread and reports its failure (a full disk,
  a lost mount: an `OSError`, `_is_io_error`) on the next save or wait; the
  failed step is only in a temporary directory, so the newest renamed one is
  intact. Any other error is a bug, raised as it is by the callers.
  """
  directory = str(manager.directory)
  complete = sorted(int(d) for d in os.listdir(directory) if d.isdigit())
  newest = os.path.join(directory, str(complete[-1])) if complete else "none"
  return CheckpointError(
    f"saving a checkpoint failed: {_reason(error)}; the newest complete "
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


class CorruptCheckpointError(ValueError):
  """A checkpoint whose files disagree with each other (ours to raise)."""


# TensorStore's status codes of a file that is missing, cut short or
# malformed: "NOT_FOUND: Error opening ... does not exist", "OUT_OF_RANGE:
# ... Requested byte range [0, 2291) is not valid for value of size 1278",
# "FAILED_PRECONDITION: ... Truncated Zstd-compressed stream", "DATA_LOSS:
# ... checksum mismatch". Its I/O errors ("UNAVAILABLE", "DEADLINE_EXCEEDED",
# "UNKNOWN: ... [OS error 5: Input/output error]") are not among them.
_CORRUPT_STATUS = re.compile(
  r"^(NOT_FOUND|OUT_OF_RANGE|FAILED_PRECONDITION|DATA_LOSS): "
)
_OS_ERROR = re.compile(r"\[OS error (\d+)")


def corruption(error: BaseException) -> Optional[BaseException]:
  """The link of ``error``'s chain that proves a checkpoint corrupt, or None.

  Positively corrupt: a file missing (`FileNotFoundError`, TensorStore's
  ``NOT_FOUND``), cut short or malformed (``OUT_OF_RANGE``,
  ``FAILED_PRECONDITION``, ``DATA_LOSS``, JSON that does not parse), or
  files that disagree (`CorruptCheckpointError`). None for anything else,
  and for any chain that holds an I/O error: an `OSError` other than "no
  such file" (``EIO``, a timeout, a lost mount) or TensorStore's report of
  one may pass on the next try, and a bug is a bug.
  """
  chain = _chain(error)
  for e in chain:
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
      return None
    found = _OS_ERROR.search(str(e))
    if found and int(found.group(1)) != errno.ENOENT:
      return None
  for e in chain:
    if isinstance(
      e, (FileNotFoundError, json.JSONDecodeError, CorruptCheckpointError)
    ):
      return e
    if isinstance(e, ValueError) and _CORRUPT_STATUS.match(str(e)):
      return e
  return None


def _restore_error(error: BaseException, names: list[str]) -> str:
  """The cause, on one line, with ``leaf_NNNN`` given its name.

  TensorStore's outer error prints a whole spec; the cause says which array
  could not be read (a data file missing or truncated) and why.
  """
  text = _reason(error)
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


def _note_kept(error: BaseException, path: str) -> None:
  error.add_note(
    f"while restoring {path}; this is not a sign of a corrupt checkpoint, "
    "so every checkpoint was left where it is: run again once the cause is "
    "fixed to resume from the newest"
  )


def restore_latest(
  manager: ocp.CheckpointManager, template
) -> tuple[Any, Optional[str]]:
  """Restores the newest usable checkpoint into ``template``'s structure.

  Returns:
    ``(state, path)``; ``(template, None)`` when there is no checkpoint.

  Only checkpoints proven corrupt (`corruption`) are passed over, for the
  next older one, and set aside once one restores.

  Raises:
    CheckpointError: shapes do not match the config (naming the leaf), or no
      checkpoint is usable (naming the paths tried).
    Exception: any other error of a restore (``OSError(EIO)``, a timeout, a
      bug), as it is, with a note; no checkpoint is moved.
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
    except Exception as e:  # pylint: disable=broad-except
      if corruption(e) is None:
        _note_kept(e, path)
        raise
      metadata = None  # The restore below finds what is wrong.
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
        raise CorruptCheckpointError(
          f"incomplete checkpoint: the record says step "
          f"{restored['meta']['step']}, with {len(restored['state'])} arrays"
        )
      _verify(restored["state"], restored["meta"].get("checksums"))
    except Exception as e:  # pylint: disable=broad-except
      cause = corruption(e)
      if cause is None:  # An I/O error or a bug: stop, move nothing.
        _note_kept(e, path)
        raise
      reason = _restore_error(cause, names)
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
