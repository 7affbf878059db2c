"""End-to-end training: configs, steps per policy, outputs, resume, devices."""

import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

import jaxmp
from configs import bf16, default, fp32, seed, smoke
from jaxmp._src import checkpoint
from jaxmp._src import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def tiny_config(data_dir, **overrides):
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


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("module", [default, seed, fp32, bf16, smoke])
def test_configs_load_and_validate(module):
  config = module.get_config()
  train.validate_config(config)
  assert module.__doc__ and "python train.py --config configs/" in (
      module.__doc__)


def test_seed_config_is_the_apex_script():
  c = seed.get_config()
  assert (c.model, c.policy, c.learning_rate, c.momentum, c.batch_size,
          c.num_epochs, tuple(c.mean), tuple(c.std)) == (
              "resnet18_torchvision", "O1", 0.1, 0.9, 128, 10, (0.5,) * 3,
              (0.5,) * 3)


@pytest.mark.parametrize("policy", ["O0", "O1", "O2", "O3", "bf16"])
def test_one_train_step_per_policy(policy, data_dir):
  # 2**15 overflows the fp16 gradients of this tiny net on its first step,
  # which dynamic scaling would then handle by skipping; start lower here.
  config = tiny_config(data_dir, policy=policy, init_loss_scale=2.0**8)
  model = train.create_model(config, 10)
  optimizer = train.create_optimizer(config, lambda _: 0.05)
  state = train.create_train_state(config, model, optimizer, (16, 16, 3))
  preset = jaxmp.get_preset(policy)
  kernel = state.params["conv1"]["kernel"]
  assert kernel.dtype == preset.policy.param_dtype
  # Running statistics always stay fp32; BatchNorm params follow the preset.
  assert {x.dtype for x in jax.tree.leaves(state.batch_stats)} == {
      jnp.dtype(jnp.float32)}
  assert state.params["bn1"]["scale"].dtype == (
      jnp.float32 if preset.keep_batchnorm_fp32 else jnp.float16)
  step = jax.jit(train.make_train_step(config, model, optimizer))
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.standard_normal((4, 16, 16, 3)), jnp.float32)
  labels = jnp.asarray([0, 1, 2, 3])
  new, metrics = step(state, images, labels, train.zero_metrics())
  assert int(new.step) == 1 and int(metrics["count"]) == 4
  assert np.isfinite(float(metrics["last_loss"]))
  assert bool(jaxmp.stats(new.opt_state)["grads_finite"])
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.params,
                         new.params)
  assert all(jax.tree.leaves(changed))
  if preset.master_weights:
    masters = jaxmp.master_params(new.opt_state, new.params)
    np.testing.assert_array_equal(
        masters["conv1"]["kernel"].astype(kernel.dtype),
        new.params["conv1"]["kernel"])
  # NaN in the data: the step is skipped and BatchNorm stats roll back.
  bad, _ = step(new, images.at[0, 0, 0, 0].set(jnp.nan), labels,
                train.zero_metrics())
  assert not bool(jaxmp.stats(bad.opt_state)["grads_finite"])
  for a, b in zip(jax.tree.leaves((new.params, new.batch_stats)),
                  jax.tree.leaves((bad.params, bad.batch_stats))):
    np.testing.assert_array_equal(a, b)


def test_train_and_evaluate_synthetic_writes_everything(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  summary = train.train_and_evaluate(tiny_config(data_dir), workdir)
  assert summary["steps"] == 6 and summary["num_devices"] == 4
  assert len(summary["params_fingerprint"]) == 64
  for key in ("test_loss", "test_accuracy", "train_loss", "train_accuracy",
              "wall_seconds", "num_processes", "config"):
    assert key in summary
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["params_fingerprint"] == summary["params_fingerprint"]
  (record,) = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert set(record) == {"epoch", "step", "train_loss", "train_accuracy",
                         "test_loss", "test_accuracy", "loss_scale",
                         "skipped_steps", "images_per_sec"}
  assert 0 <= record["test_accuracy"] <= 1 and record["step"] == 6
  assert os.path.getsize(os.path.join(workdir, "plots.png")) > 1000
  assert glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "2", "4", "6"][-default.get_config().keep_checkpoints:]
  assert [r["step"] for r in read_jsonl(os.path.join(workdir, "steps.jsonl"))
          ] == [1, 2, 3, 4, 5, 6]


def test_eval_counts_every_example_once(data_dir):
  config = tiny_config(data_dir)
  data = train.load_data(config)
  mesh = train.create_mesh(config)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      "data"))
  model = train.create_model(config, data.num_classes)
  optimizer = train.create_optimizer(config, lambda _: 0.1)
  state = train.create_train_state(config, model, optimizer, (32, 32, 3))
  result = train.evaluate(config, jax.jit(train.make_eval_step(config, model)),
                          state, data, sharding)
  assert result["count"] == 100  # 2 batches of 64, 28 padded rows masked.


def test_resume_is_exact(data_dir, tmp_path):
  """6 steps in one go == 4 steps, stop, resume to 6 (same workdir)."""
  full = str(tmp_path / "full")
  ref = train.train_and_evaluate(tiny_config(data_dir), full)
  again = str(tmp_path / "again")
  assert train.train_and_evaluate(tiny_config(data_dir), again)[
      "params_fingerprint"] == ref["params_fingerprint"]  # same seed
  split = str(tmp_path / "split")
  train.train_and_evaluate(tiny_config(data_dir, num_train_steps=4), split)
  resumed = train.train_and_evaluate(tiny_config(data_dir), split)
  assert resumed["params_fingerprint"] == ref["params_fingerprint"]
  assert resumed["steps"] == 6
  losses = lambda d: [(r["step"], r["loss"], r["loss_scale"]) for r in
                      read_jsonl(os.path.join(d, "steps.jsonl"))]
  assert losses(split) == losses(full)


