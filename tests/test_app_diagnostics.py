"""The app on fp16 failures: the worst leaf, a NaN loss, an "auto" scale.

Two runs of the tiny job, on the one-block net (`one_block_models`), through
`cli.run` (the command line's error handling), each checked for several things
at once to keep the suite fast.
"""

import json
import os
import re
import types

from _helpers import one_block_models
from cifar_train import cli
from cifar_train import rounding_figures

LEAF = "['layer1_0']['conv2']['kernel']"
LEAF_SIZE = 3 * 3 * 4 * 4  # num_filters=4: layer1 has 4 channels.


def _records(workdir):
  with open(os.path.join(workdir, "steps.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_overflow_names_its_leaf_and_auto_scale_trains(
  make_config, data_dir, tiny_data, tmp_path, capsys, monkeypatch
):
  one_block_models(monkeypatch)
  workdir = str(tmp_path / "overflow")
  config = make_config(
    data_dir,
    diagnostics=True,
    init_loss_scale="auto",
    inject_overflow_at_step=2,
    inject_overflow_leaf="layer1_0/conv2/kernel",
    log_every_steps=3,  # The overflow at step 2 is between log steps.
    data_on_device=True,  # Calibrates on the batch gathered on the device.
    rounding_every=2,  # Measures applied steps 2 and 4 (steps 3 and 5).
  )
  assert cli.run(config, workdir, data=tiny_data) == 0
  out = capsys.readouterr().out
  m = re.search(
    r"init_loss_scale 'auto': (\d+) \(2\^(\d+)\), from (\d+) gradient "
    r"evaluations on the first batch",
    out,
  )
  assert m, out
  scale = float(m.group(1))
  assert scale == 2.0 ** int(m.group(2)) and 1 <= int(m.group(3)) <= 6
  # fp16 logits' gradients overflow well below the cap of 2^24.
  assert scale < 2.0**24
  skip_lines = [l for l in out.splitlines() if "skipped" in l and "Step" in l]
  assert skip_lines == [
    f"Step 3: skipped 1 of steps 1-3, loss scale {scale:g} -> "
    f"{scale / 2:g}; worst leaf {LEAF}: {LEAF_SIZE} non-finite"
  ]
  first, second = _records(workdir)
  assert (first["step"], first["skipped_since_last_log"]) == (3, 1)
  assert first["worst_leaf"] == LEAF
  assert first["worst_leaf_nonfinite"] == LEAF_SIZE
  assert first["loss_scale"] == scale / 2
  assert second["skipped_since_last_log"] == 0 and "worst_leaf" not in second
  # Rounding: applied step 2 at step 3 (the skip at step 2 moves nothing),
  # applied step 4 at step 5; per leaf (the one-block net has few), each
  # figure a share.
  assert (first["rounding_step"], second["rounding_step"]) == (2, 4)
  groups = second["rounding"]
  assert LEAF in groups and "['fc']['kernel']" in groups
  assert all(0 <= g["stalled"] <= 1 for g in groups.values())
  report = out[out.index("rounding at applied step 4") :]
  assert LEAF in report and "stalled" in report
  with open(os.path.join(workdir, "rounding_report.txt")) as f:
    assert f.read().startswith("rounding at applied step 4")
  png = os.path.join(workdir, "rounding_stalled.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["steps"] == 6 and summary["config"]["init_loss_scale"] == (
    "auto"
  )


def test_rounding_groups_are_layers_where_leaves_are_many():
  rows = [
    types.SimpleNamespace(path=f"['layer{i % 3}']['c{i}']['kernel']",
                          stalled=i / 40, quality=1 - i / 80, flushed=0.0)
    for i in range(30)
  ]  # fmt: skip
  groups = rounding_figures.groups(rows)
  assert sorted(groups) == ["layer0", "layer1", "layer2"]
  # The worst of each group: layer2's leaves are 2, 5, ..., 29.
  assert groups["layer2"] == {"stalled": 29 / 40, "quality": 1 - 29 / 80,
                              "flushed": 0.0}  # fmt: skip
  assert len(rounding_figures.groups(rows[:24])) == 24


def test_nan_data_stops_with_one_line_and_keeps_the_scale(
  make_config, data_dir, tiny_data, tmp_path, capsys, monkeypatch
):
  one_block_models(monkeypatch)
  workdir = str(tmp_path / "nan")
  config = make_config(
    data_dir, inject_nan_data_at_step=3, max_nonfinite_loss_steps=2
  )
  assert cli.run(config, workdir, data=tiny_data) == 2
  captured = capsys.readouterr()
  assert "Traceback" not in captured.err
  errors = [l for l in captured.err.splitlines() if l.startswith("error:")]
  assert len(errors) == 1
  assert errors[0].startswith(
    "error: the loss itself was NaN/inf at steps 3..4 (2 in a row). Three "
    "causes: bad input data (check the batch for NaN/inf), a diverged model "
    "(lower the learning rate), or an fp16 overflow in the forward pass"
  )
  assert errors[0].endswith("the loss scale was left at 32768")
  records = _records(workdir)
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert [r["loss_scale"] for r in records] == [2.0**15] * 4
  assert [r["skipped_since_last_log"] for r in records] == [0, 0, 1, 1]
  assert [r["nonfinite_loss_steps"] for r in records] == [0, 0, 1, 2]
  # Diagnostics off: no leaf is named anywhere.
  assert not any("worst_leaf" in r for r in records)
  skip_lines = [l for l in captured.out.splitlines() if "skipped" in l]
  assert skip_lines == [
    f"Step {k}: skipped 1 of steps {k}-{k}, loss scale 32768 -> 32768; "
    "1 of them with a NaN/inf loss"
    for k in (3, 4)
  ]
