"""layers/attention/mha.py: QK-norm (Qwen3) against a float64 numpy transcription of attention
with q and k RMS-normalized per head before the rotary positions."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spmdtask.layers.attention.mha import Attention

D, H, KV, HD, T, EPS, THETA = 32, 4, 2, 16, 8, 1e-6, 10000.0


def _rms(x, scale):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale


def _rope(x, pos):
  half = HD // 2
  angle = pos[:, :, None, None] * (1.0 / THETA ** (np.arange(0, HD, 2) / HD))
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                         x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


def _reference(p, x, pos):
  """Plain grouped-query causal attention, float64, q/k normalized over head_dim."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  q = _rope(_rms(np.einsum("btd,dhk->bthk", x, p["q"]), p["q_norm"]), pos)
  k = _rope(_rms(np.einsum("btd,dhk->bthk", x, p["k"]), p["k_norm"]), pos)
  v = np.einsum("btd,dhk->bthk", x, p["v"])
  k, v = np.repeat(k, H // KV, axis=2), np.repeat(v, H // KV, axis=2)
  s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(HD)
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("bhts,bshk,hkd->btd", w, v, p["o"])


def test_qk_norm_matches_a_plain_reference():
  attn = Attention(D, H, KV, HD, THETA, jnp.float32, (None,) * 3, (None,) * 3, (None,) * 3,
                   None, qk_norm=True)
  x = np.random.default_rng(0).normal(size=(2, T, D)).astype(np.float32)
  pos = np.broadcast_to(np.arange(T), (2, T)) + np.array([[0], [5]])  # rows at other offsets
  params = nn.unbox(jax.eval_shape(attn.init, jax.random.key(0), x, pos)["params"])
  assert params["q_norm"]["scale"].shape == params["k_norm"]["scale"].shape == (HD,)
  # Random norm scales (init is ones), so a swapped or missing scale shows.
  keys = iter(jax.random.split(jax.random.key(1), 8))
  params = jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape) * 0.3 + 1.0, params)
  out, _ = jax.jit(attn.apply)({"params": params}, x, pos)
  flat = {k: v["scale"] if isinstance(v, dict) else v for k, v in params.items()}
  want = _reference(flat, x.astype(np.float64), pos.astype(np.float64))
  # float32 through 3 matmuls of width <= 32 and a softmax: errors ~ eps32 · |out| · sqrt(32)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  plain = Attention(D, H, KV, HD, THETA, jnp.float32, (None,) * 3, (None,) * 3, (None,) * 3,
                    None)
  base = {k: v for k, v in params.items() if not k.endswith("_norm")}
  assert float(jnp.abs(jax.jit(plain.apply)({"params": base}, x, pos)[0] - out).max()) > 1e-2