def test_truncated_checkpoint_falls_back(data_dir, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  config = tiny_config(data_dir, num_train_steps=4, keep_checkpoints=3)
  train.train_and_evaluate(config, workdir)
  newest = os.path.join(workdir, "checkpoints", "4")
  for path in glob.glob(os.path.join(newest, "state", "**", "*"),
                        recursive=True):
    if os.path.isfile(path) and os.path.getsize(path) > 100:
      with open(path, "r+b") as f:
        f.truncate(10)
  manager = checkpoint.create_manager(workdir, config)
  template = train.create_train_state(
      config, train.create_model(config, 10),
      train.create_optimizer(config, lambda _: 0.1), (32, 32, 3))
  state, path = checkpoint.restore_latest(manager, template)
  assert path.endswith(os.path.join("checkpoints", "2"))
  assert int(state.step) == 2
  assert "checkpoints/4 is unusable" in capsys.readouterr().out
  # The unusable checkpoint was set aside; put it back as the only one left.
  os.replace(os.path.join(workdir, "unusable_checkpoints", "4"), newest)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "2"))
  manager = checkpoint.create_manager(workdir, config)
  with pytest.raises(checkpoint.CheckpointError, match="checkpoints/4"):
    checkpoint.restore_latest(manager, template)


def test_checkpoint_shape_mismatch_names_the_leaf(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(tiny_config(data_dir, num_train_steps=2), workdir)
  with pytest.raises(checkpoint.CheckpointError, match=r"does not match the config at \.params\['bn1'\]\['bias'\]: stored shape \(4,\), config shape \(8,\)"):
    train.train_and_evaluate(tiny_config(data_dir, num_filters=8), workdir)


def test_device_resident_mode_trains_the_same_model(data_dir, tmp_path):
  a = train.train_and_evaluate(
      tiny_config(data_dir, num_train_steps=8, checkpoint_every_steps=0),
      str(tmp_path / "host"))
  split = str(tmp_path / "device")
  train.train_and_evaluate(
      tiny_config(data_dir, num_train_steps=4, data_on_device=True), split)
  b = train.train_and_evaluate(
      tiny_config(data_dir, num_train_steps=8, data_on_device=True), split)
  # Same model, data, init and order of batches in size; only the
  # augmentation draws differ, so the losses are close, not equal.
  assert a["steps"] == b["steps"] == 8
  assert abs(a["train_loss"] - b["train_loss"]) < 0.35
  fresh = train.train_and_evaluate(
      tiny_config(data_dir, num_train_steps=8, data_on_device=True),
      str(tmp_path / "device_fresh"))
  assert fresh["params_fingerprint"] == b["params_fingerprint"]  # resumed


def test_one_device_and_four_devices_agree(data_dir, tmp_path):
  one = train.train_and_evaluate(
      tiny_config(data_dir, num_devices=1, policy="O0"), str(tmp_path / "1"))
  four = train.train_and_evaluate(
      tiny_config(data_dir, num_devices=4, policy="O0"), str(tmp_path / "4"))
  assert (one["num_devices"], four["num_devices"]) == (1, 4)
  assert four["train_loss"] == pytest.approx(one["train_loss"], rel=0.02)
  assert four["test_loss"] == pytest.approx(one["test_loss"], rel=0.02)


def test_cifar10_under_mock_data(tmp_path):
  config = tiny_config("", dataset="cifar10", num_train_steps=2,
                       checkpoint_every_steps=0)
  with tfds.testing.mock_data(num_examples=96):
    summary = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["steps"] == 2 and np.isfinite(summary["test_loss"])


@pytest.mark.parametrize("override,match", [
    ({"model": "resnet50"}, "unknown model 'resnet50'.*resnet18"),
    ({"policy": "O7"}, "unknown policy 'O7'.*O0, O1"),
    ({"dataset": "mnist"}, "unknown dataset 'mnist'.*cifar10"),
    ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
    ({"batch_size": 30}, "batch_size 30 is not divisible by the 4 devices"),
    ({"dataset": "image_folder", "data_dir": ""}, "needs --config.data_dir"),
    ({"dataset": "image_folder", "data_dir": "/nonexistent/x"},
     "'/nonexistent/x' does not exist"),
])
def test_bad_config_values_fail_before_writing(override, match, data_dir,
                                               tmp_path):
  override = dict(override)
  config = tiny_config(override.pop("data_dir", data_dir), **override)
  workdir = tmp_path / "run"
  with pytest.raises(train.ConfigError, match=match):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists() or not any(workdir.iterdir())


def _train_py(*args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout,
                        env=env)


def test_cli_unknown_key_and_bad_policy(tmp_path):
  out = _train_py("--config", "configs/smoke.py", "--workdir", str(tmp_path),
                  "--config.no_such_key=1")
  assert out.returncode != 0 and "no_such_key" in out.stderr
  out = _train_py("--config", "configs/smoke.py", "--workdir", str(tmp_path),
                  "--config.policy=O9")
  assert out.returncode != 0
  assert "error: unknown policy 'O9'" in out.stderr
  out = _train_py("--config", "configs/missing.py", "--workdir", str(tmp_path))
  assert out.returncode != 0 and "missing.py" in out.stderr
  assert not os.listdir(tmp_path)
