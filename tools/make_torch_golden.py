"""Writes PyTorch's answers for the parity tests to ``tests/golden/``.

Run with torch installed (``pip install -e .[bench]``), from the repo root::

  python tools/make_torch_golden.py [--out tests/golden]

It writes ``torch_resnet18.npz`` and ``torch_resnet18.pth``, which
``tests/test_torchvision.py`` reads without torch, and which its
``test_golden_files_are_what_torch_computes`` (with torch) regenerates into a
temporary directory and compares. The two nets are ``bench/_torch_resnet.py``'s
(torchvision is not installable beside torch 2.13): its
``TorchvisionResNet18`` has torchvision's module names and init, its
``ResNet18`` is renamed to kuangliu/pytorch-cifar's names (``layerI.J``,
``shortcut``, ``linear``) on the way out. Both at 4 filters and 5 classes.

The weights and inputs come from numpy's seeded generator (bit for bit the
same on every machine); torch computes, in float32 and float64, for each net:

* ``<arch>/weights/<name>``: the float32 state dict (random BatchNorm affine
  and running statistics, random counters), in torch's names and layouts;
* ``<arch>/x`` (NCHW float32) and ``<arch>/labels``;
* ``<arch>/<dtype>/eval_logits``, ``train_logits`` and ``loss`` (mean
  cross-entropy of the train-mode logits);
* ``<arch>/<dtype>/stats/<name>``: running mean, variance and counter after
  that one train-mode forward pass (torch's unbiased running variance);
* ``<arch>/<dtype>/grad/<name>``: the gradient of ``loss`` for every
  parameter, by torch name.

``calibrated/...``: the torchvision net (4 filters, 5 classes, a batch of 4
at 64x64, seed 2) with running statistics calibrated by torch, so that eval
mode normalises with statistics of real activations (the deployed setting),
not random ones. Weights drawn as above (random BatchNorm affine: weight
U(0.5, 1.5), bias N(0, 0.2)), then, in float64: every BatchNorm's
``reset_running_stats()`` (mean 0, variance 1, counter 0) and
``momentum=None`` (torch's cumulative average), one train-mode forward pass
(no gradient) of a separate calibration batch (float64 N(0, 1), drawn
before ``x``, not stored). That sets each running mean to the calibration
batch's mean, each running variance to its unbiased variance (the biased one
times ``n / (n - 1)``, n values per channel) and each counter to 1; the
statistics are rounded to float32 and momentum is torch's default (0.1)
again. The arrays:

* ``calibrated/weights/<name>``: that float32 state dict, calibrated;
* ``calibrated/x`` (NCHW float32) and ``calibrated/labels``;
* ``calibrated/<dtype>/eval_logits``, ``eval_loss`` (mean cross-entropy of
  the eval-mode logits: the calibrated running statistics in use) and
  ``eval_grad/<name>``, the gradient of ``eval_loss`` for every parameter;
* ``calibrated/<dtype>/train_logits``, ``loss`` (of the train-mode logits:
  batch statistics) and ``grad/<name>``, the gradient of ``loss``.

Every case is checked clear of the nets' two kinks (`check_clear_of_kinks`):
a ReLU input that fp32 arithmetic in another summation order (another CPU)
could move across 0 would pass or stop a whole gradient entry, and so would
a max-pool window whose two largest inputs it could swap (the gradient goes
to the other one). No tolerance on the gradients can allow for either.

And ``init/<name>``: ``[size, mean, std, max |value|]`` of each tensor of
torch's ``TorchvisionResNet18(num_classes=100, num_filters=16)`` init (torch
seed 0); ``bfloat16/<name>``: the bits (uint16) of torch's bfloat16 cast of
the torchvision net's float32 weights. The ``.pth`` is
``torch.save({"net": <torchvision weights>, "epoch": 3})``.
"""

import argparse
import os
import re
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import _torch_resnet  # pylint: disable=g-import-not-at-top,wrong-import-position

FILTERS, CLASSES, BATCH = 4, 5, 4
INIT_FILTERS, INIT_CLASSES = 16, 100
# Input size per arch: 64x64 for the ImageNet stem, so that its last stage is
# 2x2 (train-mode BatchNorm over 4 * 2 * 2 = 16 values per channel).
SIZE = {"resnet18_torchvision": 64, "resnet18": 32}
SEED = {"resnet18_torchvision": 0, "resnet18": 1}
CALIBRATED, CALIBRATED_SEED = "calibrated", 2
NPZ, PTH = "torch_resnet18.npz", "torch_resnet18.pth"


