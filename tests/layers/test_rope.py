"""layers/rope.py: llama3 frequency scaling against a numpy transcription of the published
formula (HF transformers' `_compute_llama3_parameters`, Meta's `apply_scaling`)."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.layers import rope


def llama3_inv_freq(head_dim, theta, factor, low_freq_factor, high_freq_factor, old_context_len):
  """The published formula, in its wavelength form, float64."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  out = []
  for f in inv_freq:
    wavelen = 2 * math.pi / f
    if wavelen < high_freq_wavelen:
      out.append(f)
    elif wavelen > low_freq_wavelen:
      out.append(f / factor)
    else:
      smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      out.append((1 - smooth) * f / factor + smooth * f)
  return np.asarray(out)


def rotate_half_reference(x, positions, inv_freq):
  """HF's apply_rotary_pos_emb: angles in float32 (as HF computes them), the rest float64."""
  angle = (positions.astype(np.float32)[..., None] * inv_freq.astype(np.float32)).astype(np.float64)
  cos = np.cos(np.concatenate([angle, angle], -1))[:, :, None, :]
  sin = np.sin(np.concatenate([angle, angle], -1))[:, :, None, :]
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


@pytest.mark.parametrize("head_dim,factor", [(64, 32.0), (128, 8.0)])
def test_llama3_scaling_matches_the_published_formula(head_dim, factor):
  scaling = rope.Llama3Scaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
  want = llama3_inv_freq(head_dim, 500000.0, factor, 1.0, 4.0, 8192)
  got = rope.inverse_frequencies(head_dim, 500000.0, scaling)
  assert np.max(np.abs(got - want) / want) <= 1e-12
  # All three regimes occur: kept, divided by factor, blended.
  plain = rope.inverse_frequencies(head_dim, 500000.0)
  ratio = got / plain
  assert np.any(ratio == 1.0) and np.any(np.isclose(ratio, 1 / factor)) and \
      np.any((ratio < 1.0) & (ratio > 1 / factor))

  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 64, 3, head_dim)).astype(np.float32)
  positions = np.stack([np.arange(64), 131072 - 64 + np.arange(64)])  # up to 128k
  out = np.asarray(rope.apply(jnp.asarray(x), jnp.asarray(positions), 500000.0, scaling))
  err = np.max(np.abs(out - rotate_half_reference(x.astype(np.float64), positions, want)))
  print(f"llama3 RoPE (head_dim {head_dim}, factor {factor}) max abs error vs numpy: {err:.2e}")
  assert err <= 1e-6


def test_bad_scaling_fields_are_named():
  with pytest.raises(ConfigError, match=r"rope_scaling.high_freq_factor=1.0 must exceed"):
    rope.Llama3Scaling(low_freq_factor=1.0, high_freq_factor=1.0).validate(
        "task.model.rope_scaling")
  with pytest.raises(ConfigError, match=r"rope_scaling.factor=0 must be a number > 0"):
    rope.Llama3Scaling(factor=0).validate("task.model.rope_scaling")
  with pytest.raises(ConfigError, match=r"rope_scaling.factor=-8.0 must be a number > 0"):
    rope.LinearScaling(factor=-8.0).validate("task.model.rope_scaling")


def test_linear_scaling_divides_every_frequency():
  """HF's rope_type 'linear' (Gemma 3's global layers): inv_freq / factor."""
  plain = rope.inverse_frequencies(128, 1e6)
  np.testing.assert_array_equal(rope.inverse_frequencies(128, 1e6, rope.LinearScaling(8.0)),
                                plain / 8.0)
