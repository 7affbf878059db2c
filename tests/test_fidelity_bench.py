"""bench/fidelity.py: the table's means, spreads and gaps, its --out files."""

import json
import statistics

import numpy as np
import pytest

from _helpers import bench_module
from cifar_train import loop


def _fidelity():
  return bench_module("fidelity")


def _rows(accs):
  return {
    (p, s): {"test_accuracy": a, "train_loss": 1.0 + a}
    for p, by_seed in accs.items()
    for s, a in by_seed.items()
  }


def test_table_means_spreads_and_gaps():
  fidelity = _fidelity()
  accs = {
    "O0": {0: 0.50, 1: 0.54, 2: 0.52},
    "O2": {0: 0.47, 1: 0.49, 2: 0.48},
  }
  text, max_gap = fidelity.table(_rows(accs), ["O0", "O2"], [0, 1, 2])
  o2 = next(line for line in text.splitlines() if line.startswith("| O2 "))
  cells = [c.strip() for c in o2.strip("|").split("|")]
  assert cells[1:4] == ["47.00", "49.00", "48.00"]
  assert cells[4] == "48.00"  # mean
  assert float(cells[5]) == pytest.approx(
    statistics.stdev([47.0, 49.0, 48.0]), abs=0.005
  )
  assert cells[6] == "47.00..49.00"
  assert float(cells[7]) == pytest.approx(1.48, abs=5e-5)  # mean train loss
  assert cells[8] == "-4.00"  # O2's mean below O0's
  # Paired by seed: differences -3, -5, -4; their std 1, over sqrt(3).
  assert float(cells[9]) == pytest.approx(1 / 3**0.5, abs=0.005)
  assert cells[10] == "3 of 3"
  assert max_gap == pytest.approx(4.0, abs=1e-9)
  o0 = next(line for line in text.splitlines() if line.startswith("| O0 "))
  assert [c.strip() for c in o0.strip("|").split("|")][8:] == ["+0.00", "", ""]


def test_table_standard_error_is_of_the_paired_differences():
  """Seeds that move both policies alike leave the paired error small."""
  fidelity = _fidelity()
  accs = {
    "O0": {0: 0.40, 1: 0.60, 2: 0.50, 3: 0.70},
    "O1": {0: 0.41, 1: 0.59, 2: 0.52, 3: 0.70},
  }
  text, _ = fidelity.table(_rows(accs), ["O0", "O1"], [0, 1, 2, 3])
  o1 = next(line for line in text.splitlines() if line.startswith("| O1 "))
  cells = [c.strip() for c in o1.strip("|").split("|")]
  diffs = [1.0, -1.0, 2.0, 0.0]
  want = statistics.stdev(diffs) / 2  # Over sqrt(4) seeds; unpaired: about 9.
  assert float(cells[10]) == pytest.approx(want, abs=0.005)
  assert cells[11] == "1 of 4"  # 0.00 is not below


def test_table_baseline_is_the_first_policy_and_a_better_policy_has_no_gap():
  fidelity = _fidelity()
  accs = {"O2": {0: 0.60}, "O0": {0: 0.55}}
  text, max_gap = fidelity.table(_rows(accs), ["O0", "O2"], [0])
  assert "gap to O0" in text.splitlines()[0]
  o2 = next(line for line in text.splitlines() if line.startswith("| O2 "))
  cells = [c.strip() for c in o2.strip("|").split("|")]
  assert cells[6:] == ["+5.00", "", "0 of 1"]  # one seed: no error
  assert cells[3] == "0.00"  # one seed: no spread
  assert max_gap == pytest.approx(0.0, abs=1e-9)


def test_tabulate_reads_out_files_and_pairs_the_common_seeds(tmp_path, capsys):
  """``--tabulate``: several files, a rerun replaces, a lone seed is left out."""
  fidelity = _fidelity()
  lines = {
    "a.jsonl": [("O2", 0, 0.47), ("O0", 0, 0.50), ("O0", 1, 0.99)],
    "b.jsonl": [("O0", 1, 0.54), ("O2", 1, 0.49), ("O0", 2, 0.52)],
  }
  for name, runs in lines.items():
    (tmp_path / name).write_text(
      "".join(
        f'{{"policy": "{p}", "seed": {s}, "test_accuracy": {a}, '
        f'"train_loss": 1.0}}\n'
        for p, s, a in runs
      )
    )
  files = ",".join(str(tmp_path / n) for n in lines)
  assert fidelity.main([f"--tabulate={files}"]) == 0
  out = capsys.readouterr().out
  assert "seeds left out (a policy has no run): [2]" in out
  assert out.splitlines()[1].startswith("| policy | seed 0 | seed 1 | mean")
  o0 = next(line for line in out.splitlines() if line.startswith("| O0 "))
  assert o0.startswith("| O0 | 50.00 | 54.00 | 52.00 |")  # 0.99 replaced
  assert out.rstrip().endswith("max_gap_pp: 4.00")
  with pytest.raises(ValueError, match="no seed has a run of every policy"):
    fidelity.tabulate(fidelity.read_runs([tmp_path / "a.jsonl"]), ["O1"])


