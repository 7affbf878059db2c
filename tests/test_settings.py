"""The config resolved once: validation, the precision record, the configs."""

import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxmp
from cifar_train import settings
from cifar_train.errors import ConfigError
from configs import bf16, default, fp32, seed, smoke


@pytest.mark.parametrize("module", [default, seed, fp32, bf16, smoke])
def test_configs_resolve_and_say_how_to_run(module):
  s = settings.resolve(module.get_config())
  assert isinstance(s, settings.Settings)
  assert module.__doc__ and "python train.py --config configs/" in (
    module.__doc__
  )


def test_every_config_key_becomes_a_setting():
  config = default.get_config()
  fields = set(settings.Settings.__dataclass_fields__)
  precision_keys = {
    "policy",
    "init_loss_scale",
    "loss_scale_period",
    "loss_scale_factor",
    "min_loss_scale",
    "max_loss_scale",
    "loss_scale_hysteresis",
    "master_weights",
    "optimizer_state",
    "optimizer_state_min_size",
    "grad_reduce",
  }
  spike_keys = {"spike_skip_window", "spike_skip_factor"}  # -> skip_spikes
  assert set(config.keys()) - precision_keys - spike_keys == fields - {
    "precision",
    "skip_spikes",
  }


def test_auto_loss_scale_is_calibrated_later():
  config = default.get_config()
  config.init_loss_scale = "auto"
  p = settings.resolve(config).precision
  assert p.calibrate
  q = settings.with_initial_scale(p, 2.0**9)
  assert not q.calibrate and float(q.loss_scale.loss_scale) == 2.0**9
  assert q.loss_scale.period == p.loss_scale.period == 2000
  assert float(q.loss_scale.min_loss_scale) == 1.0


# CIFAR10's training split (50,000 images), per channel over every pixel of
# the images scaled to [0, 1]: the mean and (population) std that
# torchvision-style recipes normalise with.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


@pytest.mark.parametrize("module", [default, fp32, bf16])
def test_cifar10_configs_normalise_with_cifar10_statistics(module):
  c = module.get_config()
  assert c.dataset == "cifar10"
  np.testing.assert_allclose(c.mean, CIFAR10_MEAN, rtol=0, atol=5e-5)
  np.testing.assert_allclose(c.std, CIFAR10_STD, rtol=0, atol=5e-5)
  s = settings.resolve(c)
  np.testing.assert_allclose(s.mean, CIFAR10_MEAN, rtol=0, atol=5e-5)
  np.testing.assert_allclose(s.std, CIFAR10_STD, rtol=0, atol=5e-5)


def test_seed_config_is_the_apex_script():
  c = seed.get_config()
  assert (
    c.model,
    c.policy,
    c.learning_rate,
    c.momentum,
    c.batch_size,
    c.num_epochs,
    tuple(c.mean),
    tuple(c.std),
  ) == ("resnet18_torchvision", "O1", 0.1, 0.9, 128, 10, (0.5,) * 3, (0.5,) * 3)
  # The app decides, on the devices it finds, where the data lives and how
  # many steps a call runs.
  assert (c.data_on_device, c.steps_per_call) == ("auto", "auto")


@pytest.mark.parametrize(
  "policy,param,compute,norm,scale_type,masters",
  [
    ("O0", jnp.float32, jnp.float32, jnp.float32, None, False),
    # O1: the fp32 model under jaxmp.autocast (precision.autocast).
    ("O1", jnp.float32, jnp.float32, jnp.float32, jmp.DynamicLossScale, False),
    ("O2", jnp.float16, jnp.float16, jnp.float32, jmp.DynamicLossScale, True),
    ("O3", jnp.float16, jnp.float16, jnp.float16, None, False),
    ("bf16", jnp.float32, jnp.bfloat16, jnp.float32, None, False),
    ("bf16-kahan", jnp.bfloat16, jnp.bfloat16, jnp.float32, None, "kahan"),
  ],
)
def test_precision_record(policy, param, compute, norm, scale_type, masters):
  config = default.get_config()
  config.policy = policy
  config.init_loss_scale = 2.0**10
  config.loss_scale_period = 7
  p = settings.resolve(config).precision
  assert (p.param_dtype, p.compute_dtype, p.norm_dtype, p.master_weights) == (
    param,
    compute,
    norm,
    masters,
  )
  if scale_type is jmp.DynamicLossScale:
    assert isinstance(p.loss_scale, jmp.DynamicLossScale)
    assert float(p.loss_scale.loss_scale) == 2.0**10
    assert p.loss_scale.period == 7
  else:  # No scaling: a scale that never moves from 1.
    assert not isinstance(p.loss_scale, jmp.DynamicLossScale)
    assert float(np.asarray(p.loss_scale.loss_scale)) == 1.0