def kuangliu_name(name: str) -> str:
  """The bench CIFAR ResNet18's names -> kuangliu/pytorch-cifar's."""
  name = re.sub(
    r"^layers\.(\d+)\.",
    lambda m: f"layer{int(m[1]) // 2 + 1}.{int(m[1]) % 2}.",
    name,
  )
  return re.sub(r"^fc\.", "linear.", name.replace(".downsample.", ".shortcut."))


def make_net(arch: str, num_classes: int, num_filters: int):
  """The torch net of ``arch`` and its name map (torch name -> golden)."""
  if arch == "resnet18_torchvision":
    net = _torch_resnet.TorchvisionResNet18(num_classes, num_filters)
    return net, lambda n: n
  return _torch_resnet.ResNet18(num_classes, num_filters), kuangliu_name


def random_weights(net, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Seeded float32 values for every tensor of ``net``'s state dict.

  Convs He-normal in fan-in, BatchNorm weight U(0.5, 1.5), bias N(0, 0.2),
  running mean N(0, 0.3), running var U(0.5, 2), counters U{0..999}; the
  linear layer N(0, 0.1). Non-default BatchNorm values, so that a swapped
  scale/bias or mean/var shows in the logits.
  """
  out = {}
  for name, t in net.state_dict().items():
    shape, leaf = tuple(t.shape), name.rsplit(".", 1)[1]
    if leaf == "num_batches_tracked":
      out[name] = np.int64(rng.integers(0, 1000))
    elif len(shape) == 4:
      std = np.sqrt(2.0 / np.prod(shape[1:]))
      out[name] = (rng.normal(size=shape) * std).astype(np.float32)
    elif len(shape) == 2 or name.startswith("fc."):
      out[name] = rng.normal(0, 0.1, shape).astype(np.float32)
    elif leaf == "weight":
      out[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
    elif leaf == "bias":
      out[name] = rng.normal(0, 0.2, shape).astype(np.float32)
    elif leaf == "running_mean":
      out[name] = rng.normal(0, 0.3, shape).astype(np.float32)
    elif leaf == "running_var":
      out[name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    else:
      raise ValueError(f"unexpected tensor {name} {shape}")
  return out


def parity_arrays(arch: str) -> dict[str, np.ndarray]:
  """The ``<arch>/...`` arrays of the module docstring."""
  rng = np.random.default_rng(SEED[arch])
  net, rename = make_net(arch, CLASSES, FILTERS)
  weights = random_weights(net, rng)
  x = rng.normal(size=(BATCH, 3, SIZE[arch], SIZE[arch])).astype(np.float32)
  check_clear_of_kinks(
    arch, lambda: make_net(arch, CLASSES, FILTERS)[0], weights, x, train=True
  )
  labels = np.arange(BATCH, dtype=np.int64) % CLASSES
  out = {f"{arch}/x": x, f"{arch}/labels": labels}
  out.update({f"{arch}/weights/{rename(k)}": v for k, v in weights.items()})
  for dtype in ("float32", "float64"):
    tdtype = getattr(torch, dtype)
    net.load_state_dict(
      {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
    )
    net.to(tdtype)
    tx = torch.from_numpy(x).to(tdtype)
    net.eval()
    with torch.no_grad():
      out[f"{arch}/{dtype}/eval_logits"] = net(tx).numpy()
    net.train()
    logits, loss, grads = loss_and_grads(net, tx, labels)
    out[f"{arch}/{dtype}/train_logits"] = logits
    out[f"{arch}/{dtype}/loss"] = loss
    for k, v in net.state_dict().items():
      if "running_" in k or "num_batches" in k:
        out[f"{arch}/{dtype}/stats/{rename(k)}"] = v.numpy().copy()
    for k, g in grads.items():
      out[f"{arch}/{dtype}/grad/{rename(k)}"] = g
  return out


def relu_inputs(net, x) -> list[np.ndarray]:
  """The input of every ``torch.relu`` of ``net``'s forward pass on ``x``."""
  seen, relu = [], torch.relu

  def recording(t):
    seen.append(t.detach().double().numpy().copy())
    return relu(t)

  torch.relu = recording
  try:
    with torch.no_grad():
      net(x)
  finally:
    torch.relu = relu
  return seen


def kink_clearance(inputs32, inputs64) -> float:
  """How far the ReLU inputs nearest 0 are from it, in fp32 errors.

  The least, over the ReLUs, of the smallest float64 ``|input|`` over the
  largest fp32 error (``|input32 - input64|``) of that ReLU's inputs: below
  1, some input sits closer to the kink than fp32 arithmetic moves inputs
  of its layer, so another summation order could flip its side.

  >>> a64 = np.float64([1.001, -2.0])  # fp32 is 0.001 off: 1.001 from 0.
  >>> round(kink_clearance([np.float32([1.0, -2.0])], [a64]))
  1001
  >>> b64 = np.float64([-1e-9, 3.01])  # On the other side of the kink.
  >>> kink_clearance([np.float32([1e-9, 3.0])], [b64]) < 1
  True
  """
  clearance = np.inf
  for a, b in zip(inputs32, inputs64):
    error = np.abs(np.asarray(a, np.float64) - b).max()
    clearance = min(
      clearance, np.abs(b).min() / max(error, np.finfo(float).tiny)
    )
  return float(clearance)


def pool_inputs(net, x) -> list[tuple[np.ndarray, int, int, int]]:
  """Each ``nn.MaxPool2d`` input of ``net``'s forward pass on ``x``, in float64.

  Returns ``(input, kernel_size, stride, padding)`` per pool, in call order.
  """
  seen = []

  def record(module, args, output):
    del output
    seen.append(
      (
        args[0].detach().double().numpy().copy(),
        module.kernel_size,
        module.stride,
        module.padding,
      )
    )

  hooks = [
    m.register_forward_hook(record)
    for m in net.modules()
    if isinstance(m, torch.nn.MaxPool2d)
  ]
  try:
    with torch.no_grad():
      net(x)
  finally:
    for hook in hooks:
      hook.remove()
  return seen


def pool_tie_clearance(pools32, pools64) -> float:
  """How far each max-pool window's winner is ahead, in fp32 errors.

  The least, over the pools (`pool_inputs`), of the smallest float64 gap
  between the largest and the second largest input of a window over the
  largest fp32 error of that pool's inputs (``inf`` without pools): below
  1, fp32 arithmetic in another order could swap the two, and the
  window's gradient would go to the other input. Windows whose largest
  input is <= 0 are skipped: after a ReLU they are all zeros, whose
  gradient the ReLU stops whichever wins.

  >>> x64 = np.float64([[[[1.0, 3.0], [2.9995, 0.0]]]])  # 3 leads by 5e-4.
  >>> x32 = (x64 + 1e-4).astype(np.float32)  # fp32 is 1e-4 off.
  >>> round(pool_tie_clearance([(x32, 2, 2, 0)], [(x64, 2, 2, 0)]), 1)
  5.0
  >>> zeros = np.zeros((1, 1, 2, 2))  # Ties at 0 are behind a ReLU.
  >>> pool_tie_clearance([(zeros, 2, 2, 0)], [(zeros, 2, 2, 0)])
  inf
  """
  clearance = np.inf
  for (a, _, _, _), (b, k, s, p) in zip(pools32, pools64):
    error = np.abs(np.asarray(a, np.float64) - b).max()
    padded = np.pad(
      b, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf
    )
    windows = np.lib.stride_tricks.sliding_window_view(
      padded, (k, k), axis=(2, 3)
    )[:, :, ::s, ::s]
    windows = windows.reshape(*windows.shape[:4], k * k)
    second, first = np.moveaxis(np.sort(windows, -1)[..., -2:], -1, 0)
    gaps = (first - second)[first > 0]
    if gaps.size:
      clearance = min(clearance, gaps.min() / max(error, np.finfo(float).tiny))
  return float(clearance)


def check_clear_of_kinks(case: str, make, weights, x, train: bool) -> float:
  """Both clearances of ``case``, torch's fp32 vs fp64; ValueError below 1.

  `kink_clearance` (the ReLUs) and `pool_tie_clearance` (the max-pools);
  returns the smaller. ``make()`` builds the torch net; ``weights`` are its
  float32 state dict.
  """
  relus, pools = [], []
  for dtype in (torch.float32, torch.float64):
    net = make()
    net.load_state_dict(
      {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
    )
    net.to(dtype)
    net.train(train)
    relus.append(relu_inputs(net, torch.from_numpy(x).to(dtype)))
    pools.append(pool_inputs(net, torch.from_numpy(x).to(dtype)))
  mode = "train" if train else "eval"
  relu, pool = kink_clearance(*relus), pool_tie_clearance(*pools)
  if relu < 1:
    raise ValueError(
      f"{case} ({mode} mode): a ReLU input is {relu:.2g} of its layer's "
      "largest fp32 error from 0; draw another seed"
    )
  if pool < 1:
    raise ValueError(
      f"{case} ({mode} mode): a max-pool window's two largest inputs are "
      f"{pool:.2g} of the pool's largest fp32 error apart; draw another seed"
    )
  return min(relu, pool)


def loss_and_grads(net, x, labels):
  """``net``'s logits on ``x``, their mean cross-entropy and its gradients.

  Returns ``(logits, loss, {parameter name: gradient})`` as numpy arrays, in
  the mode (train or eval) ``net`` is in.
  """
  net.zero_grad()
  logits = net(x)
  loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels))
  loss.backward()
  grads = {k: p.grad.numpy().copy() for k, p in net.named_parameters()}
  return logits.detach().numpy(), loss.detach().numpy(), grads


