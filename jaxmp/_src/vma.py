"""Which manual axes a value varies over, inside ``shard_map``.

A custom gradient rule under ``shard_map`` (with its default checks) must
return each cotangent typed as its primal: one computed from device-varying
activations for a replicated parameter is summed over those axes, as JAX's
own transpose of the implicit ``pvary`` does. Root module: imports nothing
of jaxmp.
"""

import jax


def varying(x) -> frozenset:
  """Mesh axes along which ``x`` varies (empty outside ``shard_map``)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)  # Older jax.
  if vma is None:  # jax >= 0.10: ``ManualAxisType(varying=...)``.
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(vma or ())


def match(ct: jax.Array, want: frozenset) -> jax.Array:
  """Makes cotangent ``ct`` vary along exactly the axes in ``want``.

  A cotangent computed from device-varying activations varies along their
  axes; for a replicated primal (e.g. a parameter under ``shard_map``) it is
  ``psum``-ed over those axes, as JAX's own transpose of the implicit
  ``pvary`` does.
  """
  have = varying(ct)
  extra = tuple(sorted(have - want))
  if extra:
    ct = jax.lax.psum(ct, extra)
  missing = tuple(sorted(want - have))
  return mark_varying(ct, missing) if missing else ct


def mark_varying(x: jax.Array, axes) -> jax.Array:
  """``x`` typed as varying over ``axes`` (``pcast``; ``pvary`` before)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)  # pragma: no cover - older jax.
