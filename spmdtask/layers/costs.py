"""Per-layer train costs of a decoder LM, measured from its own compiled code (what
`TransformerLm.layer_costs`, the `spmdtask.core.model.LayerCosts` protocol, returns)."""
import dataclasses

import jax
import jax.numpy as jnp

from spmdtask.layers.block import Block


def lm_layer_costs(model, batch_size: int, seq_len: int) -> list[float]:
  """Train-step FLOPs of [embedding, block x num_layers, head with the loss] of a TransformerLm.

  Compiled (`cost_analysis`) FLOPs of forward + backward on one batch of shape
  [batch_size, seq_len]: the embedding lookup's vjp; one `Block`'s vjp (grads of its weights
  and of its input); the head (final norm, unembedding, cross entropy) as the one-block
  model's loss-and-grad minus those two, so that it follows the model's own head code.
  Remat, vocab tiling (a loop that cost analysis counts once) and pipelining are turned
  off: they do not change what a layer costs to train.
  """
  num_layers = model.num_layers
  model = dataclasses.replace(model, num_layers=1, remat_policy=None, execution=None,
                              dropout_rate=0.0, loss_vocab_tiles=1)
  dt = jnp.dtype(model.fprop_dtype)
  tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
  x = jax.ShapeDtypeStruct((batch_size, seq_len, model.d_model), dt)
  positions = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)

  def flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))

  def vjp(fn, *args, cotangent):
    out, pullback = jax.vjp(fn, *args)
    return out, pullback(cotangent)

  emb = jax.ShapeDtypeStruct((model.vocab_size, model.d_model), jnp.float32)
  embed = flops(lambda e, t, ct: vjp(lambda e: jnp.take(e, t, axis=0).astype(dt), e,
                                     cotangent=ct), emb, tokens, x)
  block = Block(**model.block_kwargs())
  block_params = jax.eval_shape(block.init, jax.random.key(0), x, positions)["params"]
  layer = flops(lambda p, h, pos: vjp(lambda p, h: block.apply({"params": p}, h, pos)[0], p, h,
                                      cotangent=h), block_params, x, positions)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  batch = {"inputs": tokens, "targets": tokens,
           "weights": jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)}
  whole = flops(jax.value_and_grad(
      lambda p, b: model.apply({"params": p}, b, method=model.loss)[0]), params, batch)
  return [embed] + [layer] * num_layers + [whole - embed - layer]
