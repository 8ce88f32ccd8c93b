"""Test oracles: greedy decoding that reruns the full forward pass for every token.

The reference the KV-cache decoder is checked against (tests) and measured against
(benchmarks/decode.py). Not production code.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdtask.core import sharding, steps as steps_lib
from spmdtask.run.decoding import _put


def full_forward_step_fn(model, logical_params):
  """The no-cache baseline: `(padded_params, tokens [b,S], pos [b]) -> greedy token at pos+1`.

  Reruns the whole forward pass over the fixed-size buffer at each step.
  """
  def step(padded_params, tokens, pos):
    params = sharding.unpad(padded_params, logical_params)
    logits = model.apply({"params": params}, tokens)
    last = jnp.take_along_axis(logits, pos[:, None, None], axis=1)[:, 0]
    return jnp.argmax(last, axis=-1).astype(jnp.int32)
  return step


def build_full_forward(program) -> steps_lib.Partitioned:
  """The jitted no-cache baseline step (`full_forward_step_fn`) on `program.mesh`."""
  data = program.task.batch_axes() or None
  return steps_lib.partition(full_forward_step_fn(program.model,
                                                  program.layout.logical.params), program.mesh,
                             (program.layout.split.params, P(data, None), P(data)), P(data))


def greedy_without_cache(program, padded_params, prompts: np.ndarray, prompt_lens: np.ndarray,
                         max_len: int, num_steps: int | None = None,
                         fwd: steps_lib.Partitioned | None = None) -> np.ndarray:
  """The baseline: greedy decoding that reruns the full forward pass for every token.

  Single-process. Returns the [b, max_len] token buffer (prompt, then generated tokens;
  no eos). `num_steps` limits the tokens per row (default: fill the buffer); `fwd` is
  a `build_full_forward(program)` to reuse (else one is built and compiled).
  """
  fwd = fwd or build_full_forward(program)
  b = prompts.shape[0]
  tokens = np.zeros((b, max_len), np.int32)
  tokens[:, :prompts.shape[1]] = np.where(np.arange(prompts.shape[1]) < prompt_lens[:, None],
                                          prompts, 0)
  pos = np.asarray(prompt_lens, np.int32) - 1
  steps = max_len - 1 - int(pos.min()) if num_steps is None else num_steps
  tokens, pos = jnp.asarray(tokens), jnp.asarray(pos)
  for _ in range(steps):
    nxt = fwd(padded_params, tokens, pos)
    live = pos + 1 < max_len
    tokens = _put(tokens, jnp.where(live, pos + 1, -1), nxt)
    pos = jnp.where(live, pos + 1, pos)
  return np.asarray(jax.device_get(tokens))
