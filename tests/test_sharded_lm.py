"""``examples/sharded_lm.py`` at tiny size, run as a user runs it.

The example needs 8 devices and this process has 4, so each test reads the
JSON of a run in a subprocess (one 1-process run shared by the module, at
the suite's XLA flags, and one run of 2 `jax.distributed` processes with 4
CPU devices each over loopback). The model is one block deep; 6 steps with
a checkpoint at step 3, bf16 params under autocast with fp32 masters.
"""

import json
import os
import subprocess
import sys

import pytest

from _helpers import FAST_COMPILE
from _helpers import bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "sharded_lm.py")
TINY = ["--depth", "1", "--steps", "6", "--save-at", "3"]
FSDP = 4  # The run's mesh is ("data", "fsdp") = (2, 4).
TOKENS = 16 * 32  # --batch-size x --length: the terms of each loss's mean.
BF16_UNIT = 2.0**-8  # the spacing of bfloat16 numbers in [1, 2)
F32_UNIT = 2.0**-23


def _run(tmp_path, name: str, *extra: str, devices: int = 8) -> dict:
  """Runs the example with ``extra`` arguments; its JSON results."""
  flags = [f"--xla_force_host_platform_device_count={devices}"]
  if os.environ.get("JAXMP_DEFAULT_XLA_FLAGS") != "1":
    flags.append(FAST_COMPILE)
  out = tmp_path / f"{name}.json"
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, EXAMPLE, *TINY, "--out", str(out), *extra],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(out) as f:
    return dict(json.load(f), stdout=proc.stdout)


@pytest.fixture(scope="module")
def one_process(request, tmp_path_factory):
  # The one-device run (a step compiled for it) only where the test that
  # reads it runs (not under a ``-k`` that leaves it out).
  reads = "test_sharded_losses_are_one_devices_within_rounding"
  wanted = any(item.name == reads for item in request.session.items)
  extra = () if wanted else ("--no-unsharded",)
  return _run(tmp_path_factory.mktemp("sharded_lm"), "one", *extra)


def _drift_tolerance(losses: list[float]) -> list[float]:
  """How far two bf16 runs that sum in different orders may drift, by step.

  Step 1 starts from the same params: the two losses differ by the order of
  the mean over ``TOKENS`` fp32 terms (at most ``TOKENS`` units of fp32
  each) and by bf16 roundings of products that land on the other side of a
  rounding boundary. Every update is computed from bf16 gradients that the
  two runs reduce in different orders, one bf16 unit apart; a relative
  perturbation ``e`` of an update moves the next loss by about ``e`` times
  the loss change that update makes (first order). So step ``t`` may be off
  by ``TOKENS`` fp32 units of its loss plus one bf16 unit of each earlier
  change of the loss; a margin of 4 covers Adam's two moments and the
  second-order rest. A wrong batch, init or update moves a loss by far more
  (the losses fall by ~0.2 a step).
  """
  out, drift = [], 0.0
  for t, loss in enumerate(losses):
    if t:
      drift += BF16_UNIT * abs(loss - losses[t - 1])
    out.append(4 * (TOKENS * F32_UNIT * loss + drift))
  return out


def test_sharded_losses_are_one_devices_within_rounding(one_process):
  sharded, single = one_process["losses"], one_process["unsharded"]
  assert len(sharded) == len(single) == 6
  # Training runs: the loss falls from ln(256) = 5.55 and beyond.
  assert single[-1] < single[0] - 0.5, single
  tolerance = _drift_tolerance(single)
  for t, (a, b, tol) in enumerate(zip(sharded, single, tolerance), 1):
    assert abs(a - b) <= tol, (t, a, b, tol)


def test_each_device_holds_a_fsdp_th_of_the_state(one_process):
  """Per device: 1/4 of every sharded leaf plus the replicated ones.

  Replicated by the example's rules: the head's bias (256 values: bf16
  param, fp32 master, two fp32 moments), the spike windows (two rings of
  32 fp32 values) and the scalars (loss scale, counters, Adam's count:
  under 128 bytes). Each device holds ``sharded / 4 + replicated`` of
  ``whole = sharded + replicated``.
  """
  scalars, windows = 128, 2 * 32 * 4
  replicated = {
    "params": 256 * 2,
    "masters": 256 * 4,
    "moments": 256 * 8 + scalars,
    "opt_state": 256 * 12 + windows + scalars,
  }
  for name, (whole, device) in one_process["bytes"].items():
    assert whole > 0, name
    assert whole <= FSDP * device <= whole + (FSDP - 1) * replicated[name], (
      name,
      whole,
      device,
    )
  # The state: masters and moments, 6x the bf16 params' bytes.
  whole_state = one_process["bytes"]["opt_state"][0]
  assert whole_state >= 6 * one_process["bytes"]["params"][0]


