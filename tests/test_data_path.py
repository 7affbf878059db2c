"""What the train step is fed: crops, flips, seeds, the order, k steps a call.

The expected batches are computed here from the images with numpy's own
``np.pad`` and slicing, never with the pipeline's helpers (`host_stream.pad`,
`host_stream.crop_rows_cols`), so that a helper's bug cannot hide in both.
"""

import logging
import os
import shutil

import jax
import numpy as np
import pytest

from _helpers import one_block_models
from _helpers import random_data
from cifar_train import batches
from cifar_train import data_sources
from cifar_train import host_stream
from cifar_train import loop
from cifar_train import reporting
from cifar_train import settings
from cifar_train import steps

# mean 0, std 1: a pixel's float is byte * float32(1 / 255); rint(x * 255)
# gives the byte back exactly (the error is below 1e-4 of a level).
MEAN, STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


def expected_crop(image, dy, dx, flip):
  """``pad(image)[dy:dy+H, dx:dx+W]``, reversed along W when flipped."""
  h, w, _ = image.shape
  padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
  crop = padded[dy : dy + h, dx : dx + w]
  return crop[:, ::-1] if flip else crop


def to_bytes(x) -> np.ndarray:
  return np.rint(np.asarray(x, np.float64) * 255).astype(np.uint8)


