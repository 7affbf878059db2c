"""Device-resident data: the host stream's augmentation in `jax.numpy`.

For a data set kept on the accelerators (airbench style): call these inside
the jitted train step. Crops and flips match `host_stream`'s in kind (pad 4,
horizontal flip), not draw for draw.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PAD = 4  # Random-crop padding, in pixels.


def normalization(
  mean: Sequence[float], std: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
  """`(scale, bias)` such that `x_u8 * scale + bias == (x_u8 / 255 - m) / s`."""
  mean = np.asarray(mean, np.float32)
  std = np.asarray(std, np.float32)
  return 1.0 / (255.0 * std), -mean / std


def device_epoch_permutation(
  key: jax.Array, epoch: jax.typing.ArrayLike, num_examples: int
) -> jax.Array:
  """The example order of `epoch` for device-resident data.

  Args:
    key: a PRNG key (the data key of the run).
    epoch: epoch number; may be traced.
    num_examples: static number of examples.

  Returns:
    int32 `[num_examples]` permutation.

  >>> perm = device_epoch_permutation(jax.random.key(0), 3, 10)
  >>> sorted(perm.tolist()) == list(range(10))
  True
  """
  return jax.random.permutation(jax.random.fold_in(key, epoch), num_examples)


def device_augment(images: jax.Array, key: jax.Array) -> jax.Array:
  """Pad-4 random crop and random horizontal flip, per example, on device.

  One gather from the zero-padded batch: output pixel `(i, r, c)` reads
  `padded[i, dy_i + r, dx_i + c']` with `c' = W - 1 - c` for flipped
  examples. No per-example loop; XLA emits a single gather.

  Args:
    images: `[B, H, W, C]` of any dtype (uint8 keeps the gather cheap).
    key: PRNG key; each example gets its own draw.

  Returns:
    `[B, H, W, C]`, same dtype as `images`.

  >>> x = jnp.ones((2, 32, 32, 3), jnp.uint8)
  >>> device_augment(x, jax.random.key(0)).shape
  (2, 32, 32, 3)
  """
  b, h, w, _ = images.shape
  k_offset, k_flip = jax.random.split(key)
  offsets = jax.random.randint(k_offset, (b, 2), 0, 2 * PAD + 1)
  flip = jax.random.bernoulli(k_flip, 0.5, (b,))
  padded = jnp.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
  rows = offsets[:, :1] + jnp.arange(h)[None, :]  # [B, H]
  cols = jnp.where(flip[:, None], jnp.arange(w - 1, -1, -1), jnp.arange(w))
  cols = offsets[:, 1:] + cols  # [B, W]
  return padded[
    jnp.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]
  ]


def normalize(
  images: jax.Array,
  mean: Sequence[float],
  std: Sequence[float],
  dtype: Any = jnp.float32,
) -> jax.Array:
  """Scales uint8 images to `[0, 1]`, then `(x - mean) / std`, in `dtype`.

  The arithmetic runs in float32 and only the result is cast, so a float16
  `dtype` loses no more than its own rounding.

  Args:
    images: uint8 `[..., C]`.
    mean: per-channel mean, length `C`.
    std: per-channel standard deviation, length `C`.
    dtype: output dtype.

  Returns:
    `images` normalised, of `dtype`.

  >>> normalize(jnp.full((1, 3), 255, jnp.uint8), (0.5,) * 3, (0.5,) * 3)
  Array([[1., 1., 1.]], dtype=float32)
  """
  scale, bias = normalization(mean, std)
  return (images.astype(jnp.float32) * scale + bias).astype(dtype)
