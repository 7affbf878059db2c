"""Shared test helpers: a driver that runs training jobs in child processes.

`python tests/_helpers.py SPEC.json` imports jax, TensorFlow and jaxmp once,
reads the data set once, then runs each job of the spec in a forked child, with
an optional fault injected into orbax in that child only. Forking after the
imports but before JAX has a backend (the parent never touches a device) gives
every child a fresh runtime for a few seconds of CPU instead of a ~15 s cold
start, so a test can SIGKILL a run at several points cheaply. Jobs run in
device-resident mode (``data_on_device``) on data read by the parent, so that a
child never runs TensorFlow, whose runtime the parent already started.

A job is ``{"workdir", "config": {overrides}, "fault", "step", "log",
"remove": [globs]}``; the parent first deletes the largest file that each
glob of ``remove`` matches. The child's stdout and stderr go to ``log``.
The driver writes, per job, the exit code (``-9`` for SIGKILL) and then the
checkpoint directory's `listing` to ``SPEC["results"]``. Faults, at
checkpoint ``step``:

* ``kill_before_save``: the previous save has completed; no write has started.
* ``kill_during_write``: the step's temporary directory is being written (the
  first data file has appeared; the rename is held back until the kill).
* ``kill_after_write``: everything is written, ``commit_success`` included,
  just before the temporary directory is renamed.
* ``kill_during_cleanup``: half-way through deleting checkpoint ``step``, the
  oldest beyond ``keep_checkpoints`` once a newer one is renamed: its
  ``state`` is gone, the rest is still there.
* ``enospc``: the state's ``_METADATA`` write fails with ``ENOSPC`` (disk full)
  in orbax's background writer thread.

Run a job through ``cli.run`` (the command line's error handling) with
``"cli": true``. With ``SPEC["one_block"]`` every job trains the one-block
net of `one_block_models` instead of ResNet18.

`run_distributed` starts the processes of a multi-process (`jax.distributed`)
run on localhost instead, see `distributed_main`. `bench_module` imports a
script of ``bench/`` for the tests of the benchmarks.
"""

import errno
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))


def _legacy_emitters() -> str:
  """XLA:CPU's older kernel emitters, on jaxlib 0.10 only.

  jaxlib 0.10 emits each fusion's kernel through MLIR by default; its older
  LLVM IR emitters, with one codegen thread a program, compile the suite's
  programs in about a third of the CPU time
  (``bench/diagnose/suite_compiles.py``). jaxlib 0.11 removed them (its XLA
  stops at the unknown flag), and jaxlib 0.9's compute float8 products
  wrong (``tests/test_fp8.py`` fails there), so elsewhere nothing is added.
  """
  from importlib import metadata  # pylint: disable=g-import-not-at-top

  try:
    major_minor = tuple(
      int(p) for p in metadata.version("jaxlib").split(".")[:2]
    )
  except (metadata.PackageNotFoundError, ValueError):
    return ""
  if major_minor != (0, 10):
    return ""
  # One LLVM module a program: with these emitters, splitting a program's
  # kernels over codegen threads costs more CPU than it saves.
  return (
    " --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
  )


# The tests use tiny shapes, so XLA's slow LLVM optimisations and its slower
# kernel emitters only cost compile time (without these flags, compiling is
# most of the suite's CPU time). The claims that depend on how XLA rounds
# (bitwise equalities between two programs), and the one model gradient that
# the older emitters get wrong, run without them (``-m invariant``).
FAST_COMPILE = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  + _legacy_emitters()
)
ROOT = os.path.dirname(TESTS)
TMP_MARK = ".orbax-checkpoint-tmp"


def tiny_config(data_dir: str, **overrides):
  """``configs/smoke.py`` shrunk to a 4-filter net, 6 steps, on 256 images."""
  from configs import smoke  # pylint: disable=g-import-not-at-top

  config = smoke.get_config()
  config.data_dir = data_dir
  config.synthetic_train_examples = 256
  config.synthetic_test_examples = 100
  config.num_filters = 4
  config.batch_size = 32
  config.eval_batch_size = 64
  config.num_epochs = 1
  config.num_train_steps = 6
  config.log_every_steps = 1
  config.checkpoint_every_steps = 2
  config.progress_bar = False
  for key, value in overrides.items():
    config[key] = value
  return config


def plot_series_only(reporter) -> None:
  """`Reporter.plot` in the suite's runs of the app: the series, no drawing.

  Drawing plots.png costs about 0.2 s of CPU per run (0.5 s for the first of
  a process, importing matplotlib), in each of the suite's many runs; the
  drawing is checked where a test is marked ``plots``
  (tests/test_loop.py's end-to-end run, tests/test_reporting.py).
  """
  reporter.plot_series()


