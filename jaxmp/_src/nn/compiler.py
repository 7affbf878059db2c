"""XLA:CPU compile options that make convolutions run at matmul speed.

jaxlib 0.10 hands every convolution on CPU to YNNPACK by default
(``xla_cpu_experimental_ynn_fusion_type`` includes
``LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION``). On 2 cores of an AMD EPYC
with AVX-512 that path is about 2x slower than XLA's own (Eigen) convolution
for every convolution of the CIFAR ResNet18 at batch 128: the first stage's
3x3 forward takes 160-175 ms with it and 73-87 ms without, PyTorch 91-99 ms;
its input gradient 164-172 against 78-87 ms, and XLA's kernel gradient
288-350 against 115-150 ms (``bench/cpu_ops.py``). YNNPACK's matrix
products and reductions stay: without them a plain matmul is 1.3x slower and
BatchNorm's statistics 1.4x. `cpu_compiler_options` returns the option that
keeps those two and drops the convolutions; pass it to ``jax.jit``::

  step = jax.jit(train_step, compiler_options=jaxmp.cpu_compiler_options())

The option is per compilation, so it changes nothing else in the process and
the persistent compilation cache keys on it. It is an experimental XLA
option: a jaxlib that does not know it gets ``{}`` (checked once, by
compiling a scalar add), and GPU and TPU always get ``{}``.
"""

import functools
from typing import Optional

import jax
import numpy as np

_YNN_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
# YNNPACK for dots and reductions, XLA's own convolutions.
_CPU_OPTIONS = (
  (
    _YNN_FUSIONS,
    "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE",
  ),
)


def cpu_compiler_options(backend: Optional[str] = None) -> dict[str, str]:
  """XLA compile options for ``jax.jit(..., compiler_options=...)`` on CPU.

  Args:
    backend: The platform the function will run on; ``None`` for
      ``jax.default_backend()``.

  Returns:
    ``{"xla_cpu_experimental_ynn_fusion_type": ...}`` on CPU when this
    jaxlib accepts the option, else ``{}`` (GPU, TPU, or a jaxlib without
    it). A new dict each call.
  """
  if backend is None:
    backend = jax.default_backend()
  if backend != "cpu":
    return {}
  return dict(_accepted_cpu_options())


@functools.cache
def _accepted_cpu_options() -> tuple[tuple[str, str], ...]:
  """The options if this jaxlib's CPU compiler takes them, else ()."""
  x = jax.device_put(np.float32(0), jax.devices("cpu")[0])
  try:
    jax.jit(lambda x: x + 1, compiler_options=dict(_CPU_OPTIONS)).lower(
      x
    ).compile()
  except jax.errors.JaxRuntimeError:
    return ()
  return _CPU_OPTIONS