# Not in the invariant pass: the example would run again under XLA's default
# flags (40 s of its 60 s there). Restoring onto another mesh bit for bit
# under the default flags is `tests/test_sharded_lowbit.py`'s orbax test.
def test_restore_onto_another_mesh_is_bit_equal_and_resumes_alike(
  one_process,
):
  r = one_process
  assert (r["mesh"], r["restore_mesh"]) == ("2,4", "4,2")
  assert r["restored_placed"]
  assert r["restored_fingerprint"] == r["saved_fingerprint"]
  # From the checkpoint, as from the same state moved in memory: bit for bit.
  assert r["resumed"] == r["in_memory"]
  assert r["resumed_fingerprint"] == r["in_memory_fingerprint"]
  # And, on the other mesh, the run it continues (within rounding).
  tolerance = _drift_tolerance(r["losses"])[3:]
  for a, b, tol in zip(r["resumed"], r["losses"][3:], tolerance):
    assert abs(a - b) <= tol, (a, b, tol)


def test_two_processes_train_as_one(one_process, tmp_path):
  """2 processes x 4 CPU devices (gloo collectives) against 1 x 8.

  The same program over the same mesh, from the same params, masters and
  moments, bit for bit; each process restores the checkpoint both wrote
  onto the other mesh. Sums over the 8 devices run in gloo's order, not
  one process's: the first loss (a mean of 8 devices' partial sums) within
  8 fp32 units of its value, and the fp32 gradient sums (the embedding's,
  over 8 devices) a few fp32 units apart, so that the later losses drift
  as two runs that reduce in different orders may (`_drift_tolerance`).
  """
  # Restored, not trained further: the resumed runs would only compile
  # the other mesh's step again (the one-process run checks them).
  two = _run(
    tmp_path, "two", "--processes", "2", "--no-unsharded", "--no-resume"
  )
  assert two["processes"] == 2
  assert two["bytes"] == one_process["bytes"]
  weights = two["weights_fingerprints"]
  assert set(weights) == {"initial", "saved", "end"}
  assert weights["initial"] == one_process["weights_fingerprints"]["initial"]
  assert two["restored_placed"]
  assert two["restored_fingerprint"] == two["saved_fingerprint"]
  assert two["resumed"] == two["in_memory"] == []
  losses, ones = two["losses"], one_process["losses"]
  tolerance = [8 * F32_UNIT * abs(ones[0])] + _drift_tolerance(ones)[1:]
  for a, b, tol in zip(losses, ones, tolerance, strict=True):
    assert abs(a - b) <= tol, (a, b, tol)


def test_an_eagerly_built_state_with_spike_skipping_can_be_donated():
  """Each leaf its own buffer: a donating step takes each once.

  The example's one-device run builds its state eagerly and donates it.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import jaxmp  # pylint: disable=g-import-not-at-top

  params = {"w": jnp.ones(4, jnp.bfloat16)}
  opt = jaxmp.mixed_precision(
    optax.adam(0.1), skip_spikes=jaxmp.SpikeSkip(window=4, factor=6.0)
  )
  state = opt.init(params)

  def step(params, state):
    loss_fn = lambda p: jnp.sum(p["w"].astype(jnp.float32) ** 2)
    loss, grads = jaxmp.value_and_grad(loss_fn)(params, state)
    updates, state = opt.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state

  params, state = jax.jit(step, donate_argnums=(0, 1))(params, state)
  assert float(params["w"][0]) < 1.0
  assert int(jaxmp.stats(state)["spike_skips"]) == 0


@pytest.mark.devices(4)
def test_memory_bench_smoke(tmp_path, capsys):
  """``bench/sharded_memory.py --smoke``: where each way puts the state.

  Run in this process on meshes of 1 and its 4 devices (the bench's 2 and 8
  only repeat the 4's code). Eagerly built, its fullest device holds
  ``1/n`` of the state for optax and jaxmp alike, up to the replicated
  scalars (counts, loss scale: under 64 bytes); under ``jit(init)`` only
  jaxmp's does.
  """
  out = tmp_path / "bench.json"
  bench = bench_module("sharded_memory")
  bench.main(["--smoke", "--no-time", "--devices", "1,4", "--json", str(out)])
  printed = capsys.readouterr().out
  assert "| 4 |" in printed
  assert "jaxmp_state_share_4_devices_jit_init: 0.25" in printed
  with open(out) as f:
    rows = json.load(f)["rows"]
  eager = [r for r in rows if r["init"] == "eager"]
  assert {(r["devices"], r["optimizer"]) for r in eager} == {
    (n, o) for n in (1, 4) for o in ("optax", "jaxmp")
  }
  # jaxmp's state lands like the params under jit too, with or without
  # out-shardings; plain optax's does not (the whole of it on one device).
  jaxmp_jit = [
    r for r in rows if r["optimizer"] == "jaxmp" and r["init"] != "eager"
  ]
  assert len(jaxmp_jit) == 4
  (optax_jit,) = [
    r
    for r in rows
    if (r["devices"], r["optimizer"], r["init"]) == (4, "optax", "jit(init)")
  ]
  assert optax_jit["most"] == optax_jit["whole"]
  for r in eager + jaxmp_jit:
    assert r["whole"] <= r["devices"] * r["most"], r
    assert r["devices"] * r["most"] <= r["whole"] + r["devices"] * 64, r
