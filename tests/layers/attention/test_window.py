"""Sliding-window attention: the xla kernel's window equals a brute-force mask, with a static
and a traced (per-layer) window; splash's local mask (interpret mode) equals it, forward and
gradients, and under the traced flag's `lax.cond`; a pattern or window that does not fit the
model is a ConfigError naming the field."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.layers.attention import fused, window
from spmdtask.layers.attention.mha import attend

TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(b, t, h, kv, hd, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, (b, t, n, hd)) for k, n in zip(keys, (h, kv, kv)))


def _brute(q, k, v, w, scale):
  """numpy: query i sees keys j with i - w < j <= i (grouped KV heads repeated)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
  s = np.where((j <= i) & (j > i - w), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("w", [1, 5, 40])  # one key; shorter than the row; longer (= full)
def test_xla_window_equals_brute_force_static_and_traced(w):
  q, k, v = _qkv(2, 24, 4, 2, 8)
  pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
  want = _brute(q, k, v, min(w, 24), 12 ** -0.5)
  static = attend(q, k, v, pos, pos, window=w, scale=12 ** -0.5)
  np.testing.assert_allclose(static, want, **TOL)
  traced = jax.jit(lambda flag: attend(q, k, v, pos, pos, window=window.effective(w, flag),
                                       scale=12 ** -0.5))
  np.testing.assert_allclose(traced(True), want, **TOL)
  np.testing.assert_allclose(traced(False), attend(q, k, v, pos, pos, scale=12 ** -0.5), **TOL)
  if w >= 24:  # a window at least the row: full causal attention
    np.testing.assert_allclose(static, attend(q, k, v, pos, pos, scale=12 ** -0.5), **TOL)


def test_splash_local_mask_equals_xla_forward_grads_and_per_layer_flag():
  b, t, h, kvh, hd, w = 1, 128, 2, 1, 32, 50  # one block of 128: the mask inside it
  q, k, v = _qkv(b, t, h, kvh, hd, seed=1)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
  xla = lambda q, k, v: attend(q, k, v, pos, pos, window=w)
  splash = lambda q, k, v: fused.splash(q, k, v, None, True, None, interpret=True, block=128,
                                        window=w)
  for got, want in zip(jax.grad(loss(splash), (0, 1, 2))(q, k, v),
                       jax.grad(loss(xla), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # A stack mixing kinds: the layer's traced flag picks the local or the global kernel.
  run = jax.jit(lambda flag: fused.fused("splash", q, k, v, None, True, None, "cpu", w,
                                         is_local=flag))
  np.testing.assert_allclose(run(True), xla(q, k, v), **TOL)
  np.testing.assert_allclose(run(False), attend(q, k, v, pos, pos), **TOL)


def test_layer_flags_repeat_the_pattern():
  gemma = ("local",) * 5 + ("global",)
  assert window.layer_flags(gemma, 8) == (True,) * 5 + (False, True, True)


@pytest.mark.parametrize("pattern,w,field", [
    (("local",) * 5 + ("global",), 1024, "attention_pattern has 6 entries"),  # > 4 layers
    (("local", "global"), 0, "sliding_window=0"),
    (("local", "global"), None, "sliding_window=None"),
    (("global",), 512, "has no 'local' layer"),
    (("local", "full"), 512, "attention_pattern=('local', 'full')"),
])
def test_a_pattern_or_window_that_does_not_fit_is_a_config_error(pattern, w, field):
  with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
    window.check(pattern, w, 4)
