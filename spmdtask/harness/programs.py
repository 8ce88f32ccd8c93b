"""The device side of the lm-evaluation-harness backend: token rows in, scores and greedy
continuations out, on the job's mesh with its restored params.

`Scorer` scores rows of tokens: `(padded_params, inputs [B, T], targets [B, T]) ->
(log p(target) [B, T], target is the argmax [B, T])`, one forward of the model per batch
through its contract (`core.model.ScoresTokens.token_scores`: the loss's head, vocab-tiled
where the model's loss is, zig-zag ordered under a context axis). `Generator`
continues prompts with `run.decoding`'s prefill and per-token programs (greedy, or the
request's temperature), stopping at the stop ids. Both take the requests in any order,
sort them longest first so that each batch is padded to its own longest row (rounded up to
a power of two, so a run compiles a few shapes), and give results back in request order.

Batches are `batch_size` rows over the data axes; each process feeds its own slice of every
batch's rows (`host_input.process_slice`) and every process gets the whole result back
(replicated), so every process runs the same programs and process 0 alone writes.
"""
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdtask.core import global_batch, sharding, steps as steps_lib
from spmdtask.core.model import ScoresTokens
from spmdtask.core.host_input import process_slice
from spmdtask.errors import ConfigError
from spmdtask.run import decoding
from spmdtask.task import DecodeParams

MIN_LEN = 16  # the shortest padded row: fewer shapes to compile for a few wasted columns


def padded_len(n: int, cap: int) -> int:
  """The row length a batch whose longest row has `n` tokens is padded to: the next power
  of two (at least MIN_LEN), at most `cap`."""
  return min(max(MIN_LEN, 1 << max(n - 1, 0).bit_length()), cap)


def longest_first(lengths: list[int]) -> list[int]:
  """Request indices, longest first (ties in request order)."""
  return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def check_batch_size(program, batch_size: int, field: str) -> P:
  """The PartitionSpec of a [batch_size, T] row batch; ConfigError naming `field` unless
  the rows divide over the data axes and the processes."""
  data = tuple(program.task.batch_axes()) or None
  shards = sharding.shards(data, dict(program.mesh.shape))
  if batch_size < 1 or batch_size % shards or batch_size % jax.process_count():
    raise ConfigError(
        f"{field}={batch_size}: a batch of requests is split over the data axes {data} "
        f"({shards} shards) and {jax.process_count()} processes; give a positive multiple "
        f"of {int(np.lcm(shards, jax.process_count()))}.")
  return P(data, None)


def _local(rows: np.ndarray) -> np.ndarray:
  """This process's slice of a global batch's rows."""
  lo, hi = process_slice(rows.shape[0])
  return rows[lo:hi]


def score_fn(model, logical_params) -> Callable:
  """`(padded_params, inputs, targets) -> (target log-probs, target is the argmax)`, by
  the model's `token_scores` (ConfigError where the model has none)."""
  if not isinstance(model, ScoresTokens):
    raise ConfigError(f"lm-eval's requests are scored with the model's token_scores "
                      f"(spmdtask.core.model.ScoresTokens); task.model is a "
                      f"{type(model).__name__}, which has none. Use a TransformerLm.")

  def score(padded_params, inputs, targets):
    params = sharding.unpad(padded_params, logical_params)
    batch = {"inputs": inputs, "targets": targets, "weights": jnp.ones(inputs.shape)}
    return tuple(model.apply({"params": params}, batch, method=model.token_scores))
  return score


class Scorer:
  """Log-likelihoods of continuations (module doc)."""

  def __init__(self, program, batch_size: int, max_length: int, field: str):
    self.batch_size, self.max_length = batch_size, max_length
    self.mesh, spec = program.mesh, check_batch_size(program, batch_size, field)
    self.specs = {"inputs": spec, "targets": spec}
    self.program = steps_lib.partition(
        score_fn(program.model, program.layout.logical.params), program.mesh,
        (program.layout.split.params, spec, spec), (P(), P()))

  def score(self, padded_params, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """Each row `(tokens, n)` (at most max_length + 1 tokens): (the sum of log p of its
    last `n` tokens given those before, whether each of them is the argmax)."""
    out: list[Any] = [None] * len(rows)
    order = longest_first([len(t) for t, _ in rows])
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      width = padded_len(len(rows[batch[0]][0]) - 1, self.max_length)
      inputs = np.zeros((self.batch_size, width), np.int32)
      targets = np.zeros((self.batch_size, width), np.int32)
      for r, i in enumerate(batch):
        tokens = rows[i][0]
        inputs[r, :len(tokens) - 1], targets[r, :len(tokens) - 1] = tokens[:-1], tokens[1:]
      g = global_batch.to_global({"inputs": _local(inputs), "targets": _local(targets)},
                                 self.specs, self.mesh)
      logp, greedy = jax.device_get(self.program(padded_params, g["inputs"], g["targets"]))
      for r, i in enumerate(batch):
        tokens, n = rows[i]
        end = len(tokens) - 1
        out[i] = (float(np.sum(logp[r, end - n:end], dtype=np.float64)),
                  bool(np.all(greedy[r, end - n:end])))
    return out


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How one group of generation requests decodes: at most `max_new` tokens each, greedy
  (temperature 0) or sampled, stopped at the first of `stop_ids`."""
  max_new: int
  stop_ids: tuple[int, ...]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0


class Generator:
  """Continuations of prompts with decode's programs (module doc)."""

  def __init__(self, program, batch_size: int, max_length: int, field: str):
    check_batch_size(program, batch_size, field)
    self.program, self.batch_size, self.max_length = program, batch_size, max_length
    self._decoders: dict[tuple, decoding.Decoder] = {}

  def _decoder(self, prompt_len: int, how: Sampling) -> decoding.Decoder:
    dp = DecodeParams(max_decode_len=prompt_len + how.max_new, temperature=how.temperature,
                      top_k=how.top_k, top_p=how.top_p, eos_id=how.stop_ids or None)
    if (prompt_len, how) not in self._decoders:  # (DecodeParams is not hashable)
      self._decoders[prompt_len, how] = decoding.build(self.program, dp, self.batch_size,
                                                       prompt_len)
    return self._decoders[prompt_len, how]

  def generate(self, padded_params, prompts: list[list[int]], how: Sampling) -> list[list[int]]:
    """Each prompt's new tokens (at most `how.max_new`, a stop id included where one was
    emitted); prompts hold at most max_length - max_new tokens."""
    out: list[Any] = [None] * len(prompts)
    order = longest_first([len(p) for p in prompts])
    rows = self.batch_size // jax.process_count()
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      width = padded_len(len(prompts[batch[0]]), self.max_length - how.max_new)
      tokens = np.zeros((self.batch_size, width), np.int32)
      lens = np.ones((self.batch_size,), np.int32)
      ids = np.full((self.batch_size,), -1, np.int32)
      for r, i in enumerate(batch):
        tokens[r, :len(prompts[i])], lens[r], ids[r] = prompts[i], len(prompts[i]), i
      local = {"prompts": _local(tokens), "prompt_lens": _local(lens), "ids": _local(ids)}
      for row in decoding.decode_batch(self._decoder(width, how), padded_params, local, rows):
        out[row["id"]] = row["output_ids"][:how.max_new]
    return out
