"""Checkpoints record a CRC-32 per array; a flipped bit is corrupt."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cifar_train import checkpoint


def _state(offset):
  return {
    "params": jnp.arange(4096, dtype=jnp.float32) + offset,
    "count": jnp.asarray(offset, jnp.int32),
    "rng": jax.random.key_data(jax.random.key(offset)),
  }


@pytest.fixture(name="workdir")
def fixture_workdir(tmp_path):
  """Checkpoints 2 and 4 of a three-leaf state (4 is ``_state(4)``)."""
  workdir = str(tmp_path / "run")
  with checkpoint.open_manager(workdir, 3) as manager:
    for step in (2, 4):
      checkpoint.save(manager, _state(step), step, True, 2)
      checkpoint.wait_until_finished(manager)
  return workdir


def _restore(workdir):
  with checkpoint.open_manager(workdir, 3) as manager:
    return checkpoint.restore_latest(manager, _state(0))


def _equal(state, offset):
  want = _state(offset)
  return all(np.array_equal(a, want[k]) for k, a in state.items())


def _largest_data_file(workdir, step):
  files = glob.glob(
    os.path.join(workdir, "checkpoints", str(step), "state", "**", "d", "*"),
    recursive=True,
  )
  return max(files, key=os.path.getsize)


def test_intact_checkpoint_restores_the_newest_exactly(workdir):
  state, path = _restore(workdir)
  assert path.endswith(os.path.join("checkpoints", "4"))
  assert _equal(state, 4)


def test_a_flipped_bit_falls_back_and_sets_the_checkpoint_aside(
  workdir, capsys
):
  data = _largest_data_file(workdir, 4)
  with open(data, "r+b") as f:
    f.seek(os.path.getsize(data) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))
  state, path = _restore(workdir)
  assert path.endswith(os.path.join("checkpoints", "2"))
  assert _equal(state, 2)
  out = capsys.readouterr().out
  assert "is unusable (checksum mismatch in leaf_" in out
  assert "= ['params']: recorded " in out
  assert os.listdir(os.path.join(workdir, "unusable_checkpoints")) == ["4"]


def test_a_checkpoint_without_checksums_still_restores(workdir):
  """Checkpoints written before checksums were recorded are read as is."""
  meta = os.path.join(workdir, "checkpoints", "4", "meta", "metadata")
  with open(meta) as f:
    record = json.load(f)
  assert set(record["checksums"]) == {"leaf_0000", "leaf_0001", "leaf_0002"}
  del record["checksums"]
  with open(meta, "w") as f:
    json.dump(record, f)
  state, path = _restore(workdir)
  assert path.endswith(os.path.join("checkpoints", "4"))
  assert _equal(state, 4)


def test_checksums_are_crc32_of_each_whole_leaf():
  flat = {"a": jnp.arange(10, dtype=jnp.int32), "k": jax.random.key(3)}
  import zlib  # pylint: disable=g-import-not-at-top

  got = checkpoint.checksums(flat)
  assert got == {
    "a": f"{zlib.crc32(np.arange(10, dtype=np.int32).tobytes()):08x}",
    "k": f"{zlib.crc32(np.asarray(jax.random.key_data(flat['k'])).tobytes()):08x}",
  }
