"""What the default backend's devices can run natively.

Root module: imports nothing of jaxmp.
"""

import jax


def gpu_capability_at_least(major_minor: float) -> bool:
  """Whether the default backend is an NVIDIA GPU of this compute capability.

  Args:
    major_minor: the least compute capability, e.g. ``9.0`` (Hopper's fp8
      GEMMs) or ``10.0`` (Blackwell's block-scaled GEMMs).

  Returns:
    False on CPUs, TPUs and ROCm GPUs (whose capability is a gfx name).
  """
  if jax.default_backend() not in ("gpu", "cuda"):
    return False
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return cc is not None and float(cc) >= major_minor
  except ValueError:  # pragma: no cover - a ROCm gfx name.
    return False
