"""Writes ``tests/golden/state_checkpoint.npz``: jaxmp states as saved.

Each case is a ``jaxmp.mixed_precision`` state (or one inside
``jaxmp.multi_steps``) of one small params tree, after ``init`` and after
one ``update``: its leaves keyed ``CASE|STAGE|PATH`` (``PATH`` the leaf's
``jax.tree_util.keystr``), and its tree structure as text under
``CASE|STAGE|__treedef__`` and the leaves' dtypes under
``CASE|STAGE|__dtypes__`` (``.npz`` keeps bfloat16 as its bits). ``tests/test_state_checkpoint.py`` builds the
same states with the tree under test and checks that the saved leaves
restore into them: the same paths, structure, shapes, dtypes and values.

Run from the repository root: ``python tools/make_state_golden.py``. It
uses public names only, so the file can be written by any version of jaxmp.
The cases' steps run elementwise arithmetic and maxima only (no sums), so
their values are the same on any x86-64 CPU.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "golden")


def params():
  """The params: a bfloat16 kernel, a float16 head, a float32 bias."""
  k = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 128.0 - 0.5
  return {
    "dense": {"kernel": jnp.asarray(k, jnp.bfloat16)},
    "head": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).astype(jnp.float16),
    "bias": jnp.linspace(-0.5, 0.5, 5, dtype=jnp.float32),
  }


def grads(p):
  """Gradients of the loss scaled by the first scale (2**15): finite."""
  return jax.tree.map(lambda x: (x * 2.0**13).astype(x.dtype), p)


def cases():
  """``{name: optimizer}``: the master modes, the codec, the extra fields."""
  sgd = optax.sgd(0.1, momentum=0.9)
  per_leaf = {"dense": {"kernel": "remainder"}, "head": "kahan", "bias": "fp32"}
  return {
    "fp32": jaxmp.mixed_precision(sgd),
    "kahan": jaxmp.mixed_precision(sgd, master_weights="kahan"),
    "stochastic": jaxmp.mixed_precision(
      sgd, master_weights="stochastic", rounding_key=3
    ),
    "per_leaf_int8": jaxmp.mixed_precision(
      optax.adam(1e-3),
      master_weights=per_leaf,
      optimizer_state=jaxmp.StateQuantization("int8", 32, min_size=64),
      diagnostics=True,
    ),
    "rounding_spikes": jaxmp.mixed_precision(
      sgd,
      rounding_every=1,
      skip_spikes=jaxmp.SpikeSkip(window=4),
      diagnostics=True,
    ),
    "multi_steps": jaxmp.multi_steps(jaxmp.mixed_precision(sgd), 2),
  }


def states(opt, p):
  """``{"init": state, "step": state after one update}`` (no sums in it)."""
  state = jax.jit(opt.init)(p)
  with warnings.catch_warnings():
    # The gradients are scaled by hand.
    warnings.simplefilter("ignore", jaxmp.UnscaledGradientsWarning)
    _, after = jax.jit(opt.update)(grads(p), state, p)
  return {"init": state, "step": after}


STEPPED = ("fp32", "kahan", "stochastic", "per_leaf_int8", "multi_steps")


def flat(tree):
  """``{keystr: leaf}`` and the structure's text."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}, str(
    treedef
  )


def to_file(leaf: np.ndarray) -> np.ndarray:
  """A leaf as ``.npz`` keeps it: bfloat16 and float8 as their bits."""
  if leaf.dtype.kind == "V" or leaf.dtype.type.__module__ == "ml_dtypes":
    return leaf.view(f"uint{8 * leaf.dtype.itemsize}")
  return leaf


def from_file(bits: np.ndarray, dtype: str) -> np.ndarray:
  """The leaf `to_file` wrote, of dtype ``dtype``."""
  return bits.view(jnp.dtype(dtype))


def main():
  """Writes the file."""
  p = params()
  arrays = {}
  for name, opt in cases().items():
    stages = states(opt, p)
    for stage, state in stages.items():
      if stage == "step" and name not in STEPPED:
        continue
      leaves, treedef = flat(state)
      arrays[f"{name}|{stage}|__treedef__"] = np.asarray(treedef)
      arrays[f"{name}|{stage}|__dtypes__"] = np.asarray(
        [str(x.dtype) for x in leaves.values()]
      )
      for path, leaf in leaves.items():
        arrays[f"{name}|{stage}|{path}"] = to_file(leaf)
  path = os.path.join(OUT, "state_checkpoint.npz")
  np.savez_compressed(path, **arrays)
  print(path, len(arrays), "arrays", os.path.getsize(path), "bytes")


if __name__ == "__main__":
  main()
