"""A state saved by an earlier jaxmp restores into today's state pytrees.

``tests/golden/state_checkpoint.npz`` holds ``mixed_precision`` states (the
master-weight modes, the int8 codec, diagnostics, spike windows, rounding
figures, ``multi_steps`` around them) written by the tree of 2026-12-07
before the library's folders were recut (``tools/make_state_golden.py``,
whose cases this file builds again). A checkpoint is its leaves by path:
each case's state built today must have the saved paths, tree structure,
shapes and dtypes; its leaves after ``init`` must equal the saved ones; and
the saved ``init`` leaves, restored into today's structure, must take one
``update`` to the saved state after it, bit for bit: an exactness claim,
run under XLA's default flags (the file was written under them; the
fast-compile flags' older emitters round one Adam step's fused expression
differently).
"""

import importlib.util
import os
import warnings

import jax
import numpy as np
import pytest

import jaxmp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "state_checkpoint.npz")


def _tool():
  spec = importlib.util.spec_from_file_location(
    "make_state_golden", os.path.join(ROOT, "tools", "make_state_golden.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


TOOL = _tool()


def _saved(case: str, stage: str) -> tuple[dict, str]:
  """``({path: leaf}, treedef text)`` of one saved state."""
  with np.load(GOLDEN) as f:
    prefix = f"{case}|{stage}|"
    leaves = {k[len(prefix) :]: f[k] for k in f.files if k.startswith(prefix)}
  treedef, dtypes = leaves.pop("__treedef__"), leaves.pop("__dtypes__")
  leaves = {
    path: TOOL.from_file(bits, str(dtype))
    for (path, bits), dtype in zip(leaves.items(), dtypes)
  }
  return leaves, str(treedef)


def _assert_same(leaves: dict, saved: dict, what: str) -> None:
  assert list(leaves) == list(saved), what
  for path, leaf in leaves.items():
    want = saved[path]
    assert (leaf.shape, leaf.dtype) == (want.shape, want.dtype), (what, path)
    np.testing.assert_array_equal(leaf, want, err_msg=f"{what} {path}")


@pytest.mark.invariant
@pytest.mark.parametrize("case", list(TOOL.cases()))
def test_a_saved_state_restores_into_todays_pytree(case):
  opt = TOOL.cases()[case]
  params = TOOL.params()
  state = jax.jit(opt.init)(params)
  leaves, treedef = TOOL.flat(state)
  saved, saved_treedef = _saved(case, "init")
  assert treedef == saved_treedef
  _assert_same(leaves, saved, f"{case} init")
  # Restore: the saved leaves, in their saved order, into today's structure.
  restored = jax.tree.unflatten(
    jax.tree.structure(state), [saved[p] for p in leaves]
  )
  if case not in TOOL.STEPPED:
    return
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxmp.UnscaledGradientsWarning)
    _, after = jax.jit(opt.update)(TOOL.grads(params), restored, params)
  leaves, treedef = TOOL.flat(after)
  saved, saved_treedef = _saved(case, "step")
  assert treedef == saved_treedef
  _assert_same(leaves, saved, f"{case} step")
