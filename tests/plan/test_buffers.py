"""plan.buffers and plan.oom on what XLA gives: the arrays a compiled program makes (the
whole float32 logits of optax's loss, none with the vocab-tiled loss), and XLA:TPU's
out-of-memory message for Llama31_70B on v5e-256 (a real one, trimmed) read into the
exit-4 paragraph. Pure: nothing is compiled for a TPU here."""
import jax
import jax.numpy as jnp
import optax

from spmdtask.layers import xent
from spmdtask.plan import buffers

T, D, V = 256, 64, 1000


def _arrays(loss):
  args = (jax.ShapeDtypeStruct((T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
          jax.ShapeDtypeStruct((T,), jnp.int32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
  return buffers.hlo_arrays(text, top=None)


def test_hlo_arrays_name_the_whole_logits_only_where_the_loss_makes_them():
  whole = _arrays(lambda x, w, l: jnp.sum(
      optax.softmax_cross_entropy_with_integer_labels(x @ w, l)))
  logits = [b for b in whole if b.shape == f"f32[{T},{V}]"]
  assert logits and all(b.bytes == T * V * 4 for b in logits)
  assert any("dot_general" in b.what for b in logits)
  assert whole == sorted(whole, key=lambda b: -b.bytes)
  tiled = _arrays(lambda x, w, l: jnp.sum(xent.tiled_cross_entropy(
      x[None], xent.head_tiles(w, 4), l[None], V)))
  assert not [b for b in tiled if b.dims[-1:] == (V,) and b.bytes >= T * V * 4]
  assert [b for b in tiled if b.dims[-2:] == (T, V // 4)]  # one tile's logits, and no more
