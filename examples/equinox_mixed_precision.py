"""Equinox: fp16 params, fp32 masters and loss scaling with eqx.filter."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxmp

model = eqx.nn.Linear(4, 1, key=jax.random.key(0))
model = jax.tree.map(
  lambda x: x.astype(jnp.float16) if eqx.is_inexact_array(x) else x, model
)
opt = jaxmp.mixed_precision(optax.adam(1e-2))
opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def train_step(model, opt_state, x, y):
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params):  # Differentiate the arrays only, as eqx.filter_grad.
    model = eqx.combine(params, static)
    return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)

  loss, grads = jaxmp.value_and_grad(loss_fn)(params, opt_state)
  updates, opt_state = opt.update(grads, opt_state, params, loss=loss)
  # The updates are fp32: optax.apply_updates casts back to fp16 (exactly
  # onto the fp32 masters); eqx.apply_updates would promote to fp32.
  model = eqx.combine(optax.apply_updates(params, updates), static)
  return model, opt_state, loss


x = jax.random.normal(jax.random.key(1), (32, 4)).astype(jnp.float16)
y = jnp.sum(x.astype(jnp.float32), axis=1)[:, None]
losses = []
for _ in range(20):
  model, opt_state, loss = train_step(model, opt_state, x, y)
  losses.append(float(loss))
stats = jax.device_get(jaxmp.stats(opt_state))
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, params {model.weight.dtype}")
print(
  f"loss scale: {stats['loss_scale']:g}, "
  f"skipped steps: {stats['skipped_steps']}"
)
