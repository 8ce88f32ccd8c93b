"""Sliding-window (local) attention: the window, the per-layer local/global pattern, and
each kernel's form of the mask.

A local layer's query at position p sees the keys at positions (p - window, p] (with
causality; Hugging Face's `sliding_window`: `window` keys, its own included); a global
layer sees every earlier key. A window at least as long as the row is full attention.

The pattern (`TransformerLm.attention_pattern`, e.g. Gemma 3's five 'local' then one
'global') repeats over the layers. The layer stack is one scanned body, so a pattern that
mixes both kinds reaches each layer as a scanned per-layer flag (`layer_flags`) and the
layer picks its window and RoPE base from it on the device: the xla kernel masks with a
traced window (`effective`), the fused kernels (splash, cuDNN: static masks) run under a
`lax.cond` between their local and global forms. A uniform pattern needs no flag: the
window is static.
"""
import jax
import jax.numpy as jnp

from spmdtask.errors import ConfigError

KINDS = ("local", "global")
UNBOUNDED = 1 << 30  # a global layer's window inside a traced one: no int32 overflow


def layer_flags(pattern: tuple[str, ...], num_layers: int) -> tuple[bool, ...]:
  """Per layer: True where it is local, the pattern repeated over `num_layers`."""
  return tuple(pattern[i % len(pattern)] == "local" for i in range(num_layers))


def mixed_flags(pattern, num_layers: int) -> tuple[bool, ...] | None:
  """`layer_flags` where the pattern mixes kinds; None where every layer is alike (the
  layer's window then says which, statically)."""
  return layer_flags(tuple(pattern), num_layers) if len(set(pattern)) > 1 else None


def check(pattern, window, num_layers: int, where: str = "task.model") -> None:
  """ConfigError naming the field where the pattern or the window does not fit the model."""
  if (not isinstance(pattern, (tuple, list)) or not pattern
      or any(p not in KINDS for p in pattern)):
    raise ConfigError(
        f"{where}.attention_pattern={pattern!r} must be a non-empty tuple of 'local' and "
        "'global', repeated over the layers (Gemma 3: ('local',) * 5 + ('global',)).")
  if len(pattern) > num_layers:
    raise ConfigError(
        f"{where}.attention_pattern has {len(pattern)} entries but the model has "
        f"num_layers={num_layers}: the pattern repeats over the layers, so it must not be "
        "longer than the stack; shorten it or add layers.")
  local = "local" in pattern
  if local and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
    raise ConfigError(
        f"{where}.sliding_window={window!r}: the attention_pattern has local layers, which "
        "need a window of at least 1 key (an int; Gemma 3's is 512 or 1024).")
  if not local and window is not None:
    raise ConfigError(
        f"{where}.sliding_window={window!r} is set but attention_pattern={tuple(pattern)!r} "
        "has no 'local' layer, so nothing would use it: add local layers or set it to None.")


def effective(window: int | None, is_local: jax.Array | None):
  """The window a layer masks with: `window` (None: global) when its kind is static
  (`is_local` None), else a traced int: `window` where local, UNBOUNDED where global."""
  if is_local is None or window is None:
    return window
  return jnp.where(is_local, window, UNBOUNDED)


def visible(q_pos: jax.Array, kv_pos: jax.Array, window) -> jax.Array:
  """Where a key at kv_pos is inside the window of a query at q_pos (broadcasting)."""
  return kv_pos > q_pos - window


def select(is_local: jax.Array | None, window: int | None, run):
  """`run(window)` with the layer's window as a static value: `run(window)` for a static
  kind, else a `lax.cond` between `run(window)` (local) and `run(None)` (global)."""
  if is_local is None or window is None:
    return run(window)
  return jax.lax.cond(is_local, lambda: run(window), lambda: run(None))


def splash_mask(t: int, window: int | None, causal: bool):
  """One head's splash mask over t tokens (the kernel's mask objects)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  if window is None:
    return sm.CausalMask((t, t)) if causal else sm.FullMask((t, t))
  return sm.LocalMask((t, t), (window - 1, 0 if causal else window - 1), 0)


def cudnn_window(window: int | None, causal: bool):
  """`jax.nn.dot_product_attention`'s local_window_size (left, right) or None."""
  if window is None:
    return None
  return (window - 1, 0 if causal else window - 1)
