"""Tests of cifar_train.device_data: the host's batch, built on device (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import is_valid_crop
from _helpers import random_data
from cifar_train import device_data
from cifar_train import host_stream

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


@pytest.mark.parametrize("augment", [True, False])
def test_device_batch_is_the_host_batch_bit_for_bit(augment):
  images, labels = random_data(n=100)
  # The host pads only for crops (the app's HostStream does the same).
  host = host_stream.HostBatches(
    images, labels, mean=MEAN, std=STD, crops=augment
  )
  resident = jax.device_put(
    (
      host_stream.pad(images),
      labels,
      host_stream.normalization_table(MEAN, STD),
    )
  )
  build = jax.jit(
    lambda data, plan, k: device_data.device_batch(*data, *(a[k] for a in plan))
  )
  for epoch in (0, 1):
    plan = host_stream.epoch_plan(3, epoch, 100, 16, augment)
    on_device = jax.device_put(tuple(plan))
    for k, want in enumerate(host.epoch(plan)):
      x, y = build(resident, on_device, np.int32(k))
      assert x.dtype == jnp.float32 and x.shape == want["image"].shape
      np.testing.assert_array_equal(
        np.asarray(x).view(np.uint32), want["image"].view(np.uint32)
      )
      np.testing.assert_array_equal(np.asarray(y), want["label"])
      if k == 0:  # The crops are pad-4 crops of the examples, or themselves.
        u8 = np.argmin(
          np.abs(
            np.asarray(x)[..., None]
            - host_stream.normalization_table(MEAN, STD).T[None, None, None]
          ),
          axis=-1,
        ).astype(np.uint8)
        for out, label in zip(u8, np.asarray(y)):
          if augment:
            assert is_valid_crop(out, images[label])
          else:
            np.testing.assert_array_equal(out, images[label])