@pytest.mark.parametrize(
  "override,match",
  [
    ({"model": "resnet50"}, "unknown model 'resnet50'.*resnet18"),
    ({"policy": "O7"}, "unknown policy 'O7'.*O0, O1"),
    ({"dataset": "mnist"}, "unknown dataset 'mnist'.*cifar10"),
    ({"lr_schedule": "step"}, "unknown lr_schedule 'step'.*cosine"),
    ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
    ({"num_devices": -1}, "num_devices must be >= 0"),
    ({"dataset": "image_folder", "data_dir": ""}, "needs --config.data_dir"),
    (
      {"dataset": "image_folder", "data_dir": "/nonexistent/x"},
      "'/nonexistent/x' does not exist",
    ),
    ({"mean": (0.5, 0.5)}, "mean and std must have 3 values"),
    (
      {"policy": "bf16", "init_loss_scale": "auto"},
      "init_loss_scale 'auto' needs a preset with a dynamic loss scale",
    ),
    ({"init_loss_scale": "big"}, "must be a number or 'auto', got 'big'"),
    ({"max_nonfinite_loss_steps": 0}, "max_nonfinite_loss_steps must be >= 1"),
    ({"spike_skip_window": 1}, "spike_skip_window.*must be >= 2"),
    ({"spike_skip_window": -1}, "spike_skip_window must be 0 \\(off\\)"),
    ({"rounding_every": -1}, "rounding_every must be an int >= 0, got -1"),
    (
      {"spike_skip_window": 8, "spike_skip_factor": 0.0},
      "spike_skip_factor.*factor must be a finite number > 0",
    ),
  ],
)
def test_bad_values_name_the_key(override, match):
  config = default.get_config()
  for key, value in override.items():
    config[key] = value
  with pytest.raises(ConfigError, match=match):
    settings.resolve(config)


@pytest.mark.parametrize(
  "value,want",
  [("", True), ("fp32", True), ("none", False), ("kahan", "kahan")],
)
def test_master_weights_override(value, want):
  config = default.get_config()
  config.policy = "O2"
  config.master_weights = value
  assert settings.resolve(config).precision.master_weights == want


def test_unknown_master_weights_lists_the_valid_ones():
  config = default.get_config()
  config.master_weights = "fp64"
  with pytest.raises(ConfigError, match="unknown master_weights 'fp64'.*kahan"):
    settings.resolve(config)


@pytest.mark.parametrize("policy", ["bf16-kahan", "bf16-stochastic"])
def test_remainder_masters_with_bfloat16_params(policy):
  config = default.get_config()
  config.policy = policy
  config.master_weights = "remainder"
  p = settings.resolve(config).precision
  assert (p.master_weights, p.param_dtype) == ("remainder", jnp.bfloat16)


@pytest.mark.parametrize(
  "policy,dtype", [("O2", "float16"), ("O3", "float16"), ("bf16", "float32")]
)
def test_remainder_masters_need_bfloat16_params(policy, dtype):
  # At resolve time, before anything runs: float16 params would fail in
  # opt.init, and fp32 params (their own masters) would ignore it.
  config = default.get_config()
  config.policy = policy
  config.master_weights = "remainder"
  with pytest.raises(
    ConfigError,
    match=f"'remainder'.*needs bfloat16 params; policy '{policy}' has "
    f"{dtype} params.*bf16-kahan or bf16-stochastic",
  ):
    settings.resolve(config)


@pytest.mark.parametrize(
  "value,kind",
  [("", "fp32"), ("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8")],
)
def test_optimizer_state_setting(value, kind):
  config = default.get_config()
  config.optimizer_state = value
  config.optimizer_state_min_size = 1024
  p = settings.resolve(config).precision
  assert p.optimizer_state == jaxmp.StateQuantization(kind, min_size=1024)


