"""Preference pairs for DPO (`spmdtask.objectives.dpo`): batches whose leaves are
`[pairs, 2, t]` (index 0 the chosen completion, 1 the rejected one) with `inputs`,
`targets` and `weights` (1 on the completion's target tokens, 0 on the prompt and padding).

`PreferenceInput` reads a data dir made by tools/prepare_pref_data.py: text.py's layout
(shards + index, tokens and a target mask per document) where pair p is documents 2p
(chosen: prompt + completion) and 2p + 1 (rejected), meta.json's "preferences" true; with
reference log-probs precomputed (tools/precompute_ref_logps.py) `<split>_ref_logps.npy`
[pairs, 2] float32 beside them. `SyntheticPairInput` makes learnable pairs without a data
dir (tests, `TinyLmDpo`).
"""
import dataclasses
import io

import numpy as np

from spmdtask import fs
from spmdtask.core.host_input import StepIndexedInput
from spmdtask.core.objective import Objective, Reference
from spmdtask.errors import ConfigError
from spmdtask.inputs import data_dirs, tokenizers
from spmdtask.inputs.text import DocumentReader

FIELD = "datasets[...].data_dir"
KEYS = ("inputs", "targets", "weights")


def ref_logps_name(split: str) -> str:
  return f"{split}_ref_logps.npy"


def pair_rows(docs, masks, seq_len: int) -> dict[str, np.ndarray]:
  """Documents (token arrays, closed by their end of turn) and their target masks ->
  `[len(docs), seq_len]` rows: input i predicts token i + 1, a target where mask[i + 1]."""
  out = {k: np.zeros((len(docs), seq_len), np.float32 if k == "weights" else np.int32)
         for k in KEYS}
  for r, (ids, mask) in enumerate(zip(docs, masks)):
    n = len(ids) - 1
    out["inputs"][r, :n], out["targets"][r, :n] = ids[:-1], ids[1:]
    out["weights"][r, :n] = mask[1:]
  return out


@dataclasses.dataclass
class PreferenceInput(StepIndexedInput):
  """Pairs of a prepared preference data dir, in its order (the tool shuffled them once);
  global batch b is pairs [b·B, (b+1)·B) modulo the split's pairs, each process its share.

  Attributes:
    data_dir: a tools/prepare_pref_data.py dir.
    split: 'train' or 'eval'.
    batch_size: the GLOBAL number of pairs per batch.
    seq_len: tokens per sequence; every prepared sequence must fit (its --max_len <=
      seq_len + 1).
    model: the model fed (share task.model's config); its vocab_size must be the data's.
    objective: the task's objective (share task.objective's config): where it reads the
      reference's log-probs from the batch (`Reference.PRECOMPUTED`, DPO's
      reference='precomputed'), batches add `ref_logps` [pairs, 2] from
      `<split>_ref_logps.npy`.
    num_batches: None = endless; else this many batches.
  """
  data_dir: str = ""
  split: str = "train"
  batch_size: int = 8
  seq_len: int = 256
  model: object | None = None
  objective: Objective | None = None
  num_batches: int | None = None
  process_index: int | None = None
  process_count: int | None = None
  target_mask = True

  def __post_init__(self):
    self._reader = DocumentReader(self.data_dir, self.split, FIELD)
    meta = self._reader.meta
    data_dirs.check_kind(meta, self.data_dir, FIELD, ("preferences",),
                         " (each pair a chosen and a rejected answer)")
    if self.model is not None:
      tokenizers.check_vocab(meta, self.model.vocab_size, self.data_dir)
    longest = int(self._reader.lengths.max())
    if longest - 1 > self.seq_len:
      raise ConfigError(f"{FIELD}={self.data_dir!r} split {self.split!r} holds sequences of "
                        f"up to {longest} tokens, more than seq_len={self.seq_len} + 1; set "
                        f"datasets[...].seq_len to at least {longest - 1}.")
    self.num_pairs = len(self._reader.lengths) // 2
    self._ref = None
    if self.objective is not None and self.objective.reference_kind(
        self.model) is Reference.PRECOMPUTED:
      path = fs.join(self.data_dir, ref_logps_name(self.split))
      if not fs.isfile(path):
        raise ConfigError(f"{FIELD}={self.data_dir!r} has no {ref_logps_name(self.split)}: "
                          "task.objective.reference='precomputed' reads the reference's "
                          "log-probs from it. Write them with tools/precompute_ref_logps.py, or "
                          "set task.objective.reference='in_step'.")
      self._ref = np.load(io.BytesIO(fs.read_bytes(path))).astype(np.float32)

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's pairs of global batch `step`."""
    pairs = self.local_rows(step) % self.num_pairs
    ids = [d for p in pairs for d in (2 * int(p), 2 * int(p) + 1)]
    docs = self._reader.read(ids)
    rows = pair_rows([docs[d] for d in ids], [self._reader.masks[d] for d in ids], self.seq_len)
    out = {k: v.reshape((len(pairs), 2, self.seq_len)) for k, v in rows.items()}
    if self._ref is not None:
      out["ref_logps"] = self._ref[pairs]
    return out


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
    model: None, or the model fed (share task.model's config): its vocab_size is the
      pairs' (not `vocab_size`).
  """
  batch_size: int = 8
  seq_len: int = 32
  vocab_size: int = 256
  seed: int = 0
  num_batches: int | None = None
  model: object | None = None
  process_index: int | None = None
  process_count: int | None = None
  target_mask = True

  def __post_init__(self):
    if self.model is not None:
      self.vocab_size = self.model.vocab_size

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
