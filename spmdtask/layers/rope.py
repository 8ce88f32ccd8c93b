"""Rotary position embeddings (rotate-half form), with Llama 3's frequency scaling and
linear (position-interpolation) scaling (Gemma 3's global layers).

The inverse frequencies depend only on static fields (head_dim, theta, scaling), so they
are computed once in float64 numpy and enter the program as a float32 constant: each is
the correctly rounded value, whatever the backend's `pow`.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from spmdtask.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  """Llama 3.1's RoPE scaling (HF `rope_type: llama3`).

  Wavelengths 2π/f shorter than original_max_position_embeddings / high_freq_factor keep
  their frequency; those longer than original_max_position_embeddings / low_freq_factor
  are divided by `factor`; in between, the frequency blends the two linearly in
  original_max_position_embeddings / wavelength.
  """
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def validate(self, where: str) -> None:
    """ConfigError naming the field of `where` (e.g. 'task.model.rope_scaling') that is off."""
    for name in ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{where}.{name}={value!r} must be a number > 0.")
    if self.high_freq_factor <= self.low_freq_factor:
      raise ConfigError(
          f"{where}.high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
          f"{self.low_freq_factor} (the blend runs between their wavelengths); Llama 3.1 uses "
          "1.0 and 4.0.")

  def rescale(self, inv: np.ndarray) -> np.ndarray:
    """The inverse frequencies `inv` (float64) as this scaling changes them."""
    return _llama3(self, inv)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
  """Linear RoPE scaling (HF `rope_type: linear`): every frequency divided by `factor`
  (positions interpolated; Gemma 3's global layers use 8)."""
  factor: float = 8.0

  def validate(self, where: str) -> None:
    if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
        or self.factor <= 0:
      raise ConfigError(f"{where}.factor={self.factor!r} must be a number > 0.")

  def rescale(self, inv: np.ndarray) -> np.ndarray:
    return inv / self.factor


Scaling = Llama3Scaling | LinearScaling
SCALINGS = (Llama3Scaling, LinearScaling)


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: Scaling | None = None) -> np.ndarray:
  """[head_dim // 2] float64: theta^(-2i/head_dim), rescaled by `scaling` when given."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  return inv if scaling is None else scaling.rescale(inv)


def _llama3(s: Llama3Scaling, inv: np.ndarray) -> np.ndarray:
  wavelength = 2 * math.pi / inv
  ratio = s.original_max_position_embeddings / wavelength  # how often it turns in the context
  blend = (ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  blended = (1 - blend) * inv / s.factor + blend * inv
  return np.where(ratio > s.high_freq_factor, inv,       # high frequency: kept
                  np.where(ratio < s.low_freq_factor, inv / s.factor, blended))


def apply(x: jax.Array, positions: jax.Array, theta: float,
          scaling: Scaling | None = None) -> jax.Array:
  """Rotary embedding of x [batch, seq, heads, head_dim] at positions [batch, seq].

  Pairs (i, i + head_dim/2) rotate by positions · inverse_frequencies[i] (HF Llama's
  rotate-half form); computed in float32, returned in x's dtype.
  """
  return apply_frequencies(x, positions, frequencies(x.shape[-1], theta, scaling))


def frequencies(head_dim: int, theta: float, scaling: Scaling | None = None) -> jax.Array:
  """`inverse_frequencies` as a float32 constant."""
  return jnp.asarray(inverse_frequencies(head_dim, theta, scaling), jnp.float32)


def apply_frequencies(x: jax.Array, positions: jax.Array, freq: jax.Array) -> jax.Array:
  """`apply` with the inverse frequencies `freq` [head_dim // 2] float32 given (a layer
  that picks its RoPE base on the device: layers.attention.window)."""
  half = x.shape[-1] // 2
  angle = positions.astype(jnp.float32)[..., None] * freq
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
