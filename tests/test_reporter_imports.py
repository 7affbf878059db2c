"""The reporter's TensorBoard writer does not import PyTorch."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tensorboard_writer_leaves_torch_unimported_and_importable(tmp_path):
  """A stand-in ``torch`` package records whether anything imports it.

  tensorboardX imports torch when it is installed; the reporter's writer
  must not (1.5-2 s of every start-up), and must leave ``import torch``
  working for the code after it.
  """
  fake = tmp_path / "site" / "torch"
  fake.mkdir(parents=True)
  marker = tmp_path / "torch-imported"
  (fake / "__init__.py").write_text(
    f"open({str(marker)!r}, 'w').close()\nTensor = object\n"
  )
  workdir = tmp_path / "work"
  workdir.mkdir()
  script = textwrap.dedent(
    f"""
    import os, sys
    from cifar_train import reporting
    with reporting.Reporter({str(workdir)!r}, num_devices=1, total_steps=2,
                            progress_bar=False) as r:
      r.log_step(1, {{"loss": 1.5, "accuracy": 0.5, "loss_scale": 2.0 ** 15,
                     "skipped_steps": 0, "step_applied": 1}})
    print("before:", os.path.exists({str(marker)!r}))
    import torch
    print("after:", os.path.exists({str(marker)!r}), torch.Tensor is object)
    """
  )
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [str(tmp_path / "site"), ROOT, env.get("PYTHONPATH", "")]
  )
  out = subprocess.run(
    [sys.executable, "-c", script],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  assert "before: False" in out.stdout
  assert "after: True True" in out.stdout
  events = os.listdir(workdir / "tb")
  assert len(events) == 1 and events[0].startswith("events.out.tfevents")
  assert os.path.getsize(workdir / "tb" / events[0]) > 0
