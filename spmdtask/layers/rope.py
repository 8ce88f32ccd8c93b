"""Rotary position embeddings (rotate-half form), with Llama 3's, linear (position
interpolation: Gemma 3's global layers) and YaRN's (DeepSeek) frequency scaling. A scaling
gives `frequencies(head_dim, theta)` and `cos_sin_factor`.

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

  def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
    return _llama3_frequencies(self, head_dim, theta)

  cos_sin_factor = 1.0


@dataclasses.dataclass(frozen=True)
class LinearScaling:
  """Linear RoPE scaling (HF `rope_type: linear`): every frequency divided by `factor`
  (positions interpolated; Gemma 3's global layers use 8)."""
  factor: float = 8.0

  def validate(self, where: str) -> None:
    if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
        or self.factor <= 0:
      raise ConfigError(f"{where}.factor={self.factor!r} must be a number > 0.")

  def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
    return _base_frequencies(head_dim, theta) / self.factor

  cos_sin_factor = 1.0


def _base_frequencies(head_dim: int, theta: float) -> np.ndarray:
  return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _llama3_frequencies(s: Llama3Scaling, head_dim: int, theta: float) -> np.ndarray:
  inv = _base_frequencies(head_dim, theta)
  wavelength = 2 * math.pi / inv
  ratio = s.original_max_position_embeddings / wavelength  # how often it turns in the context
  blend = (ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  blended = (1 - blend) * inv / s.factor + blend * inv
  return np.where(ratio > s.high_freq_factor, inv,       # high frequency: kept
                  np.where(ratio < s.low_freq_factor, inv / s.factor, blended))


def yarn_mscale(factor: float, mscale: float) -> float:
  """YaRN's magnitude correction 0.1·mscale·ln(factor) + 1 (1 where factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN RoPE scaling as DeepSeek-V2/V3 use it (HF `rope_type: yarn`).

  Frequencies of dims below the correction range (fast: more than beta_fast turns in
  original_max_position_embeddings) are kept, those above it (slower than beta_slow turns)
  divided by `factor`, a linear ramp between; the range's ends are floored / ceiled
  (`truncate`). cos and sin are multiplied by mscale(factor, mscale) / mscale(factor,
  mscale_all_dim) (`cos_sin_factor`); DeepSeek's attention multiplies its softmax scale by
  mscale(factor, mscale_all_dim)² (`softmax_factor`).
  """
  factor: float = 40.0
  original_max_position_embeddings: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 1.0
  truncate: bool = True

  def validate(self, where: str) -> None:
    for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{where}.{name}={value!r} must be a number > 0.")

  def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
    def turns_dim(turns):  # the dim whose wavelength turns `turns` times in the context
      return head_dim * math.log(self.original_max_position_embeddings
                                 / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = turns_dim(self.beta_fast), turns_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv = _base_frequencies(head_dim, theta)
    return inv / self.factor * ramp + inv * (1 - ramp)

  @property
  def cos_sin_factor(self) -> float:
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor, 1.0)

  @property
  def softmax_factor(self) -> float:
    m = yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0
    return m * m


# A model's `rope_scaling` (MLA's YaRN is its own field: layers.attention.mla).
SCALINGS = (Llama3Scaling, LinearScaling)
Scaling = Llama3Scaling | LinearScaling | YarnScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: Scaling | None = None
                        ) -> np.ndarray:
  """[head_dim // 2] float64: theta^(-2i/head_dim), rescaled by `scaling` when given."""
  if scaling is None:
    return _base_frequencies(head_dim, theta)
  return scaling.frequencies(head_dim, theta)


def apply(x: jax.Array, positions: jax.Array, theta: float,
          scaling: Scaling | None = None) -> jax.Array:
  """Rotary embedding of x [batch, seq, heads, head_dim] at positions [batch, seq].

  Pairs (i, i + head_dim/2) rotate by positions · inverse_frequencies[i] (HF Llama's
  rotate-half form), cos and sin times `scaling.cos_sin_factor`; computed in float32,
  returned in x's dtype.
  """
  factor = 1.0 if scaling is None else scaling.cos_sin_factor
  return apply_frequencies(x, positions, frequencies(x.shape[-1], theta, scaling), factor)


def frequencies(head_dim: int, theta: float, scaling: Scaling | None = None) -> jax.Array:
  """`inverse_frequencies` as a float32 constant."""
  return jnp.asarray(inverse_frequencies(head_dim, theta, scaling), jnp.float32)


def apply_frequencies(x: jax.Array, positions: jax.Array, freq: jax.Array,
                      factor: float = 1.0) -> jax.Array:
  """`apply` with the inverse frequencies `freq` [head_dim // 2] float32 and the cos/sin
  factor given (a layer that picks its RoPE base on the device: layers.attention.window)."""
  half = x.shape[-1] // 2
  angle = positions.astype(jnp.float32)[..., None] * freq
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  if factor != 1.0:
    sin, cos = sin * factor, cos * factor
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
