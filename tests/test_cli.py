"""The command line: bad keys, values and files give one ``error:`` line.

Errors found while parsing (`train.parse`, before any flag is defined) are
checked in-process; the process boundary (exit code 2, one line on stderr,
no traceback) through `train.py` itself, once per path: a parse error, a
flag error and a value that `settings.resolve` rejects.
"""

import os
import subprocess
import sys

import pytest

import train
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
  argv = ["train.py", "--config", "configs/smoke.py"]
  argv += ["--workdir", str(tmp_path), f"--config.{key}=3"]
  with pytest.raises(train.ConfigFileError) as raised:
    train.parse(argv)
  line = str(raised.value)
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


def test_the_config_file_is_executed_once(tmp_path):
  runs = tmp_path / "runs.txt"
  config = tmp_path / "counted.py"
  config.write_text(
    "from configs import smoke\n"
    f"with open({str(runs)!r}, 'a') as f:\n"
    "  f.write('ran\\n')\n"
    "get_config = smoke.get_config\n"
  )
  argv = ["--config", str(config), "--workdir", str(tmp_path / "w")]
  # Through train.py: the flags are defined with the config, then parsed.
  for arg in (
    "--config.policy=O9",  # Rejected by settings.resolve.
    "--config.batch_size=abc",  # A value of the wrong type.
  ):
    runs.write_text("")
    line = _one_error_line(_train_py(*argv, arg))
    assert runs.read_text() == "ran\n", (arg, line)
  # Rejected while parsing, before any flag is defined: in-process.
  for arg, message in (
    ("--config.polcy=O2", "unknown config key 'polcy'"),  # An unknown key.
    ("--config.policy.x=1", "config key 'policy' has no field 'x'"),
  ):
    runs.write_text("")
    with pytest.raises(train.ConfigFileError) as raised:
      train.parse(["train.py", *argv, arg])
    assert str(raised.value).startswith(message), (arg, raised.value)
    assert runs.read_text() == "ran\n", arg


def test_reuse_host_memory_goes_through_settings(monkeypatch):
  from cifar_train import loop
  from cifar_train import startup

  calls, trained = [], []
  monkeypatch.setattr(
    startup, "keep_freed_host_memory", lambda: calls.append(1)
  )
  monkeypatch.setattr(loop, "train", lambda s, *a, **k: trained.append(s))
  config = default.get_config()
  assert cli.run(config, "/tmp/unused") == 0 and calls == []
  config.reuse_host_memory = True
  assert cli.run(config, "/tmp/unused") == 0 and calls == [1]
  assert [s.reuse_host_memory for s in trained] == [False, True]


def test_init_from_errors_keep_their_class(tmp_path, monkeypatch):
  from jaxmp import models

  from cifar_train import errors
  from cifar_train import steps

  damaged = tmp_path / "weights.npz"
  damaged.write_bytes(b"PK\x03\x04 not a zip archive")
  args = dict(model_name="resnet18", num_classes=10, num_filters=4)
  with pytest.raises(
    errors.ConfigError,
    match="init_from .*weights.npz: the file is damaged or cut short",
  ):
    steps.load_torch_weights(str(damaged), **args)
  with pytest.raises(errors.ConfigError, match="No such file") as missing:
    steps.load_torch_weights(str(tmp_path / "missing.npz"), **args)
  assert "damaged" not in str(missing.value)

  def bug(path):
    raise KeyError("a bug in the reader")

  monkeypatch.setattr(models, "read_state_dict", bug)
  with pytest.raises(KeyError, match="a bug in the reader"):
    steps.load_torch_weights(str(damaged), **args)
