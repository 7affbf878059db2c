"""PyTorch state dicts in and out of the ResNet18s of `jaxmp.models`.

Two namings of the same network:

* ``"resnet18_torchvision"``: ``torchvision.models.resnet18`` (``conv1``,
  ``bn1``, ``layer1.0.conv1``, ``layer2.0.downsample.0``/``.1``, ``fc``).
* ``"resnet18"``: the CIFAR-stem ResNet18 of kuangliu/pytorch-cifar
  (``conv1``, ``bn1``, ``layer1.0.conv1``, ``layer2.0.shortcut.0``/``.1``,
  ``linear``).

Conv weights go from torch's ``OIHW`` to flax's ``HWIO`` and back, the linear
weight is transposed, BatchNorm ``weight``/``bias`` are ``scale``/``bias`` in
``params`` and ``running_mean``/``running_var`` are ``mean``/``var`` in
``batch_stats``. The ``num_batches_tracked`` counters go into a third
collection, ``"num_batches_tracked"`` (same module paths, int64 scalars),
which ``apply`` ignores and training does not advance; `to_torchvision` writes
them back. numpy only: torch tensors are read through
``.detach().cpu().numpy()`` without importing torch.
"""

import os
import re
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.nn import resnet

COUNTERS = "num_batches_tracked"
ARCHS = ("resnet18_torchvision", "resnet18")
# Per arch: the name of the projection shortcut and of the classifier.
_NAMES = {
  "resnet18_torchvision": ("downsample", "fc"),
  "resnet18": ("shortcut", "linear"),
}
_LEAVES = {
  ("params", "kernel"): "weight",
  ("params", "scale"): "weight",
  ("params", "bias"): "bias",
  ("batch_stats", "mean"): "running_mean",
  ("batch_stats", "var"): "running_var",
}


def _to_numpy(value: Any) -> np.ndarray:
  """A numpy array of a torch tensor (duck-typed), jax array or array-like."""
  if hasattr(value, "detach") and hasattr(value, "cpu"):
    value = value.detach().cpu()
    if str(getattr(value, "dtype", "")) == "torch.bfloat16":
      return value.float().numpy().astype(jnp.bfloat16)
    return value.numpy().copy()  # Not a view of the tensor's memory.
  return np.array(value)


def _torch_module(module_path: tuple[str, ...], arch: str) -> str:
  """The torch module name of the flax module at ``module_path``."""
  shortcut, classifier = _NAMES[arch]
  out = []
  for name in module_path:
    block = re.fullmatch(r"layer(\d+)_(\d+)", name)
    if block:
      out += [f"layer{block[1]}", block[2]]
    elif name == "downsample_conv":
      out += [shortcut, "0"]
    elif name == "downsample_bn":
      out += [shortcut, "1"]
    elif name == "fc":
      out.append(classifier)
    else:
      out.append(name)
  return ".".join(out)


