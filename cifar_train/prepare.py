"""Prepares a data set once, to ArrayRecord: ``python -m cifar_train.prepare``.

    python -m cifar_train.prepare cifar10 [--data_dir=DIR]
    python -m cifar_train.prepare image_folder --data_dir=ROOT

CIFAR is read from ``DIR/downloads/manual/cifar-10-binary.tar.gz`` when the
archive is there, else downloaded. Training prepares the data set the same
way on its first run; this command does it ahead, e.g. on a login node.
Prints where the prepared files are and the split sizes.
"""

import argparse
import sys
import time

from cifar_train import data_sources
from cifar_train.errors import UserError


def main(argv=None) -> int:
  """Prepares the data set that ``argv`` names; returns the exit code."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dataset", choices=data_sources.DATASETS)
  parser.add_argument("--data_dir", default="", help="tfds data dir")
  parser.add_argument("--synthetic_examples", default="10000,2000")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  try:
    source = data_sources.builder(
      args.dataset,
      args.data_dir or None,
      synthetic_examples=tuple(
        int(n) for n in args.synthetic_examples.split(",")
      ),
    )
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  sizes = {k: v.num_examples for k, v in source.info.splits.items()}
  print(
    f"{args.dataset}: {sizes} in {source.data_dir} "
    f"({time.perf_counter() - start:.1f} s)",
    flush=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
