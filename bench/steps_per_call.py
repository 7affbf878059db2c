"""Several train steps per jitted call: the app's steady img/s at each k.

Run::

  python bench/steps_per_call.py              # the seed's job, k = 1, 2, 4, 8
  python bench/steps_per_call.py --smoke      # the one-block net, 8 filters

The app's own loop (``cifar_train.loop.train_and_evaluate``) trains the job of
``configs/seed.py`` (the torchvision ResNet18, O1, batch 128, its data on the
device) on random CIFAR-shaped images held in memory, once per
``steps_per_call`` k of ``--ks``, in ``--rounds`` rounds that take every k in
turn, so that the figures of one k are spread over the run as the others'
are. Each run trains ``--epochs`` epochs of ``--examples`` images; its rate
is the median img/s of its epochs after the first (which compiles), and a
k's figure the median over its rounds. With k > 1 a call is a loop over up to
k steps (its trip count a runtime value); with k = 1 it is the lone step,
without the loop (what ``steps_per_call="auto"`` picks on a CPU). The log and save steps of
the job (every 50 steps, and each epoch's end) end a call early.

Prints one line per run, then a table of each k's median img/s and its ratio
to k = 1 (the last line: ``best_k: K (RATIO x k=1)``).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from cifar_train import data_sources  # noqa: E402
from cifar_train import loop  # noqa: E402
from cifar_train import steps  # noqa: E402
from configs import seed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position


def random_data(examples: int, seed_: int = 0) -> data_sources.Dataset:
  """Random uint8 CIFAR-shaped images and labels of 10 classes."""
  rng = np.random.default_rng(seed_)
  image = lambda n: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  label = lambda n: rng.integers(0, 10, n).astype(np.int32)
  test = max(examples // 10, 128)
  return data_sources.Dataset(
    image(examples), label(examples), image(test), label(test), 10
  )


def job_config(args, k: int, cache_dir: str):
  """configs/seed.py with ``steps_per_call=k`` and the bench's sizes.

  The runs share ``cache_dir``, a fresh compile cache: a k's later rounds
  load its programs instead of compiling them again.
  """
  config = seed.get_config()
  config.steps_per_call = k
  config.num_epochs = args.epochs
  config.num_filters = args.filters
  config.batch_size = args.batch
  config.progress_bar = False
  config.compile_cache_dir = cache_dir
  config.checkpoint_every_steps = 0
  return config


def steady_rate(workdir: str) -> float:
  """The median img/s of the epochs after the first (``metrics.jsonl``)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rates = [json.loads(line)["images_per_sec"] for line in f if line.strip()]
  return statistics.median(rates[1:] or rates)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="one block, tiny")
  parser.add_argument("--ks", default="1,2,4,8")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--epochs", type=int, default=0, help="default 3")
  parser.add_argument("--examples", type=int, default=0, help="default 25600")
  parser.add_argument("--filters", type=int, default=0, help="default 64")
  parser.add_argument("--batch", type=int, default=128)
  args = parser.parse_args(argv)
  print(_common.date_line("steps_per_call"), flush=True)
  args.epochs = args.epochs or 3
  args.examples = args.examples or (4096 if args.smoke else 25_600)
  args.filters = args.filters or (8 if args.smoke else 64)
  ks = [int(k) for k in args.ks.split(",") if k]
  if args.smoke:  # The one-block net of bench/_train_one_block.py.
    create = steps.create_model
    steps.create_model = lambda *a, **kw: create(*a, **kw).clone(
      stage_sizes=(1,)
    )
  dev = jax.devices()[0]
  print(
    f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); "
    f"configs/seed.py, {args.filters} filters"
    f"{', one block [SMOKE]' if args.smoke else ''}, batch {args.batch}, "
    f"{args.examples} images x {args.epochs} epochs per run",
    flush=True,
  )
  data = random_data(args.examples)
  rates = {k: [] for k in ks}
  root = tempfile.mkdtemp(prefix="steps-per-call-")
  for r in range(args.rounds):
    for k in ks:
      workdir = os.path.join(root, f"k{k}-round{r}")
      start = time.perf_counter()
      config = job_config(args, k, os.path.join(root, "jit"))
      loop.train_and_evaluate(config, workdir, data=data)
      rates[k].append(steady_rate(workdir))
      print(
        f"  k={k} round {r}: {rates[k][-1]:.0f} img/s "
        f"(run {time.perf_counter() - start:.0f} s)",
        flush=True,
      )
  base = statistics.median(rates[ks[0]])
  print(f"{'k':>3} {'img/s':>9} {'over k=' + str(ks[0]):>10}  rounds")
  for k in ks:
    m = statistics.median(rates[k])
    print(f"{k:>3} {m:>9.0f} {m / base:>10.2f}  {[round(x) for x in rates[k]]}")
  best = max(ks, key=lambda k: statistics.median(rates[k]))
  print(
    f"best_k: {best} ({statistics.median(rates[best]) / base:.2f} x k={ks[0]})"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
