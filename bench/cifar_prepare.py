"""Preparing CIFAR10 once from its archive, without TensorFlow; and reading it.

Run:

    python bench/cifar_prepare.py [--train 50000 --test 10000]
    python bench/cifar_prepare.py --compare_with_tf --train 500 --test 100

There is no CIFAR10 offline, so the archive is written here in the official
binary format (``cifar-10-binary.tar.gz``: 5 train batch files, a test
batch, ``batches.meta.txt``) with random pixels, at the real size by
default (50,000 + 10,000 32x32x3 images, 184 MB gzipped). Random pixels do
not compress, so gunzipping takes about as long as for the real archive.

Prints the seconds to prepare it (`cifar_train.cifar.Cifar10`, ArrayRecord)
and to read both splits into memory (`data_sources.read_split`), each in a
fresh process, then ``prepare_seconds: X``.

With ``--compare_with_tf`` (needs TensorFlow installed) it also prepares
the same archive with tfds' own ``cifar10`` builder (TensorFlow's reader and
PNG encoder) and checks that both give the same records in the same order:
ids, pixels and labels; only the PNG bytes differ.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
from cifar_train import cifar  # pylint: disable=g-import-not-at-top,wrong-import-position

PREPARE = """
import sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
from cifar_train import data_sources
source = data_sources.builder("cifar10", {data_dir!r})
print("prepare", time.perf_counter() - start, "tensorflow" in sys.modules)
"""

READ = """
import sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
from cifar_train import data_sources
data = data_sources.load("cifar10", {data_dir!r})
print("read", time.perf_counter() - start, len(data.train_images),
      len(data.test_images), "tensorflow" in sys.modules)
"""

# Records of a prepared copy, in the data source's order, by tfds' decoders.
RECORDS = """
import numpy as np
def records(source, split):
  out = []
  for r in source.as_data_source(split):
    out.append((r["id"], r["image"], int(r["label"])))
  return out
"""

COMPARE = (
  RECORDS
  + """
import os, sys, tarfile
sys.path.insert(0, {root!r})
import tensorflow_datasets as tfds
from cifar_train import cifar
extracted = {extracted!r}
with tarfile.open({archive!r}) as tar:
  tar.extractall(extracted)
# tfds' own builder, offline: its download step returns the unpacked archive.
tfds.download.DownloadManager.download_and_extract = lambda self, url: extracted
theirs = tfds.builder("cifar10", data_dir={tf_dir!r}, file_format="array_record")
theirs.download_and_prepare(
    download_config=tfds.download.DownloadConfig(try_download_gcs=False))
ours = cifar.Cifar10(data_dir={data_dir!r}, file_format="array_record")
counts = []
for split in ("train", "test"):
  a, b = records(theirs, split), records(ours, split)
  assert len(a) == len(b), (len(a), len(b))
  for (ia, xa, ya), (ib, xb, yb) in zip(a, b):
    assert ia == ib and ya == yb and np.array_equal(xa, xb), (ia, ib)
  counts.append(f"{{split}} {{len(a)}}")
print("tfds+TensorFlow vs ours:", ", ".join(counts),
      "records equal (ids, pixels, labels), in the same order")
"""
)


def run(script: str) -> str:
  out = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    cwd=ROOT,
    check=False,
  )
  if out.returncode:
    raise RuntimeError(out.stderr[-3000:])
  return out.stdout.strip().splitlines()[-1]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--train", type=int, default=50_000)
  parser.add_argument("--test", type=int, default=10_000)
  parser.add_argument("--compare_with_tf", action="store_true")
  args = parser.parse_args()
  print(_common.date_line("cifar_prepare"), flush=True)

  tmp = tempfile.mkdtemp(prefix="cifar-prepare-")
  data_dir = os.path.join(tmp, "tfds")
  start = time.perf_counter()
  archive = cifar.write_random_archive(data_dir, args.train, args.test)
  print(
    f"archive written: {os.path.getsize(archive) / 1e6:.0f} MB, "
    f"{args.train} + {args.test} images "
    f"({time.perf_counter() - start:.1f} s)",
    flush=True,
  )
  prepare = run(PREPARE.format(root=ROOT, data_dir=data_dir)).split()
  read = run(READ.format(root=ROOT, data_dir=data_dir)).split()
  print(f"prepare (fresh process, imports included): {float(prepare[1]):.1f} s")
  print(f"read both splits (fresh process): {float(read[1]):.1f} s")
  print(f"tensorflow imported: {prepare[2]} (prepare), {read[4]} (read)")
  if args.compare_with_tf:
    print(
      run(
        COMPARE.format(
          root=ROOT,
          data_dir=data_dir,
          tf_dir=os.path.join(tmp, "tf"),
          archive=archive,
          extracted=os.path.join(tmp, "extracted"),
        )
      )
    )
  print(f"prepare_seconds: {float(prepare[1]):.1f}")


if __name__ == "__main__":
  main()
