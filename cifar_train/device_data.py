"""Device-resident data: `host_stream`'s batch, built on the accelerators.

For a data set kept on the devices (airbench style), the devices build
each batch (in the train step's program, or in one of its own before a lone
step: `batches.DeviceResident`) from the zero-padded uint8 set, the epoch's
`host_stream.EpochPlan` (put on the devices once per epoch) and the step's
index. The integer indexing is `host_stream`'s own (`crop_rows_cols`), and
the float32 values are looked up in `host_stream.normalization_table`, so a
batch is bitwise the host's: there is no float arithmetic to round
differently (or to fuse into an FMA) on the device.
"""

import jax
import jax.numpy as jnp

from cifar_train import host_stream


def device_batch(
  padded: jax.Array,
  labels: jax.Array,
  table: jax.Array,
  index: jax.Array,
  offsets: jax.Array,
  flips: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The normalised crops of examples ``index``, on the device.

  Args:
    padded: uint8 ``[N, H + 2 PAD, W + 2 PAD, C]`` (`host_stream.pad`).
    labels: int32 ``[N]``.
    table: float32 ``[256, C]`` (`host_stream.normalization_table`).
    index: int32 ``[B]``: the examples.
    offsets: int32 ``[B, 2]``: crop corners in the padded images.
    flips: bool ``[B]``.

  Returns:
    ``(images, labels)``: float32 ``[B, H, W, C]`` and int32 ``[B]``, equal
    to `host_stream.HostBatches.batch` of the same arguments.

  >>> import numpy as np
  >>> images = np.arange(2 * 2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 2, 3)
  >>> x, y = device_batch(
  ...     jnp.asarray(host_stream.pad(images)), jnp.arange(2),
  ...     jnp.asarray(host_stream.normalization_table((0.,) * 3, (1.,) * 3)),
  ...     jnp.array([1]), jnp.array([[4, 4]]), jnp.array([True]))
  >>> bool((jnp.rint(x[0] * 255) == images[1, :, ::-1]).all()), y.tolist()
  (True, [1])
  """
  h = padded.shape[1] - 2 * host_stream.PAD
  w = padded.shape[2] - 2 * host_stream.PAD
  rows, cols = host_stream.crop_rows_cols(offsets, flips, h, w, xp=jnp)
  pixels = padded[index[:, None, None], rows[:, :, None], cols[:, None, :]]
  channels = jnp.arange(table.shape[1])
  return table[pixels.astype(jnp.int32), channels], labels[index]


def _loop(one, args_of, steps_per_call):
  """``train_steps(state, *args, n, metrics)``: ``one`` for ``i`` in ``[0, n)``.

  With ``steps_per_call`` k > 1, ``n`` is an argument (a runtime int32), so
  that one program runs a call of any number of steps up to k: XLA compiles
  the step once, as the body of a while loop, and every step of a run,
  whatever its call's size, runs that same code. (A loop of a static length
  compiles its body apart from a lone step, with other fusions: the same
  steps, a few ULPs apart.) With k = 1 the program is the lone step, ``n``
  (always 1) unused: on a CPU, where "auto" picks k = 1, the loop costs more
  than the dispatch it saves (``bench/steps_per_call.py``).
  """

  def train_steps(state, *args):
    *args, n, metrics = args
    if steps_per_call == 1:
      del n
      return one(state, *args_of(args, 0), metrics)

    def body(i, carry):
      state, metrics = carry
      return one(state, *args_of(args, i), metrics)

    return jax.lax.fori_loop(0, n, body, (state, metrics))

  return train_steps


def make_device_train_step(train_step, batch_sharding=None, steps_per_call=1):
  """``train_step`` over a data set kept on the devices, n steps a call.

  Returns ``step(state, padded, labels, table, plan_index, plan_offsets,
  plan_flips, first, n, metrics)``: for each of steps ``first .. first + n
  - 1`` of the epoch's plan it builds the batch with `device_batch`
  (sharded like ``batch_sharding`` when given) and runs
  ``train_step(state, images, labels, metrics)``. ``n`` is a runtime
  value (`_loop`): calls of any size up to ``steps_per_call`` run the same
  program, bit for bit.
  """

  def step(state, padded, labels, table, index, offsets, flips, k, metrics):
    index, offsets, flips = index[k], offsets[k], flips[k]
    if batch_sharding is not None:
      index, offsets, flips = (
        jax.lax.with_sharding_constraint(a, batch_sharding)
        for a in (index, offsets, flips)
      )
    x, y = device_batch(padded, labels, table, index, offsets, flips)
    return train_step(state, x, y, metrics)

  return _loop(step, lambda a, i: (*a[:-1], a[-1] + i), steps_per_call)


def loop_over_batches(train_step, batch_sharding=None, steps_per_call=1):
  """``train_step(state, x, y, metrics)`` over the first n of k batches.

  Returns ``step(state, xs, ys, n, metrics)`` for ``xs`` ``[k, B, ...]``
  and ``ys`` ``[k, B]``: batches ``0 .. n - 1`` in order (`_loop`), each
  laid out like ``batch_sharding`` (when given), as a lone step's argument.
  """

  def batch(args, i):
    x, y = args[0][i], args[1][i]
    if batch_sharding is not None:
      x = jax.lax.with_sharding_constraint(x, batch_sharding)
      y = jax.lax.with_sharding_constraint(y, batch_sharding)
    return x, y

  return _loop(train_step, batch, steps_per_call)