def _torch_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The torch shape of a flax kernel (HWIO -> OIHW, (in, out) -> (out, in))."""
  if len(shape) == 4:
    return (shape[3], shape[2], shape[0], shape[1])
  if len(shape) == 2:
    return (shape[1], shape[0])
  return tuple(shape)


def _from_torch_layout(x: np.ndarray, kernel: bool) -> np.ndarray:
  if kernel and x.ndim == 4:
    return np.ascontiguousarray(x.transpose(2, 3, 1, 0))
  if kernel and x.ndim == 2:
    return np.ascontiguousarray(x.T)
  return x


def _to_torch_layout(x: np.ndarray, kernel: bool) -> np.ndarray:
  if kernel and x.ndim == 4:
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1))
  if kernel and x.ndim == 2:
    return np.ascontiguousarray(x.T)
  return x


def _layout(shapes: Mapping[str, Any], arch: str):
  """``{torch name: (collection, flax path, torch shape, flax leaf name)}``."""
  out = {}
  for collection in ("params", "batch_stats"):
    flat = jax.tree_util.tree_flatten_with_path(shapes[collection])[0]
    for path, leaf in flat:
      keys = tuple(k.key for k in path)
      module, leaf_name = keys[:-1], keys[-1]
      prefix = _torch_module(module, arch)
      name = f"{prefix}.{_LEAVES[(collection, leaf_name)]}"
      out[name] = (collection, keys, _torch_shape(leaf.shape), leaf_name)
      if collection == "batch_stats" and leaf_name == "mean":
        out[f"{prefix}.{COUNTERS}"] = (COUNTERS, module, (), None)
  return out


def _check_arch(arch: str) -> str:
  if arch not in ARCHS:
    raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
  return arch


def _model_shapes(arch: str, num_classes: int, num_filters: int):
  model = resnet.get_model(
    arch, num_classes=num_classes, num_filters=num_filters
  )
  return jax.eval_shape(
    lambda: model.init(
      jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False
    )
  )


def _set(tree: dict, keys: tuple[str, ...], value: Any) -> None:
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def _get(tree: Mapping, keys: tuple[str, ...]) -> Any:
  for k in keys:
    tree = tree[k]
  return tree


def from_torchvision(
  state_dict: Mapping[str, Any],
  *,
  num_classes: Optional[int] = None,
  num_filters: Optional[int] = None,
  arch: Optional[str] = None,
) -> dict[str, Any]:
  """Flax variables of a torch ResNet18 state dict.

  Every tensor is placed from its torch layout into flax's (``OIHW`` ->
  ``HWIO``, the linear weight transposed) and checked, name and shape,
  against the variables of ``jaxmp.models.get_model(arch, num_classes=...,
  num_filters=...)``. ``num_batches_tracked`` counters are optional (torch
  accepts state dicts without them; a missing one is 0) and kept in the
  ``"num_batches_tracked"`` collection for `to_torchvision`; ``apply``
  ignores it. A ``module.`` prefix on every name (``nn.DataParallel``) is
  dropped.

  Args:
    state_dict: torch names to arrays: torch tensors, numpy arrays or
      anything ``np.asarray`` takes (values keep their dtype and are
    copied).
    num_classes: Classes of the model; by default ``fc.weight``'s rows
      (``linear.weight``'s for ``arch="resnet18"``).
    num_filters: Channels of the first stage; by default ``conv1.weight``'s
      output channels.
    arch: ``"resnet18_torchvision"`` (torchvision's names and ImageNet stem)
      or ``"resnet18"`` (kuangliu/pytorch-cifar's names, CIFAR stem). By
      default ``"resnet18"`` when the names have ``linear`` or ``shortcut``,
      else ``"resnet18_torchvision"``.

  Returns:
    ``{"params", "batch_stats", "num_batches_tracked"}`` of numpy arrays, for
    ``jaxmp.models.get_model(arch, num_classes=..., num_filters=...).apply``.
    For a torch-faithful CIFAR ``resnet18``, build it with
    ``unbiased_running_var=True`` (``resnet18_torchvision``'s default).

  Raises:
    ValueError: One error naming every unknown, missing and mis-shaped tensor.
  """
  tensors = {str(k): v for k, v in state_dict.items()}
  if tensors and all(k.startswith("module.") for k in tensors):
    tensors = {k[len("module.") :]: v for k, v in tensors.items()}
  if arch is None:
    kuangliu = any(
      k.startswith("linear.") or ".shortcut." in k for k in tensors
    )
    arch = "resnet18" if kuangliu else "resnet18_torchvision"
  _check_arch(arch)
  classifier = _NAMES[arch][1]
  if num_classes is None:
    fc = tensors.get(f"{classifier}.weight")
    num_classes = int(np.shape(fc)[0]) if fc is not None else 1000
  if num_filters is None:
    stem = tensors.get("conv1.weight")
    num_filters = int(np.shape(stem)[0]) if stem is not None else 64
  layout = _layout(_model_shapes(arch, num_classes, num_filters), arch)

  unknown = sorted(set(tensors) - set(layout))
  missing = sorted(
    n for n, spec in layout.items() if n not in tensors and spec[0] != COUNTERS
  )
  misshaped = []
  variables = {"params": {}, "batch_stats": {}, COUNTERS: {}}
  for name, (collection, keys, shape, leaf_name) in layout.items():
    if name not in tensors:
      if collection == COUNTERS:
        _set(variables[COUNTERS], keys, np.zeros((), np.int64))
      continue
    value = _to_numpy(tensors[name])
    if value.shape != shape:
      misshaped.append(f"{name} {tuple(value.shape)} (expected {shape})")
      continue
    if collection != COUNTERS:
      value = _from_torch_layout(value, leaf_name == "kernel")
    _set(variables[collection], keys, value)
  problems = [
    f"{what}: {', '.join(names)}"
    for what, names in (
      ("unknown", unknown),
      ("missing", missing),
      ("mis-shaped", misshaped),
    )
    if names
  ]
  if problems:
    raise ValueError(
      f"state dict does not fit {arch}(num_classes={num_classes}, "
      f"num_filters={num_filters}): " + "; ".join(problems)
    )
  return variables


def to_torchvision(
  variables: Mapping[str, Any], *, arch: Optional[str] = None
) -> dict[str, np.ndarray]:
  """The torch-named numpy state dict of a ResNet18's flax variables.

  The inverse of `from_torchvision`: the round trip torch -> jaxmp -> torch
  gives back every tensor bit for bit, ``num_batches_tracked`` included
  (int64 zeros where ``variables`` has no ``"num_batches_tracked"``
  collection, e.g. straight from ``init``). Values keep their dtype.

  Args:
    variables: ``{"params", "batch_stats"}`` (and optionally
      ``"num_batches_tracked"``) of ``resnet18_torchvision`` or ``resnet18``.
    arch: The naming, as in `from_torchvision`; by default
      ``"resnet18_torchvision"`` for a 7x7 stem conv, else ``"resnet18"``.

  Returns:
    ``{torch name: numpy array}`` for ``torch.nn.Module.load_state_dict``
    (convert with ``torch.from_numpy``).

  Raises:
    ValueError: If ``variables`` is not one of these ResNet18s.
  """
  params = variables["params"]
  if arch is None:
    stem = np.shape(params["conv1"]["kernel"])
    arch = "resnet18_torchvision" if stem[:2] == (7, 7) else "resnet18"
  _check_arch(arch)
  num_filters = int(np.shape(params["conv1"]["kernel"])[-1])
  num_classes = int(np.shape(params["fc"]["kernel"])[-1])
  layout = _layout(_model_shapes(arch, num_classes, num_filters), arch)
  counters = variables.get(COUNTERS, {})
  out = {}
  for name, (collection, keys, shape, leaf_name) in layout.items():
    if collection == COUNTERS:
      try:
        value = np.asarray(_get(counters, keys), np.int64)
      except (KeyError, TypeError):
        value = np.zeros((), np.int64)
      out[name] = value
      continue
    try:
      value = np.asarray(_get(variables[collection], keys))
    except (KeyError, TypeError):
      raise ValueError(
        f"variables lack {collection}/{'/'.join(keys)} of {arch}"
      ) from None
    value = _to_torch_layout(value, leaf_name == "kernel")
    if value.shape != shape:
      raise ValueError(
        f"{collection}/{'/'.join(keys)} has torch shape {value.shape}, "
        f"{arch} expects {shape}"
      )
    out[name] = value
  return out


def read_state_dict(path: str) -> dict[str, np.ndarray]:
  """Reads a torch state dict file into ``{name: numpy array}``.

  * ``.safetensors``: through ``safetensors.numpy`` (no torch needed;
    ``pip install safetensors``).
  * ``.npz``: ``np.savez(path, **state_dict)``.
  * ``.pth``/``.pt``: ``torch.load(path, map_location="cpu",
    weights_only=True)``; needs torch. A checkpoint dict holding the state
    dict under ``"state_dict"``, ``"model"`` or ``"net"`` (kuangliu's) is
    unwrapped.

  Args:
    path: The file.

  Returns:
    The tensors by name, as numpy arrays (for `from_torchvision`).

  Raises:
    ImportError: The reader of the format is not installed (for ``.pth``
      without torch, the message says how to convert the file).
    ValueError: Unknown extension, or a ``.pth`` that holds no state dict.
  """
  ext = os.path.splitext(path)[1].lower()
  if ext == ".safetensors":
    try:
      from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError(
        f"reading {path} needs safetensors: pip install safetensors"
      ) from None
    return dict(st_numpy.load_file(path))
  if ext == ".npz":
    with np.load(path, allow_pickle=False) as f:
      return {k: f[k] for k in f.files}
  if ext in (".pth", ".pt"):
    try:
      import torch  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError(
        f"reading {path} needs torch (pip install torch); or convert it "
        'once where torch is installed: python -c "import numpy as np, '
        f"torch; sd = torch.load('{path}', map_location='cpu'); "
        "np.savez('weights.npz', **{k: v.numpy() for k, v in sd.items()})\""
      ) from None
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded, Mapping) and not all(
      hasattr(v, "detach") for v in loaded.values()
    ):
      for key in ("state_dict", "model", "net"):
        if isinstance(loaded.get(key), Mapping):
          loaded = loaded[key]
          break
      else:
        raise ValueError(
          f"{path} holds no state dict (keys: {', '.join(map(str, loaded))})"
        )
    return {str(k): _to_numpy(v) for k, v in loaded.items()}
  raise ValueError(
    f"unknown state dict format {ext!r} of {path}; "
    "valid: .safetensors, .npz, .pth, .pt"
  )
