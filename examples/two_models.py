"""Two models, two losses, two loss scales: a GAN-like alternating step."""

import jax
import jax.numpy as jnp
import optax

import jaxmp

half = lambda key, shape: jax.random.normal(key, shape).astype(jnp.float16)
gen = {"w": half(jax.random.key(0), (2, 3))}  # z -> fake sample
disc = {"w": half(jax.random.key(1), (3, 1))}  # sample -> logit
g_opt = jaxmp.mixed_precision(optax.adam(1e-2))
d_opt = jaxmp.mixed_precision(optax.sgd(0.1))
g_state, d_state = g_opt.init(gen), d_opt.init(disc)
logit = lambda d, x: (x @ d["w"]).astype(jnp.float32)


def step(opt, loss_fn, params, state):  # one model, its loss, its scale
  _, grads = jaxmp.value_and_grad(loss_fn)(params, state)
  # Without loss=: the poisoned loss below is inf, and its inf gradients
  # then count as an overflow that backs G's scale off.
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@jax.jit
def gan_step(gen, g_state, disc, d_state, z, real, g_poison):
  fake = z @ gen["w"]
  d_loss = lambda d: (
    jax.nn.softplus(-logit(d, real)).mean()
    + jax.nn.softplus(logit(d, fake)).mean()
  )
  disc, d_state = step(d_opt, d_loss, disc, d_state)
  g_loss = lambda g: jax.nn.softplus(-logit(disc, z @ g["w"])).mean() * g_poison
  gen, g_state = step(g_opt, g_loss, gen, g_state)
  return gen, g_state, disc, d_state


z, real = half(jax.random.key(2), (8, 2)), half(jax.random.key(3), (8, 3))
for poison in [1.0, 1.0, jnp.inf]:  # the last step overflows G's gradients
  gen, g_state, disc, d_state = gan_step(
    gen, g_state, disc, d_state, z, real, poison
  )
g, d = jax.device_get((jaxmp.stats(g_state), jaxmp.stats(d_state)))
print(f"G skipped {g['skipped_steps']}, scale {g['loss_scale']:g}")
print(f"D skipped {d['skipped_steps']}, scale {d['loss_scale']:g}")
