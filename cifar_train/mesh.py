"""Devices and processes: the data mesh, global arrays and host fetches."""

import os
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import Mesh, NamedSharding

from cifar_train.errors import ConfigError


def initialize_distributed(
  coordinator_address: str = "",
  num_processes: int = 1,
  process_id: int = 0,
  *,
  heartbeat_timeout_s: int = 30,
) -> None:
  """Joins a multi-process run when one is configured; no-op otherwise.

  ``coordinator_address`` (with ``num_processes`` and ``process_id``) starts
  `jax.distributed` explicitly; otherwise a cluster launcher that JAX detects
  (SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``) does.

  A process that sends no heartbeat for ``heartbeat_timeout_s`` seconds is
  dead: JAX's coordination service then aborts every other process (exit
  code 134, SIGABRT) with ``The following tasks are unhealthy (stopped
  sending heartbeats): <process ids>``, rather than leaving it waiting in a
  collective. Joining waits at most ``max(60, 2 * heartbeat_timeout_s)``
  seconds for every process to start.
  """
  timeouts = dict(
    heartbeat_timeout_seconds=int(heartbeat_timeout_s),
    initialization_timeout=max(60, 2 * int(heartbeat_timeout_s)),
    shutdown_timeout_seconds=max(10, int(heartbeat_timeout_s)),
  )
  if coordinator_address:
    jax.distributed.initialize(
      coordinator_address, num_processes, process_id, **timeouts
    )
  elif any(
    v in os.environ
    for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")
  ):
    jax.distributed.initialize(**timeouts)


def create_mesh(num_devices: int, batch_sizes: dict[str, int]) -> Mesh:
  """A 1-D ``data`` mesh over ``num_devices`` devices (0 = all).

  Args:
    num_devices: how many of the visible devices to use; 0 for all.
    batch_sizes: named global batch sizes that must split over the devices.

  Raises:
    ConfigError: too many devices asked for, or a batch that does not split.
  """
  devices = jax.devices()
  n = num_devices or len(devices)
  if n > len(devices):
    raise ConfigError(
      f"num_devices={n} but only {len(devices)} devices are visible"
    )
  for key, size in batch_sizes.items():
    if size % n:
      raise ConfigError(
        f"{key} {size} is not divisible by the {n} devices; use a "
        f"multiple of {n}"
      )
  return Mesh(np.asarray(devices[:n]), ("data",))


def global_batch(
  local: dict[str, np.ndarray], sharding: NamedSharding
) -> dict[str, jax.Array]:
  """A global array sharded over ``data`` from this process's rows."""
  return {
    k: jax.make_array_from_process_local_data(sharding, v)
    for k, v in local.items()
  }


def to_host(tree: Any) -> Any:
  """Fetches every array of ``tree`` whole, as numpy, in every process.

  * An array local to this process (all its shards here) is assembled from
    its shards (`jax.device_get`).
  * A fully replicated one that spans processes is read from one of this
    process's devices: every device holds all of it.
  * A sharded one that spans processes is gathered from all of them
    (`multihost_utils.process_allgather`). That is a collective: every
    process must fetch it at the same point, as the loop does (it never
    fetches on one process only).

  One shard of a sharded array (``addressable_data(0)``) is never taken for
  the whole: that would silently hash or log a slice.
  """

  def fetch(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    if x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(fetch, tree)