def _one_block(create_model):
  def create_one_block_model(*args, **kwargs):
    return create_model(*args, **kwargs).clone(stage_sizes=(1,))

  return create_one_block_model


def one_block_models(monkeypatch) -> None:
  """Makes the app build a one-block ResNet instead of ResNet18.

  One stage of one ``BasicBlock`` after the stem (``conv1``, ``bn1``,
  ``layer1_0`` with ``conv1``, ``bn1``, ``conv2``, ``bn2``, then ``fc``):
  every leaf kind of ResNet18 (convolutions, BatchNorm scale, bias and
  statistics, a dense layer) at a fraction of its compile time. For tests whose
  point is not ResNet18's architecture; `run_driver`'s ``one_block`` does the
  same in its child jobs.
  """
  from cifar_train import steps  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(steps, "create_model", _one_block(steps.create_model))


def load_tiny_data(data_dir: str):
  """The synthetic data set of `tiny_config`."""
  from cifar_train import loop  # pylint: disable=g-import-not-at-top
  from cifar_train import settings  # pylint: disable=g-import-not-at-top

  return loop.load_data(settings.resolve(tiny_config(data_dir)))


def run_driver(
  spec: dict, path: str, *, devices: int = 4, timeout: float = 300
) -> list[dict]:
  """Runs the driver on ``spec`` (written to ``path``); returns the results."""
  spec = dict(spec, results=path + ".results.json")
  with open(path, "w") as f:
    json.dump(spec, f)
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
    + FAST_COMPILE,
  )
  out = subprocess.run(
    [sys.executable, __file__, path],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(spec["results"]) as f:
    return json.load(f)


def random_data(n: int = 100, size: int = 8, seed: int = 0):
  """Random uint8 images; label i marks example i, to trace the order."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
  return images, np.arange(n, dtype=np.int32)


def crop_options(image: np.ndarray) -> list[np.ndarray]:
  """All 2 * 9 * 9 pad-4 crops (flipped or not) of `image`."""
  h, w, _ = image.shape
  padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
  out = []
  for dy in range(9):
    for dx in range(9):
      crop = padded[dy : dy + h, dx : dx + w]
      out += [crop, crop[:, ::-1]]
  return out


def is_valid_crop(out: np.ndarray, image: np.ndarray) -> bool:
  return any(np.array_equal(out, c) for c in crop_options(image))


def conv_f64(x, w, stride, pad):
  """NHWC x HWIO -> NHWC in float64 with zero padding (numpy, by taps)."""
  x = np.pad(
    np.asarray(x, np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0))
  )
  w = np.asarray(w, np.float64)
  kh, kw = w.shape[:2]
  ho = (x.shape[1] - kh) // stride + 1
  wo = (x.shape[2] - kw) // stride + 1
  out = 0
  for dy in range(kh):
    for dx in range(kw):
      patch = x[
        :, dy : dy + stride * ho : stride, dx : dx + stride * wo : stride
      ]
      out = out + np.einsum("nhwi,io->nhwo", patch, w[dy, dx])
  return out


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def read_log(job: dict) -> str:
  with open(job["log"]) as f:
    return f.read()


def tmp_dirs(workdir: str) -> list[str]:
  return sorted(
    glob.glob(os.path.join(workdir, "checkpoints", f"*{TMP_MARK}*"))
  )


def listing(workdir: str) -> dict[str, list[str]]:
  """``{entry of <workdir>/checkpoints: its entries}``."""
  root = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(root):
    return {}
  return {
    name: sorted(os.listdir(os.path.join(root, name)))
    for name in sorted(os.listdir(root))
    if os.path.isdir(os.path.join(root, name))
  }


def _kill() -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _step_of(path) -> int:
  m = re.search(r"/(\d+)" + re.escape(TMP_MARK), str(path))
  return int(m.group(1)) if m else -1


def _install_fault(fault: str, at: int) -> None:
  """Patches orbax/jaxmp in this (child) process; see the module docstring."""
  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import async_path
  from orbax.checkpoint._src.path import atomicity
  from orbax.checkpoint._src.path import deleter
  from cifar_train import checkpoint

  save = checkpoint.save
  if fault == "kill_before_save":

    def patched_save(manager, state, step, *args):
      if step == at:
        manager.wait_until_finished()  # The previous save is complete.
        _kill()
      return save(manager, state, step, *args)

    checkpoint.save = patched_save

  elif fault == "kill_during_write":
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held_finalize(self, *args, **kwargs):
      if _step_of(self.get()) == at:
        threading.Event().wait()  # Never renamed: the kill comes first.
      return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = held_finalize

    def patched_save(manager, state, step, *args):
      save(manager, state, step, *args)
      if step == at:
        pattern = os.path.join(
          str(manager.directory), f"{at}{TMP_MARK}*", "state*", "**", "*"
        )
        deadline = time.time() + 20
        files = []
        while time.time() < deadline and not files:
          files = [
            p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)
          ]
          time.sleep(0.001)
        print(
          f"killing during the write of {at} ({len(files)} files written)",
          flush=True,
        )
        _kill()

    checkpoint.save = patched_save

  elif fault == "kill_after_write":
    rename = async_path.rename

    async def patched_rename(src, dst):
      if _step_of(src) == at:
        done = os.path.exists(os.path.join(str(src), "commit_success.txt"))
        print(
          f"killing before the rename of {src} (commit_success: {done})",
          flush=True,
        )
        _kill()
      return await rename(src, dst)

    async_path.rename = patched_rename

  elif fault == "kill_during_cleanup":
    delete = deleter.PathDeleter.delete

    def patched_delete(self, path, *args, **kwargs):
      if os.path.basename(str(path)) == str(at):
        shutil.rmtree(os.path.join(str(path), "state"))
        print(f"killing while deleting {path}", flush=True)
        _kill()
      return delete(self, path, *args, **kwargs)

    deleter.PathDeleter.delete = patched_delete

  elif fault == "enospc":
    write_text = async_path.write_text

    async def full_disk(path, text):
      if _step_of(path) == at and os.path.basename(str(path)) == "_METADATA":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
      return await write_text(path, text)

    async_path.write_text = full_disk

  elif fault:
    raise ValueError(f"unknown fault {fault!r}")


def _run_job(job: dict, data) -> None:
  """The child: redirects output, installs the fault, trains."""
  fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  sys.stdout = os.fdopen(1, "w", buffering=1)
  sys.stderr = os.fdopen(2, "w", buffering=1)
  # pylint: disable=g-import-not-at-top
  from cifar_train import cli
  from cifar_train import loop

  config = tiny_config(
    job["data_dir"], data_on_device=True, **job.get("config", {})
  )
  _install_fault(job.get("fault", ""), int(job.get("step", 0)))
  if job.get("cli"):
    os._exit(cli.run(config, job["workdir"], data=data))  # pylint: disable=protected-access
  summary = loop.train_and_evaluate(config, job["workdir"], data=data)
  print("fingerprint", summary["params_fingerprint"], flush=True)
  print("state_fingerprint", summary["state_fingerprint"], flush=True)
  os._exit(0)  # pylint: disable=protected-access


def main(spec_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  sys.path.insert(0, TESTS)
  sys.path.insert(0, ROOT)
  # pylint: disable=g-import-not-at-top,unused-import
  import jax  # noqa: F401
  import matplotlib.pyplot  # noqa: F401
  import tensorboardX  # noqa: F401
  import orbax.checkpoint  # noqa: F401

  from cifar_train import reporting  # pylint: disable=g-import-not-at-top

  reporting.Reporter.plot = plot_series_only  # The children inherit these.
  if spec.get("one_block"):
    from cifar_train import steps  # pylint: disable=g-import-not-at-top

    steps.create_model = _one_block(steps.create_model)
  # The parent reads the data (TensorFlow) but never initialises JAX.
  data = load_tiny_data(spec["data_dir"])
  results = []
  for job in spec["jobs"]:
    job = dict(job, data_dir=spec["data_dir"])
    for pattern in job.get("remove", ()):  # A file lost before this job.
      os.remove(max(glob.glob(pattern, recursive=True), key=os.path.getsize))
    pid = os.fork()
    if pid == 0:
      try:
        _run_job(job, data)
      finally:
        os._exit(70)  # pylint: disable=protected-access
    _, status, usage = os.wait4(pid, 0)
    results.append(
      {
        "exit": os.waitstatus_to_exitcode(status),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "checkpoints": listing(job["workdir"]),
      }
    )
  with open(spec["results"], "w") as f:
    json.dump(results, f)


def distributed_main(spec_path: str, process_id: int) -> None:
  """One process of a `jax.distributed` run: each job of the spec in turn.

  Every job trains in ``spec["workdir"]`` (so the second one resumes from the
  first's checkpoint) and prints ``process <i> job <j> fingerprint <hex>``.
  """
  with open(spec_path) as f:
    spec = json.load(f)
  sys.path.insert(0, TESTS)
  sys.path.insert(0, ROOT)
  # pylint: disable=g-import-not-at-top
  from cifar_train import mesh

  if spec.get("check") == "to_host":
    mesh.initialize_distributed(
      spec["coordinator_address"], spec["num_processes"], process_id
    )
    _print_host_reads(process_id)
    return
  from cifar_train import loop
  from cifar_train import reporting
  from cifar_train import steps
  from cifar_train.errors import Preempted

  reporting.Reporter.plot = plot_series_only
  if spec.get("one_block"):
    steps.create_model = _one_block(steps.create_model)
  job_index = _JOB_INDEX
  for j, overrides in enumerate(spec["jobs"]):
    overrides = dict(overrides)
    workdir = overrides.pop("workdir", spec.get("workdir"))
    config = tiny_config(spec["data_dir"], **spec.get("config", {}))
    for key, value in overrides.items():
      config[key] = value
    if j == 0:
      mesh.initialize_distributed(
        spec["coordinator_address"],
        spec["num_processes"],
        process_id,
        heartbeat_timeout_s=config.distributed_heartbeat_timeout_s,
      )
      if spec.get("die") == process_id:
        _die_after_steps(os.path.join(workdir, "steps.jsonl"), 2)
      sigterm = spec.get("sigterm") or {}
      if sigterm.get("process") == process_id:
        _sigterm_at_step(sigterm["job"], sigterm["step"])
    job_index[0] = j
    try:
      summary = loop.train_and_evaluate(config, workdir)
    except Preempted as e:
      print(f"process {process_id} job {j} preempted at step {e.step}")
      continue
    print(
      f"process {process_id} job {j} fingerprint "
      f"{summary['params_fingerprint']} state {summary['state_fingerprint']}",
      flush=True,
    )


_JOB_INDEX = [0]  # The job `distributed_main` runs now.


def _sigterm_at_step(job: int, step: int) -> None:
  """SIGTERM to this process after ``step`` of job ``job``, then 2 s still.

  At a step, not from a thread: on a warm compile cache the 6 steps take
  less than the notice needs to reach the other process. The pause lets
  JAX's coordination service tell the other process before either reaches
  the next preemption check.
  """
  from cifar_train import preemption  # pylint: disable=g-import-not-at-top

  reached = preemption.Preemption.reached

  def patched(self, at: int) -> bool:
    if _JOB_INDEX[0] == job and at == step:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(2)
    return reached(self, at)

  preemption.Preemption.reached = patched


def _die_after_steps(
  steps_path: str, count: int, signum: int = signal.SIGKILL
) -> None:
  """Sends ``signum`` to this process once ``steps_path`` logs ``count``."""
  import threading  # pylint: disable=g-import-not-at-top

  def watch():
    while True:
      if os.path.exists(steps_path):
        with open(steps_path) as f:
          if len(f.read().splitlines()) >= count:
            print(f"killed after {count} steps at {time.time()}", flush=True)
            os.kill(os.getpid(), signum)
            return
      time.sleep(0.05)

  threading.Thread(target=watch, daemon=True).start()


def _print_host_reads(process_id: int) -> None:
  """Prints what `mesh.to_host` and the fingerprint read of global arrays.

  ``x`` (8 x 4, values 0..31) is sharded over every device of every
  process, so each process holds only its rows; ``r`` is replicated.
  """
  # pylint: disable=g-import-not-at-top
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from cifar_train import mesh
  from cifar_train import steps

  devices = Mesh(np.asarray(jax.devices()), ("data",))
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  sharded = jax.make_array_from_callback(
    x.shape, NamedSharding(devices, P("data")), lambda index: x[index]
  )
  replicated = jax.make_array_from_callback(
    x.shape, NamedSharding(devices, P()), lambda index: x[index]
  )
  assert not sharded.is_fully_addressable
  host = mesh.to_host({"x": sharded, "r": replicated})
  state = steps.TrainState(
    step=np.int32(0),
    params={"w": sharded},
    batch_stats={},
    opt_state={},
    rng=np.zeros(2, np.uint32),
  )
  print(
    f"process {process_id} x {host['x'].ravel().tolist()} "
    f"r {host['r'].ravel().tolist()} "
    f"fingerprint {steps.state_fingerprint(state)}",
    flush=True,
  )


def free_port() -> int:
  import socket  # pylint: disable=g-import-not-at-top

  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_distributed(
  spec: dict,
  path: str,
  *,
  num_processes: int,
  local_devices: int,
  timeout: float = 300,
  returncodes: Optional[list] = None,
) -> list[str]:
  """Runs `distributed_main` in ``num_processes`` processes; their outputs.

  Every process must exit 0, unless ``returncodes`` (a list) is given: it
  then receives ``(returncode, time.time() when it was seen to exit)`` of
  each process, in order.
  """
  spec = dict(
    spec,
    num_processes=num_processes,
    coordinator_address=f"localhost:{free_port()}",
  )
  with open(path, "w") as f:
    json.dump(spec, f)
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices} "
    + FAST_COMPILE,
  )
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, "--distributed", path, str(i)],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(num_processes)
  ]
  outputs = []
  try:
    deadline = time.time() + timeout
    for proc in procs:
      out, _ = proc.communicate(timeout=max(deadline - time.time(), 1))
      outputs.append(out)
      if returncodes is not None:
        returncodes.append((proc.returncode, time.time()))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  if returncodes is None:
    for proc, out in zip(procs, outputs):
      assert proc.returncode == 0, out[-4000:]
  return outputs


def tiny_mlp_params(dtype="float16"):
  """A 4-8-3 two-layer MLP's params (``dense1``, ``dense2``), seeded."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "dense1": {
      "kernel": (jax.random.normal(k1, (4, 8)) * 0.5).astype(dtype),
      "bias": jnp.zeros(8, dtype),
    },
    "dense2": {
      "kernel": jax.random.normal(k2, (8, 3)).astype(dtype),
      "bias": jnp.zeros(3, dtype),
    },
  }