def sources(images, labels, *, seed, batch_size):
  """The host stream and the device-resident source of one small data set."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  args = dict(
    batch_size=batch_size,
    seed=seed,
    mean=MEAN,
    std=STD,
    augment=True,
    replicated=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    batch_sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")
    ),
  )
  data = data_sources.Dataset(images, labels, images[:4], labels[:4], 10)
  return {
    "host": batches.HostStream(data, **args),
    "device": batches.DeviceResident(data, **args),
  }


@pytest.mark.parametrize("mode", ["host", "device"])
def test_every_example_is_its_crop_and_flip(mode):
  images, labels = random_data(n=64, size=8)  # Label i is example i.
  source = sources(images, labels, seed=7, batch_size=16)[mode]
  for epoch in (0, 1):
    plan = host_stream.epoch_plan(7, epoch, 64, 16, augment=True)
    assert plan.flips.any() and not plan.flips.all()
    assert len(np.unique(plan.offsets.reshape(-1, 2), axis=0)) > 20
    for k, args in enumerate(source.epoch(None, epoch, 0, 4)):
      x, y = source.batch(None, *args)
      x, y = to_bytes(x), np.asarray(y)
      np.testing.assert_array_equal(y, plan.index[k])
      for i, example in enumerate(plan.index[k]):
        (dy, dx), flip = plan.offsets[k, i], plan.flips[k, i]
        want = expected_crop(images[example], dy, dx, flip)
        np.testing.assert_array_equal(
          x[i], want, err_msg=f"epoch {epoch} step {k} row {i}"
        )


def augmentations(source, images, epoch):
  """``(example -> (dy, dx, flip), [(dy, dx, flip) of each batch row])``.

  Read off the batches of ``epoch`` by matching each batch row against all
  162 crops of its example, so it says what the batches hold, whatever the
  plan claims.
  """
  found, rows = {}, []
  for args in source.epoch(None, epoch, 0, 4):
    x, y = source.batch(None, *args)
    for row, example in zip(to_bytes(x), np.asarray(y)):
      (match,) = [
        (dy, dx, flip)
        for dy in range(9)
        for dx in range(9)
        for flip in (False, True)
        if np.array_equal(row, expected_crop(images[example], dy, dx, flip))
      ]
      found[int(example)] = match
      rows.append(match)
  return found, rows


@pytest.mark.parametrize("mode", ["host", "device"])
def test_crops_and_flips_change_with_epoch_and_seed_only(mode):
  # 16 x 16 random images: no two of an image's 162 crops are equal.
  images, labels = random_data(n=64, size=16)
  seed_0 = sources(images, labels, seed=0, batch_size=16)[mode]
  seed_0_again = sources(images, labels, seed=0, batch_size=16)[mode]
  seed_1 = sources(images, labels, seed=1, batch_size=16)[mode]
  a, a_rows = augmentations(seed_0, images, 0)
  assert len(a) == 64  # Every example, compared example by example below.
  # The same (seed, epoch): the same augmentation of every example.
  assert augmentations(seed_0_again, images, 0) == (a, a_rows)
  # Another epoch or another seed: new draws for most examples, and new
  # draws row by row, not the same draws dealt to a new permutation (two
  # independent draws of 162 choices agree with probability 1/162).
  for other, other_rows in (
    augmentations(seed_0, images, 1),
    augmentations(seed_1, images, 0),
  ):
    same = sum(a[i] == other[i] for i in a)
    assert same <= 8, same
    same_rows = sum(p == q for p, q in zip(a_rows, other_rows))
    assert same_rows <= 8, same_rows
    assert {f for _, _, f in other.values()} == {False, True}


def spy_on_labels(monkeypatch, seen):
  """Records ``(step, labels)`` of every train step the app runs."""
  make_train_step = steps.make_train_step

  def make(*args, **kwargs):
    train_step = make_train_step(*args, **kwargs)

    def step(state, images, labels, metrics):
      jax.debug.callback(
        lambda s, y: seen.append((int(s), np.asarray(y).tolist())),
        state.step,
        labels,
      )
      return train_step(state, images, labels, metrics)

    return step

  monkeypatch.setattr(steps, "make_train_step", make)


@pytest.mark.parametrize(
  "on_device,steps_per_call", [(False, 1), (True, 1), (False, 2), (True, 2)]
)
def test_step_k_trains_batch_k_of_the_plan_fresh_and_resumed(
  on_device,
  steps_per_call,
  make_config,
  data_dir,
  tiny_data,
  tmp_path,
  monkeypatch,
):
  one_block_models(monkeypatch)
  seen = []
  spy_on_labels(monkeypatch, seen)
  # 8 steps an epoch; 10 steps cross into epoch 1. Logs and saves every 2
  # steps, so that calls of 2 steps run throughout.
  config = make_config(
    data_dir,
    data_on_device=on_device,
    steps_per_call=steps_per_call,
    num_train_steps=10,
    num_epochs=2,
    log_every_steps=2,
    checkpoint_every_steps=2,
    keep_checkpoints=5,
  )
  s = settings.resolve(config)
  n = len(tiny_data.train_images)

  def expected(step):
    epoch, k = divmod(step, n // s.batch_size)
    plan = host_stream.epoch_plan(s.seed, epoch, n, s.batch_size, True)
    return tiny_data.train_labels[plan.index[k]].tolist()

  loop.train_and_evaluate(config, str(tmp_path / "full"), data=tiny_data)
  jax.effects_barrier()
  assert [step for step, _ in seen] == list(range(10))
  for step, labels in seen:
    assert labels == expected(step), f"fresh run, step {step}"
  seen.clear()
  # Resumed from step 6 of the same run: steps 6..9, across the epoch end.
  split = tmp_path / "split"
  shutil.copytree(
    tmp_path / "full" / "checkpoints" / "6", split / "checkpoints" / "6"
  )
  loop.train_and_evaluate(config, str(split), data=tiny_data)
  jax.effects_barrier()
  assert [step for step, _ in seen] == [6, 7, 8, 9]
  for step, labels in seen:
    assert labels == expected(step), f"resumed run, step {step}"


def _train_calls(job, source, step_fn, epoch, start, sizes):
  """From the init, calls of ``sizes`` steps from batch ``start`` of ``epoch``.

  Returns the state's fingerprint and the metrics, on the host.
  """
  state = jax.device_put(loop.make_init(job)(), job.replicated)
  metrics = jax.device_put(steps.zero_metrics(state.opt_state), job.replicated)
  calls = list(source.calls(state, epoch, start, sizes))
  assert len(calls) == len(sizes)
  for args in calls:
    state, metrics = step_fn(state, *args, metrics)
  assert int(state.step) == sum(sizes)
  return steps.state_fingerprint(state), jax.tree.map(np.asarray, metrics)


def _assert_same_bits(a, b):
  """Two `_train_calls` results: the same state and metrics, every bit."""
  (fp_a, metrics_a), (fp_b, metrics_b) = a, b
  assert fp_a == fp_b
  for key in metrics_a:
    np.testing.assert_array_equal(
      np.asarray(metrics_a[key]).view(np.uint32),
      np.asarray(metrics_b[key]).view(np.uint32),
    )


@pytest.mark.invariant
@pytest.mark.parametrize("on_device", [False, True])
def test_k_steps_in_one_call_are_k_single_steps(
  on_device, make_config, data_dir, tiny_data, monkeypatch
):
  """Calls of 3, 3 and 2 steps == 8 calls of one step, every bit."""
  one_block_models(monkeypatch)
  s = settings.resolve(
    make_config(data_dir, data_on_device=on_device, steps_per_call=3)
  )
  job = loop.set_up(s, tiny_data)
  assert job.steps_per_call == 3 and job.data_on_device == on_device
  source = loop.make_batch_source(job)
  step_fn, _ = loop.compile_steps(job, source)
  _assert_same_bits(
    _train_calls(job, source, step_fn, 0, 0, [3, 3, 2]),
    _train_calls(job, source, step_fn, 0, 0, [1] * 8),
  )


@pytest.mark.invariant
def test_lone_steps_on_device_batches_are_those_on_host_batches(
  make_config, data_dir, tiny_data, monkeypatch
):
  """One step a call: the devices' batches train as the host's, every bit."""
  one_block_models(monkeypatch)
  results = []
  for on_device in (False, True):
    s = settings.resolve(
      make_config(data_dir, data_on_device=on_device, steps_per_call=1)
    )
    job = loop.set_up(s, tiny_data)
    source = loop.make_batch_source(job)
    step_fn, _ = loop.compile_steps(job, source)
    # Epoch 1 from its third batch: the plan's epoch and first step count.
    results.append(_train_calls(job, source, step_fn, 1, 2, [1] * 4))
  _assert_same_bits(*results)


class _Compiles(logging.Handler):
  """Collects the names of the programs jax compiles (cache misses)."""

  def __init__(self, events):
    super().__init__(logging.DEBUG)
    self.events = events

  def emit(self, record):
    message = record.getMessage()
    if message.startswith("Compiling "):
      self.events.append(message.split()[1])


@pytest.mark.parametrize(
  "on_device,steps_per_call", [(False, 3), (True, 3), (True, 1)]
)
def test_nothing_compiles_after_the_first_epoch(
  on_device,
  steps_per_call,
  make_config,
  data_dir,
  tiny_data,
  tmp_path,
  monkeypatch,
):
  one_block_models(monkeypatch)
  events = []
  handler = _Compiles(events)
  logger = logging.getLogger("jax._src.interpreters.pxla")
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  log_epoch = reporting.Reporter.log_epoch

  def marked(self, **kwargs):
    events.append(f"<epoch {kwargs['epoch']} done>")
    return log_epoch(self, **kwargs)

  monkeypatch.setattr(reporting.Reporter, "log_epoch", marked)
  # 8 steps an epoch in calls of 3 steps and single steps (stops at 4, 8),
  # or of single steps only (on the devices: the batch's program, then the
  # step's): the train programs, the evaluation, the saves and the logs, 3
  # epochs.
  config = make_config(
    data_dir,
    data_on_device=on_device,
    steps_per_call=steps_per_call,
    num_train_steps=-1,
    num_epochs=3,
    log_every_steps=4,
    checkpoint_every_steps=0,
  )
  try:
    loop.train_and_evaluate(config, str(tmp_path / "run"), data=tiny_data)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  first = events.index("<epoch 1 done>")
  assert events[first:] == [
    "<epoch 1 done>",
    "<epoch 2 done>",
    "<epoch 3 done>",
  ]
  # Before it: the train program once (compile_ahead's is the one the loop
  # calls), the evaluation once.
  compiled = events[:first]
  assert compiled.count("jit(train_steps)") == 1, compiled
  assert len({"jit(all_batches)", "jit(eval_step)"} & set(compiled)) == 1
  assert len(os.listdir(tmp_path / "run" / "checkpoints")) == 3


def test_auto_places_what_fits_and_steps_per_call(tiny_data):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  assert loop.place_splits("auto", tiny_data, mesh) == (True, True)
  assert loop.place_splits(False, tiny_data, mesh) == (False, True)
  budget = loop.DEVICE_MEMORY_FRACTION * loop.device_memory_bytes(
    jax.devices()[0]
  )
  big = data_sources.Dataset(
    np.broadcast_to(np.uint8(0), (int(budget) // (40 * 40 * 3) + 1, 32, 32, 3)),
    tiny_data.train_labels,
    tiny_data.test_images,
    tiny_data.test_labels,
    10,
  )
  one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  assert loop.place_splits("auto", big, one) == (False, True)
  assert loop.auto_steps_per_call("gpu", 390, 50, 0) == 5
  assert loop.auto_steps_per_call("gpu", 390, 50, 30) == 5
  assert loop.auto_steps_per_call("gpu", 64, 16, 0) == 8
  assert loop.auto_steps_per_call("gpu", 97, 50, 0) == 1
  assert loop.auto_steps_per_call("cpu", 64, 16, 0) == 1


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("data_on_device", "maybe", "data_on_device must be True, False or 'auto'"),
    ("steps_per_call", 0, "steps_per_call must be an integer >= 1 or 'auto'"),
    ("steps_per_call", "two", "steps_per_call must be an integer >= 1"),
    ("steps_per_call", 1.5, "steps_per_call must be an integer >= 1"),
  ],
)
def test_bad_feed_settings_say_what_is_valid(
  key, value, message, make_config, data_dir
):
  from cifar_train.errors import ConfigError  # pylint: disable=g-import-not-at-top

  with pytest.raises(ConfigError, match=message):
    settings.resolve(make_config(data_dir, **{key: value}))


def test_cli_strings_resolve(make_config, data_dir):
  s = settings.resolve(
    make_config(data_dir, data_on_device="False", steps_per_call="4")
  )
  assert (s.data_on_device, s.steps_per_call) == (False, 4)
  s = settings.resolve(make_config(data_dir))
  assert (s.data_on_device, s.steps_per_call) == ("auto", "auto")