@pytest.mark.parametrize(
  "key,value,match",
  [
    (
      "optimizer_state",
      "fp8",
      "unknown optimizer_state 'fp8'; valid: fp32, bf16, int8",
    ),
    (
      "optimizer_state_min_size",
      0,
      "optimizer_state_min_size must be an integer >= 1, got 0",
    ),
  ],
)
def test_bad_optimizer_state_names_the_valid_values(key, value, match):
  config = default.get_config()
  config[key] = value
  with pytest.raises(ConfigError, match=match):
    settings.resolve(config)


def test_optimizer_state_reaches_the_optimizer():
  import optax  # pylint: disable=g-import-not-at-top

  from cifar_train import loop  # pylint: disable=g-import-not-at-top

  config = default.get_config()
  config.policy = "bf16-kahan"
  config.master_weights = "remainder"
  config.optimizer_state = "int8"
  config.optimizer_state_min_size = 512
  s = settings.resolve(config)
  opt = loop.make_optimizer(s, s.precision, optax.constant_schedule(0.1))
  params = {
    "big": jnp.ones((2, 256), jnp.bfloat16),  # 512 elements: encoded.
    "small": jnp.ones(511, jnp.bfloat16),
  }
  state = opt.init(params)
  assert jaxmp.find_state(state).remainder["big"].dtype == jnp.int16
  stored = {
    row.path: row.stored
    for row in jaxmp.state_summary(state)
    if ".trace" in row.path  # The momentum.
  }
  assert stored == {
    ".inner_state[1][0].trace['big']": "int8",
    ".inner_state[1][0].trace['small']": "float32",
  }


@pytest.mark.parametrize(
  "policy,diagnostics,autocast,debug",
  [
    ("O1", False, jnp.float16, False),
    ("O1", True, jnp.float16, True),
    ("O2", True, None, False),
    ("O0", False, None, False),
  ],
)
def test_autocast_follows_the_preset_and_diagnostics(
  policy, diagnostics, autocast, debug
):
  config = default.get_config()
  config.policy = policy
  config.diagnostics = diagnostics
  p = settings.resolve(config).precision
  assert p.autocast == autocast and p.autocast_debug == debug


def test_every_setting_is_read_by_the_app():
  # A field that nothing reads is a config key that silently does nothing.
  import dataclasses  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  package = pathlib.Path(settings.__file__).parent
  code = "".join(
    p.read_text() for p in package.glob("*.py") if p.name != "settings.py"
  )
  # The app names its Settings `s`, `settings` (job.settings) or `resolved`;
  # the config (`config.x`) does not count.
  unread = [
    f.name
    for f in dataclasses.fields(settings.Settings)
    if not re.search(rf"\b(s|settings|resolved)\.{f.name}\b", code)
  ]
  assert not unread, unread


@pytest.mark.parametrize("module", [default, seed])
def test_spike_skipping_is_off_by_default(module):
  assert settings.resolve(module.get_config()).skip_spikes is None


@pytest.mark.parametrize("module", [default, seed, fp32, bf16, smoke])
def test_spike_skipping_turned_on_by_its_window_alone_uses_factor_six(module):
  """The documented switch: ``--config.spike_skip_window=128`` alone.

  The factor it gets is 6, OLMo's and MaxText's, and `jaxmp.SpikeSkip`'s
  own default: no config changes it.
  """
  config = module.get_config()
  assert config.spike_skip_factor == 6.0
  config.spike_skip_window = 128
  assert settings.resolve(config).skip_spikes == jaxmp.SpikeSkip(
    window=128, factor=6.0
  )
  assert jaxmp.SpikeSkip(window=128) == jaxmp.SpikeSkip(128, 6.0)


def test_spike_skip_config_reaches_the_optimizer():
  import optax  # pylint: disable=g-import-not-at-top

  from cifar_train import loop  # pylint: disable=g-import-not-at-top

  config = default.get_config()
  config.spike_skip_window = 16
  config.spike_skip_factor = 4.5
  s = settings.resolve(config)
  assert s.skip_spikes == jaxmp.SpikeSkip(window=16, factor=4.5)
  opt = loop.make_optimizer(s, s.precision, optax.constant_schedule(0.1))
  state = opt.init({"w": jnp.ones(3, jnp.float16)})
  assert jaxmp.find_state(state).spikes.norms.shape == (16,)
  config.spike_skip_window = 0
  s = settings.resolve(config)
  opt = loop.make_optimizer(s, s.precision, optax.constant_schedule(0.1))
  assert jaxmp.find_state(opt.init({"w": jnp.ones(3)})).spikes is None