def calibrated_arrays() -> dict[str, np.ndarray]:
  """The ``calibrated/...`` arrays of the module docstring."""
  arch, size = "resnet18_torchvision", SIZE["resnet18_torchvision"]
  rng = np.random.default_rng(CALIBRATED_SEED)
  net, _ = make_net(arch, CLASSES, FILTERS)
  weights = random_weights(net, rng)
  calibration = rng.normal(size=(BATCH, 3, size, size))
  x = rng.normal(size=(BATCH, 3, size, size)).astype(np.float32)
  labels = np.arange(BATCH, dtype=np.int64) % CLASSES
  net.load_state_dict(
    {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
  )
  net.double()
  norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
  for m in norms:
    m.reset_running_stats()
    m.momentum = None  # Cumulative: the first batch's statistics, as they are.
  net.train()
  with torch.no_grad():
    net(torch.from_numpy(calibration))
  for m in norms:
    m.momentum = 0.1
  weights = {
    k: v.numpy().astype(np.float32 if v.is_floating_point() else np.int64)
    for k, v in net.state_dict().items()
  }
  for train in (False, True):
    check_clear_of_kinks(
      CALIBRATED,
      lambda: make_net(arch, CLASSES, FILTERS)[0],
      weights,
      x,
      train=train,
    )
  out = {f"{CALIBRATED}/x": x, f"{CALIBRATED}/labels": labels}
  out.update({f"{CALIBRATED}/weights/{k}": v for k, v in weights.items()})
  for dtype in ("float32", "float64"):
    tdtype = getattr(torch, dtype)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    net.to(tdtype)
    tx = torch.from_numpy(x).to(tdtype)
    prefix = f"{CALIBRATED}/{dtype}"
    # Eval mode first: the train-mode pass updates the running statistics.
    for mode, (logits_key, loss_key, grad_key) in (
      ("eval", ("eval_logits", "eval_loss", "eval_grad")),
      ("train", ("train_logits", "loss", "grad")),
    ):
      net.train(mode == "train")
      logits, loss, grads = loss_and_grads(net, tx, labels)
      out[f"{prefix}/{logits_key}"] = logits
      out[f"{prefix}/{loss_key}"] = loss
      out.update({f"{prefix}/{grad_key}/{k}": g for k, g in grads.items()})
  return out


def init_statistics() -> dict[str, np.ndarray]:
  """``init/<name>``: size, mean, std and max |value| of torch's init."""
  torch.manual_seed(0)
  net, _ = make_net("resnet18_torchvision", INIT_CLASSES, INIT_FILTERS)
  out = {}
  for k, v in net.state_dict().items():
    w = v.numpy().astype(np.float64)
    out[f"init/{k}"] = np.array(
      [w.size, w.mean(), w.std(), np.abs(w).max()], np.float64
    )
  return out


def write(out_dir: str) -> None:
  """Writes `NPZ` and `PTH` to ``out_dir``."""
  arrays = {}
  for arch in SIZE:
    arrays.update(parity_arrays(arch))
  arrays.update(calibrated_arrays())
  arrays.update(init_statistics())
  prefix = "resnet18_torchvision/weights/"
  weights = {
    k[len(prefix) :]: torch.from_numpy(np.asarray(v))
    for k, v in arrays.items()
    if k.startswith(prefix)
  }
  for k, v in weights.items():
    if v.is_floating_point():
      arrays[f"bfloat16/{k}"] = (
        v.bfloat16().view(torch.int16).numpy().view(np.uint16)
      )
  os.makedirs(out_dir, exist_ok=True)
  np.savez_compressed(os.path.join(out_dir, NPZ), **arrays)
  torch.save({"net": weights, "epoch": 3}, os.path.join(out_dir, PTH))


def main() -> None:
  """Writes the golden files (``--out``) and prints their sizes."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "tests", "golden"))
  args = parser.parse_args()
  torch.use_deterministic_algorithms(True)
  write(args.out)
  for name in (NPZ, PTH):
    path = os.path.join(args.out, name)
    print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
  main()