def dynamic_loss_scale(
  scale: float, *, period: int, factor: int, min_loss_scale: float
):
  """``jmp.DynamicLossScale`` with every setting spelled out (float32).

  Args:
    scale: The initial loss scale.
    period: Finite steps before the scale grows by ``factor``.
    factor: The growth and back-off factor.
    min_loss_scale: The scale never goes below this.
  """
  import jmp  # pylint: disable=g-import-not-at-top

  return jmp.DynamicLossScale(
    np.float32(scale),
    period=period,
    factor=factor,
    min_loss_scale=np.float32(min_loss_scale),
  )


def fake_split(n, num_labels, seed):
  """``(labels, images)`` of ``n`` random CIFAR-shaped examples."""
  rng = np.random.default_rng(seed)
  labels = np.stack(
    [
      rng.integers(0, 20 if num_labels == 2 and k == 0 else 10, n)
      for k in range(num_labels)
    ],
    1,
  ).astype(np.uint8)
  images = rng.integers(0, 256, (n, 32, 32, 3), np.uint8)
  return labels, images


def place_archive(data_dir, name, n_train=10, n_test=4):
  """A tiny archive of CIFAR ``name`` in the manual dir; returns the splits."""
  num_labels = 2 if name == "cifar100" else 1
  splits = {
    "train": fake_split(n_train, num_labels, 0),
    "test": fake_split(n_test, num_labels, 1),
  }
  manual = os.path.join(data_dir, "downloads", "manual")
  os.makedirs(manual, exist_ok=True)
  from cifar_train import cifar  # pylint: disable=g-import-not-at-top

  archive = cifar.BUILDERS[name](data_dir=data_dir).manual_archive()
  cifar.write_archive(archive, name, splits["train"], splits["test"])
  return splits


