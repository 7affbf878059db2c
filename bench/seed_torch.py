"""The seed's PyTorch script, with torch.amp in place of Apex, timed.

Run by ``bench/seed_job.py`` on the data the app trains on; prints one JSON
line: ``wall_s`` (from the process's start), ``first_step_s`` (likewise, to
the end of the first optimizer step), ``epoch_images_per_sec`` (each
epoch's training loop), ``test_accuracy`` (after the last epoch).

The seed: ``torchvision.models.resnet18(num_classes=10)``, SGD lr 0.1
momentum 0.9, cross-entropy, batch 128, ``ToTensor`` and
``Normalize((0.5,) * 3, (0.5,) * 3)``, shuffled, Apex O1 (here
``torch.autocast`` fp16 and ``GradScaler``). Data: ``--npz`` (uint8 images
and labels of both splits, served one PIL image at a time as torchvision's
CIFAR10 does) or ``--image_folder`` (``torchvision.datasets.ImageFolder``;
without torchvision, the folder's images read into arrays first, as
`read_image_folder`), through a ``DataLoader`` with ``--workers`` processes.
``--seed`` seeds torch: the initial weights and the order of the batches (0
by default, as in the seed's script).
"""

import argparse
import json
import os
import sys
import time


def process_start() -> float:
  """When this process started, on the ``time.time()`` clock (Linux).

  The same reading as `cifar_train.startup.process_start_time`, written
  again because that module imports jax, which this script, timed as the
  PyTorch side, must not pay for.
  """
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return time.time()


START = process_start()

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import torch  # pylint: disable=g-import-not-at-top,wrong-import-position

try:
  import torchvision  # pylint: disable=g-import-not-at-top
  from torchvision import transforms  # pylint: disable=g-import-not-at-top
except (ImportError, RuntimeError):  # A torchvision that does not import.
  torchvision = None


def to_tensor_normalized(image: np.ndarray) -> torch.Tensor:
  """``Normalize(0.5, 0.5)(ToTensor()(image))`` for a uint8 HWC array."""
  x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
  return (x.float() / 255.0 - 0.5) / 0.5


class ArrayDataset(torch.utils.data.Dataset):
  """uint8 ``[N, H, W, C]`` images, one at a time, as torchvision's CIFAR10."""

  def __init__(self, images, labels):
    self.images, self.labels = images, labels
    if torchvision is not None:
      self.transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]
      )

  def __len__(self):
    return len(self.labels)

  def __getitem__(self, i):
    if torchvision is None:
      return to_tensor_normalized(self.images[i]), int(self.labels[i])
    import PIL.Image  # pylint: disable=g-import-not-at-top

    image = PIL.Image.fromarray(self.images[i])
    return self.transform(image), int(self.labels[i])


def read_image_folder(root: str):
  """``(uint8 [N, H, W, 3] images, int64 labels, classes)`` of ``root``.

  Classes are the sorted subfolder names and files are taken in sorted
  order, as ``torchvision.datasets.ImageFolder`` numbers them.
  """
  import PIL.Image  # pylint: disable=g-import-not-at-top

  classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
  images, labels = [], []
  for label, name in enumerate(classes):
    folder = os.path.join(root, name)
    for file in sorted(os.listdir(folder)):
      with PIL.Image.open(os.path.join(folder, file)) as image:
        images.append(np.asarray(image.convert("RGB")))
      labels.append(label)
  return np.stack(images), np.asarray(labels, np.int64), classes


def model(num_classes: int, filters: int):
  if torchvision is not None and filters == 64:
    return torchvision.models.resnet18(num_classes=num_classes), "torchvision"
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _torch_resnet  # pylint: disable=g-import-not-at-top

  return _torch_resnet.TorchvisionResNet18(num_classes, filters), "copy"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--npz", default="")
  parser.add_argument("--image_folder", default="")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--filters", type=int, default=64)
  parser.add_argument("--threads", type=int, default=0)
  parser.add_argument(
    "--seed", type=int, default=0, help="torch.manual_seed: weights, order"
  )
  args = parser.parse_args()
  if args.threads:
    torch.set_num_threads(args.threads)
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  torch.backends.cudnn.benchmark = True
  if args.image_folder and torchvision is None:
    train_x, train_y, names = read_image_folder(
      os.path.join(args.image_folder, "train")
    )
    test_x, test_y, _ = read_image_folder(
      os.path.join(args.image_folder, "test")
    )
    train, test = ArrayDataset(train_x, train_y), ArrayDataset(test_x, test_y)
    classes = len(names)
  elif args.image_folder:
    tf = transforms.Compose(
      [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]
    )
    folder = torchvision.datasets.ImageFolder
    train = folder(os.path.join(args.image_folder, "train"), tf)
    test = folder(os.path.join(args.image_folder, "test"), tf)
    classes = len(train.classes)
  else:
    with np.load(args.npz) as z:
      train = ArrayDataset(z["train_images"], z["train_labels"])
      test = ArrayDataset(z["test_images"], z["test_labels"])
      classes = int(z["num_classes"])
  loader = lambda ds, shuffle: torch.utils.data.DataLoader(
    ds,
    batch_size=args.batch,
    shuffle=shuffle,
    num_workers=args.workers,
    pin_memory=dev == "cuda",
    drop_last=shuffle,
    persistent_workers=args.workers > 0,
  )
  train_loader, test_loader = loader(train, True), loader(test, False)
  torch.manual_seed(args.seed)
  net, which = model(classes, args.filters)
  net = net.to(dev)
  sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
  scaler = torch.amp.GradScaler(dev, enabled=dev == "cuda")
  loss_f = torch.nn.CrossEntropyLoss()
  first_step, rates = None, []
  for _ in range(args.epochs):
    net.train()
    t, n = time.time(), 0
    for x, y in train_loader:
      x = x.to(dev, non_blocking=True)
      y = y.to(dev, non_blocking=True)
      sgd.zero_grad(set_to_none=True)
      with torch.autocast(dev, dtype=torch.float16, enabled=dev == "cuda"):
        loss = loss_f(net(x), y)
      scaler.scale(loss).backward()
      scaler.step(sgd)
      scaler.update()
      n += len(y)
      if first_step is None:
        if dev == "cuda":
          torch.cuda.synchronize()
        first_step = time.time() - START
    if dev == "cuda":
      torch.cuda.synchronize()
    rates.append(n / (time.time() - t))
  net.eval()
  correct = total = 0
  with torch.no_grad():
    for x, y in test_loader:
      x, y = x.to(dev), y.to(dev)
      with torch.autocast(dev, dtype=torch.float16, enabled=dev == "cuda"):
        correct += int((net(x).argmax(-1) == y).sum())
      total += len(y)
  print(
    json.dumps(
      {
        "wall_s": time.time() - START,
        "first_step_s": first_step,
        "epoch_images_per_sec": rates,
        "test_accuracy": correct / max(total, 1),
        "model": which,
        "device": dev,
        "seed": args.seed,
      }
    ),
    flush=True,
  )


if __name__ == "__main__":
  main()
