"""Preference pairs for DPO (`spmdtask.objectives.dpo`): batches whose leaves are
`[pairs, 2, t]` (index 0 the chosen completion, 1 the rejected one) with `inputs`,
`targets` and `weights` (1 on the completion's target tokens, 0 on the prompt and padding).

`SyntheticPairInput` makes learnable pairs without a data dir (tests, `TinyLmDpo`).
"""
import dataclasses

import numpy as np

from spmdtask.core.host_input import StepIndexedInput


@dataclasses.dataclass
class SyntheticPairInput(StepIndexedInput):
  """Pairs that share a prompt counting up by a stride: the chosen completion counts on,
  the rejected one is random tokens; completions of a random length, then padding.

  Attributes:
    batch_size: the GLOBAL number of pairs per batch; each process yields its share.
    seq_len: tokens per sequence (prompt + completion + padding).
    vocab_size: tokens are in [0, vocab_size).
    seed: with the step and the pair's number, fixes every pair, whatever the process count.
    num_batches: None = endless.
  """
  batch_size: int = 8
  seq_len: int = 32
  vocab_size: int = 256
  seed: int = 0
  num_batches: int | None = None
  process_index: int | None = None
  process_count: int | None = None
  target_mask = True

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's pairs of global batch number `step`."""
    pairs = [_pair(np.random.default_rng((self.seed, step, int(r))), self.seq_len,
                   self.vocab_size) for r in self.local_rows(step)]
    return {k: np.stack([p[k] for p in pairs]) if pairs else
            np.zeros((0, 2, self.seq_len), np.float32 if k == "weights" else np.int32)
            for k in ("inputs", "targets", "weights")}


def _pair(g: np.random.Generator, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
  prompt = int(g.integers(2, seq_len // 2))
  length = int(g.integers(2, seq_len - prompt + 1))  # completion tokens
  start, stride = int(g.integers(0, vocab)), int(g.integers(1, 8))
  counting = (start + stride * np.arange(prompt + length)) % vocab
  random = np.concatenate([counting[:prompt], g.integers(0, vocab, length)])
  out = {k: np.zeros((2, seq_len), np.int32) for k in ("inputs", "targets")}
  out["weights"] = np.zeros((2, seq_len), np.float32)
  for i, toks in enumerate((counting, random)):
    n = prompt + length - 1  # input j predicts token j + 1
    out["inputs"][i, :n], out["targets"][i, :n] = toks[:-1], toks[1:]
    out["weights"][i, prompt - 1:n] = 1.0  # the completion's tokens are the targets
  return out