def no_probe(*args, **kwargs):
  """A stand-in for the network probe that fails if it is called."""
  raise AssertionError("the network was probed")


def bench_module(name: str):
  """``bench/<name>.py`` as a module (``bench/`` is not a package)."""
  import importlib.util  # pylint: disable=g-import-not-at-top

  path = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "bench",
    f"{name}.py",
  )
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


if __name__ == "__main__":
  if sys.argv[1] == "--distributed":
    distributed_main(sys.argv[2], int(sys.argv[3]))
  else:
    main(sys.argv[1])


def backend_compiles(fn) -> int:
  """How many programs XLA compiled while ``fn()`` ran."""
  import jax  # pylint: disable=g-import-not-at-top

  events = []

  def listen(name, _, **__):
    if name == "/jax/core/compile/backend_compile_duration":
      events.append(name)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return len(events)


def bytes_on_device(tree, device) -> tuple[int, int, int]:
  """``(whole, scalars, on_device)``: bytes of ``tree``'s arrays.

  ``whole`` counts every leaf once, ``scalars`` its 0-d leaves, and
  ``on_device`` the shards that ``device`` holds.
  """
  import jax  # pylint: disable=g-import-not-at-top

  leaves = jax.tree_util.tree_leaves(tree)
  whole = sum(x.nbytes for x in leaves)
  scalars = sum(x.nbytes for x in leaves if x.ndim == 0)
  on_device = sum(
    s.data.nbytes
    for x in leaves
    for s in x.addressable_shards
    if s.device == device
  )
  return whole, scalars, on_device