def test_start_file_exact_is_the_plain_run_rounded_is_fp16_of_it(
  make_config, data_dir, tiny_data, tmp_path
):
  """The control's start: the run's own weights; exact, then fp16-rounded."""
  fidelity = _fidelity()
  # The job of tests/test_torchvision.py's init_from test (its programs come
  # from the run's compilation cache): one step at learning rate 0, so the
  # final params are the start's and the statistics and momentum moved once.
  config = lambda **kw: make_config(
    data_dir,
    policy="O0",
    learning_rate=0.0,
    weight_decay=0.0,
    num_train_steps=1,
    checkpoint_every_steps=1,
    **kw,
  )
  exact = fidelity.write_start(
    config(), tiny_data, str(tmp_path / "exact.npz"), round_to=None
  )
  rounded = fidelity.write_start(config(), tiny_data, str(tmp_path / "f16.npz"))
  with np.load(exact) as e, np.load(rounded) as r:
    assert sorted(e.files) == sorted(r.files)
    moved = 0
    for k in e.files:
      assert r[k].dtype == e[k].dtype, k
      if e[k].dtype.kind != "f":
        np.testing.assert_array_equal(r[k], e[k], err_msg=k)
        continue
      np.testing.assert_array_equal(
        r[k], e[k].astype(np.float16).astype(e[k].dtype), err_msg=k
      )
      moved += int(np.sum(r[k] != e[k]))
    assert moved > 0  # Random init values are not all fp16-representable.
  plain = loop.train_and_evaluate(config(), str(tmp_path / "a"), data=tiny_data)
  started = loop.train_and_evaluate(
    config(init_from=exact), str(tmp_path / "b"), data=tiny_data
  )
  assert started["state_fingerprint"] == plain["state_fingerprint"]


def test_recipes_are_their_configs_with_only_the_flags_given():
  """``--recipe``: default's job is fixed at 16/1/128; seed's is the config's."""
  fidelity = _fidelity()
  from configs import seed

  def job(*flags):
    args = fidelity.make_parser().parse_args(["--data_dir=D", *flags])
    return fidelity.job_config(args, "O2", 3)

  plain = job()
  assert (plain.num_filters, plain.num_epochs, plain.batch_size) == (16, 1, 128)
  assert plain.lr_schedule == "cosine" and plain.model == "resnet18"
  assert fidelity.job_of(plain, "default") == fidelity.LEGACY_JOB
  script = seed.get_config()
  for config in (job("--recipe=seed"), job("--recipe=seed", "--num_epochs=2")):
    assert (config.policy, config.seed) == ("O2", 3)
    assert (config.dataset, config.data_dir) == ("image_folder", "D")
    for name in ("model", "num_filters", "batch_size", "lr_schedule"):
      assert config[name] == script[name], name
    assert (config.augment, config.mean) == (False, script.mean)
  assert job("--recipe=seed").num_epochs == script.num_epochs == 10
  assert job("--recipe=seed", "--num_epochs=2").num_epochs == 2
  assert fidelity.job_of(job("--warmup_epochs=0.2"), "default") == dict(
    fidelity.LEGACY_JOB, warmup_epochs=0.2
  )


def test_tabulate_refuses_files_of_different_jobs(tmp_path):
  """A seed-recipe line beside a line without a job (the default's) raises."""
  fidelity = _fidelity()
  line = (
    '{{"policy": "O0", "seed": 0, "test_accuracy": 0.5, "train_loss": 1{}}}\n'
  )
  (tmp_path / "old.jsonl").write_text(line.format(""))
  seed_job = dict(fidelity.LEGACY_JOB, recipe="seed", num_epochs=10)
  (tmp_path / "seed.jsonl").write_text(
    line.format(', "job": ' + json.dumps(seed_job))
  )
  legacy = ', "job": ' + json.dumps(fidelity.LEGACY_JOB)
  (tmp_path / "new.jsonl").write_text(line.format(legacy))
  ok = fidelity.read_runs([tmp_path / "old.jsonl", tmp_path / "new.jsonl"])
  assert list(ok) == [("O0", 0)]
  with pytest.raises(ValueError, match=r"seed.jsonl:1 is a run of .*'seed'"):
    fidelity.read_runs([tmp_path / "old.jsonl", tmp_path / "seed.jsonl"])
