"""The per-leaf reports a state holds: overflow and rounding, side by side.

* `overflow_report`: the last step's gradient statistics per leaf
  (``diagnostics=True``), rows of `scaling.diagnostics`;
* `rounding_report`: what each leaf's half dtype loses of its update
  (``rounding_every=N``), rows of `rounding_report`.

Both read the state on the host: a few small arrays, one entry per leaf.
"""

from typing import Any

from jaxmp._src.inspect import rounding_report as rounding_lib
from jaxmp._src.inspect.accessors import find_state
from jaxmp._src.inspect.accessors import to_host
from jaxmp._src.scaling import diagnostics as diag


def overflow_report(opt_state: Any) -> diag.OverflowReport:
  """Returns the last step's per-leaf gradient report, worst leaf first.

  Needs ``jaxmp.mixed_precision(..., diagnostics=True)``. Host-side: it
  fetches three small arrays (one entry per gradient leaf), so call it on
  log steps or after a skipped step.

  Args:
    opt_state: the optax state holding a `mixed_precision` state (also
      inside ``optax.chain``, `jaxmp.multi_steps`, ``inject_hyperparams`` or
      returned from ``shard_map``).

  Returns:
    A list of rows, one per gradient leaf, sorted by ``nonfinite`` then
    ``max_abs`` (both descending). Each row has ``path``
    (``jax.tree_util.keystr`` form), ``nonfinite`` (int), ``max_abs``
    (float, the largest finite ``|unscaled gradient|``) and
    ``zero_fraction`` (float, zero-or-subnormal share of a half-precision
    gradient; ``None`` for fp32 gradients), as attributes and as keys. Its
    ``str`` is a short table that names the first offending leaf; its
    ``offending`` property lists the rows with non-finite elements.

  Raises:
    ValueError: when the optimizer was built without ``diagnostics=True``.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> opt = jaxmp.mixed_precision(optax.sgd(0.1), diagnostics=True)
  >>> params = {"a": jnp.zeros(2, jnp.float16), "b": jnp.zeros(3)}
  >>> state = opt.init(params)
  >>> grads = {"a": jnp.ones(2, jnp.float16), "b": jnp.array([1, jnp.nan, 2])}
  >>> _, state = opt.update(grads, state, params)
  >>> rows = jaxmp.overflow_report(state)
  >>> rows[0].path, rows[0]["nonfinite"], rows[1].path
  ("['b']", 1, "['a']")
  """
  state = find_state(opt_state)
  if state.diagnostics is None:
    raise ValueError(
      "no gradient diagnostics in this state: build the optimizer with "
      "jaxmp.mixed_precision(..., diagnostics=True)"
    )
  d = state.diagnostics
  nonfinite, max_abs, zero = (
    to_host(d.nonfinite),
    to_host(d.max_abs),
    to_host(d.zero_fraction),
  )
  loss_finite = None
  if state.consecutive_nonfinite_loss is not None:
    loss_finite = not int(to_host(state.consecutive_nonfinite_loss))
  host = diag.GradDiagnostics(nonfinite, max_abs, zero, d.paths)
  return diag.report(host, loss_finite=loss_finite)


def rounding_report(opt_state: Any) -> rounding_lib.RoundingReport:
  """Returns what rounding cost each param leaf at the last measured step.

  Needs ``jaxmp.mixed_precision(..., rounding_every=N)``: every N-th
  applied step the jitted update measures, per leaf, what the param's half
  dtype alone makes of its fp32 update ``u`` (an fp32 param: bfloat16).
  Host-side: it fetches three small arrays (one entry per param leaf).

  Args:
    opt_state: the optax state holding a `mixed_precision` state (also
      inside ``optax.chain``, `jaxmp.multi_steps` or ``shard_map``'s output).

  Returns:
    A list of rows, worst first (the largest of ``stalled``, ``flushed``
    and ``|1 - quality|``), each with, as attributes and keys: ``path``;
    ``stalled``, the share of updated elements with ``cast(h + u) == h``;
    ``quality``, ``<cast(h + u) - h, u> / <u, u>``; ``flushed``, the share
    of nonzero fp32 masters the half dtype holds as zero or subnormal;
    ``step``, the applied step measured (1 for the first, 0 for none yet);
    ``advice``; ``master_weights``, the mode the advice names. Its ``str``
    is a table; ``master_weights()`` gives the per-leaf choice for
    ``mixed_precision(master_weights=...)``.

  Raises:
    ValueError: when the optimizer was built without ``rounding_every``.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> opt = jaxmp.mixed_precision(optax.adam(1e-4), rounding_every=1)
  >>> params = {"scale": jnp.ones(4, jnp.bfloat16)}
  >>> state = opt.init(params)
  >>> grads = {"scale": jnp.ones(4, jnp.bfloat16)}
  >>> _, state = opt.update(grads, state, params)
  >>> row = jaxmp.rounding_report(state)[0]
  >>> row.path, row.stalled, row.master_weights
  ("['scale']", 1.0, 'remainder')
  """
  state = find_state(opt_state)
  figures = getattr(state, "rounding", None)
  if figures is None:
    raise ValueError(
      "no rounding figures in this state: build the optimizer with "
      "jaxmp.mixed_precision(..., rounding_every=N) (N > 0: every N-th "
      "applied step is measured)"
    )
  return rounding_lib.report(figures, host=to_host)
