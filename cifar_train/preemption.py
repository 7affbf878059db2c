"""Preemption: SIGTERM or SIGINT ends the run at a step, with a checkpoint.

A preemptible host gets SIGTERM some seconds before it goes. The loop asks
`Preemption.reached` after every step (between jitted calls, never inside
one); once it says yes, the loop saves a checkpoint at that step, prints
``preempted at step N: checkpoint saved`` and raises `Preempted`, which the
command line turns into exit code 0. Running the same command again resumes
from that checkpoint.

Every process must stop at the same step, or one would wait in a collective
for a peer that has left. In a multi-process run (`jax.distributed`) the
step is agreed by JAX's preemption sync point
(`jax.experimental.multihost_utils.reached_preemption_sync_point`): JAX's
coordination service catches SIGTERM in any process and tells every other
process, and all of them see ``True`` at the same step. SIGINT (Ctrl-C) is
turned into a SIGTERM of the process, so it takes the same path. In one
process, Python signal handlers set a flag.

A second signal while the first is being handled restores the default
handlers, so a third one ends the process at once.
"""

import signal
import threading
from typing import Optional

import jax
from jax.experimental import multihost_utils

from cifar_train import checkpoint as ckpt_lib
from cifar_train.errors import Preempted

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """A context manager: catches SIGTERM and SIGINT while the loop trains."""

  def __init__(self):
    self._multi = jax.process_count() > 1
    self._signal: Optional[int] = None
    self._previous = {}

  def __enter__(self) -> "Preemption":
    """Installs the handlers (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
      return self  # Python handlers can only be set in the main thread.
    # Multi-process: JAX's coordination service already handles SIGTERM.
    for sig in (signal.SIGINT,) if self._multi else _SIGNALS:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    """Puts the previous handlers back."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    if self._signal is not None:  # A second signal: the next one kills.
      for sig in self._previous:
        signal.signal(sig, signal.SIG_DFL)
      return
    self._signal = signum
    print(
      f"{signal.Signals(signum).name}: stopping after the current step",
      flush=True,
    )
    if self._multi:  # SIGINT: the coordination service's path.
      signal.raise_signal(signal.SIGTERM)

  def reached(self, step: int) -> bool:
    """Whether every process stops after ``step`` (call it after each step).

    Multi-process: a collective agreement, so every process must call it at
    every step, with the same ``step``.
    """
    if self._multi:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._signal is not None


def save_and_stop(
  manager,
  state,
  step: int,
  end_of_epoch: bool,
  steps_per_epoch: int,
  saved: bool,
) -> None:
  """Saves ``state`` at ``step`` (unless ``saved``), waits, raises `Preempted`.

  Raises:
    Preempted: always, once the checkpoint is on disk.
  """
  if not saved:
    ckpt_lib.save(manager, state, step, end_of_epoch, steps_per_epoch)
  ckpt_lib.wait_until_finished(manager)
  print(f"preempted at step {step}: checkpoint saved", flush=True)
  raise Preempted(step)
