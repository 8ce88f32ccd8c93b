"""Field checks shared by config classes: each raises ConfigError naming the field and the fix."""
import jax
import jax.numpy as jnp

from spmdtask.errors import ConfigError
from spmdtask.core import remat


def positive(where: str, **fields) -> None:
  """Every field is an int > 0."""
  for name, value in fields.items():
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ConfigError(f"{where}.{name}={value!r} must be a positive integer.")


def in_range(field: str, value, lo: float, hi: float, fix: str = "") -> None:
  """lo <= value <= hi, a number."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
    raise ConfigError(f"{field}={value!r} must be a number in [{lo}, {hi}]. {fix}".strip())


def remat_policy(field: str, policy) -> None:
  """None, a preset of spmdtask.core.remat or a `jax.checkpoint_policies` policy name."""
  remat.check(field, policy)


def dtype(field: str, value: str) -> None:
  """A floating dtype name jnp understands."""
  try:
    ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise ConfigError(f"{field}={value!r} is not a floating dtype; use 'float32' or 'bfloat16'.")


def stop_ids(field: str, value) -> tuple[int, ...]:
  """A stop-token field (None, one id, or a tuple of ids) as a tuple of ids; () = none."""
  ids = () if value is None else (value,) if isinstance(value, int) else value
  if (isinstance(value, bool) or not isinstance(ids, (tuple, list))
      or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
    raise ConfigError(f"{field}={value!r} must be None, a token id or a tuple of token ids "
                      "(e.g. (128001, 128009): generation stops at the first of them).")
  return tuple(ids)
