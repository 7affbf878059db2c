"""Flax NNX: fp16 params, fp32 masters and loss scaling via nnx.Optimizer."""

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import jaxmp


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 16, param_dtype=jnp.float16, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, param_dtype=jnp.float16, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


model = MLP(nnx.Rngs(0))
opt = nnx.Optimizer(
  model, jaxmp.mixed_precision(optax.adam(1e-2)), wrt=nnx.Param
)


def loss_fn(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)  # fp32 loss


@nnx.jit
def train_step(model, opt, x, y):
  # The loss unscaled, the gradients of loss * scale (an nnx.State of Params).
  loss, grads = jaxmp.value_and_grad(loss_fn)(model, opt.opt_state, x, y)
  opt.update(model, grads, loss=loss)  # unscales, skips on inf/nan, steps
  return loss


x = jax.random.normal(jax.random.key(1), (32, 4)).astype(jnp.float16)
y = jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)
losses = [float(train_step(model, opt, x, y)) for _ in range(20)]
stats = nnx.as_pure(jaxmp.stats(opt.opt_state))  # unwrap the nnx Variables
print(
  f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, params {model.l1.kernel.dtype}"
)
print(
  f"loss scale: {float(stats['loss_scale']):g}, "
  f"skipped steps: {int(stats['skipped_steps'])}"
)
