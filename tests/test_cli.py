"""The command line: bad keys, values and files give one ``error:`` line."""

import os
import subprocess
import sys

import pytest

from cifar_train import cli
from configs import default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_py(*args, timeout=120):
  env = dict(
    os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", TF_CPP_MIN_LOG_LEVEL="3"
  )
  return subprocess.run(
    [sys.executable, "train.py", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
  )


def _one_error_line(out) -> str:
  """The single line of stderr that says ``error:``; no traceback."""
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  lines = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1, out.stderr[-2000:]
  # TensorFlow may log its own start-up lines; nothing else of ours.
  assert sum("error" in l.lower() for l in out.stderr.splitlines()) == 1
  return lines[0]


@pytest.mark.parametrize(
  "key,near",
  [
    ("nonexistent", "nesterov"),
    ("polcy", "policy"),
    ("batchsize", "batch_size"),
  ],
)
def test_unknown_key_names_it_and_the_nearest(key, near, tmp_path):
  line = _one_error_line(
    _train_py(
      "--config",
      "configs/smoke.py",
      "--workdir",
      str(tmp_path),
      f"--config.{key}=3",
    )
  )
  assert f"unknown config key {key!r}" in line and near in line
  assert not os.listdir(tmp_path)


def test_missing_and_broken_config_files_name_the_path(tmp_path):
  line = _one_error_line(
    _train_py("--config", "configs/nope.py", "--workdir", str(tmp_path))
  )
  assert line == "error: config file 'configs/nope.py' not found"
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config(:\n")
  line = _one_error_line(
    _train_py("--config", str(broken), "--workdir", str(tmp_path / "w"))
  )
  assert f"config file {str(broken)!r} could not be loaded: SyntaxError" in (
    line
  )


def test_bad_value_is_one_line(tmp_path):
  line = _one_error_line(
    _train_py(
      "--config",
      "configs/smoke.py",
      "--workdir",
      str(tmp_path / "w"),
      "--config.policy=O9",
    )
  )
  assert line.startswith("error: unknown policy 'O9'")
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_unknown_key_message_lists_keys_when_nothing_is_near():
  message = cli.unknown_key_message("zzzzzz", default.get_config())
  assert message.startswith("unknown config key 'zzzzzz'; valid keys: ")
  assert "batch_size" in message


def test_only_user_errors_become_one_line(monkeypatch, capsys):
  from cifar_train import errors
  from cifar_train import loop

  def user_error(*args, **kwargs):
    raise errors.ConfigError("bad value")

  monkeypatch.setattr(loop, "train", user_error)
  assert cli.run(default.get_config(), "/tmp/unused") == 2
  assert capsys.readouterr().err == "error: bad value\n"

  def bug(*args, **kwargs):
    raise KeyError("a bug")

  monkeypatch.setattr(loop, "train", bug)
  with pytest.raises(KeyError):
    cli.run(default.get_config(), "/tmp/unused")
