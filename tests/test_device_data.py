"""Tests of cifar_train.device_data: device-resident augmentation (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np

from _helpers import is_valid_crop
from _helpers import random_data
from cifar_train import device_data
from cifar_train import host_stream

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def test_device_augment():
  images, _ = random_data(n=32)
  augment = jax.jit(device_data.device_augment)
  a = augment(jnp.asarray(images), jax.random.key(0))
  b = augment(jnp.asarray(images), jax.random.key(0))
  c = augment(jnp.asarray(images), jax.random.key(1))
  assert a.shape == images.shape and a.dtype == jnp.uint8
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  a = np.asarray(a)
  for out, image in zip(a, images):
    assert is_valid_crop(out, image)
  assert not np.array_equal(a, images)  # Some example was moved or flipped.


def test_normalize_matches_host_pipeline():
  images, labels = random_data(n=16)
  host = next(
    host_stream.eval_batches(images, labels, batch_size=16, mean=MEAN, std=STD)
  )
  dev = jax.jit(device_data.normalize, static_argnums=(1, 2, 3))(
    jnp.asarray(images), MEAN, STD, jnp.float32
  )
  np.testing.assert_allclose(dev, host["image"], rtol=1e-6, atol=1e-6)
  half = device_data.normalize(jnp.asarray(images), MEAN, STD, jnp.float16)
  assert half.dtype == jnp.float16


def test_device_epoch_permutation():
  key = jax.random.key(0)
  perm = jax.jit(device_data.device_epoch_permutation, static_argnums=2)
  p0, p1 = perm(key, 0, 50), perm(key, 1, 50)
  assert sorted(np.asarray(p0).tolist()) == list(range(50))
  assert not np.array_equal(p0, p1)
  np.testing.assert_array_equal(p0, perm(key, 0, 50))
