"""A prepared text corpus on tf.data: packed LM batches and decode prompts.

Layout of a data dir (written by tools/prepare_text_data.py):
  meta.json, tokenizer.model (SentencePiece only)    see `tokenizers`
  <split>-0000i-of-0000n.tfrecord                    one tf.train.Example per document:
                                                     int64 `tokens`, closed by eod_id; and
                                                     int64 `mask` (same length) when meta has
                                                     "target_mask": true (conversations,
                                                     tools/prepare_chat_data.py: 1 = target)
  <split>_index.npz                                  per document in order: shard, record,
                                                     length (for the packing plan)

`PackedLmInput` plans its rows from the index alone (`packing.pieces`, `first_fit`), the
same plan in every process. Global batch b is rows [b·B, (b+1)·B) of the plan (the plan
repeats each epoch); a process makes only its rows of it and reads only their documents,
so batches depend on neither the process count nor a restart: the checkpointed position
is the batch number.
"""
import dataclasses
import functools
import io

import numpy as np
from absl import logging

from spmdtask import console, fs
from spmdtask.errors import ConfigError
from spmdtask.inputs import data_dirs, packing, prompts, tokenizers
from spmdtask.core.host_input import StepIndexedInput
from spmdtask.inputs.tfdata import tensorflow, write_records


def shard_name(split: str, i: int, n: int) -> str:
  return f"{split}-{i:05d}-of-{n:05d}.tfrecord"


def index_name(split: str) -> str:
  return f"{split}_index.npz"


def write_split(data_dir: str, split: str, docs: list[list[int]], num_shards: int,
                masks: list[list[int]] | None = None,
                progress: console.Progress | None = None) -> list[str]:
  """Writes documents (token lists, eod included) as `num_shards` shards + the index; with
  `masks`, each document's target mask beside its tokens; `progress` counts the shards."""
  num_shards = max(1, min(num_shards, len(docs)))
  bounds = np.linspace(0, len(docs), num_shards + 1).astype(int)
  files, shard, record = [], [], []
  for i in range(num_shards):
    files.append(shard_name(split, i, num_shards))
    part = docs[bounds[i]:bounds[i + 1]]
    write_records(fs.join(data_dir, files[-1]), part,
                  None if masks is None else masks[bounds[i]:bounds[i + 1]])
    if progress is not None:
      progress.update(lambda: f"{split}: {i + 1} of {num_shards} shards written")
    shard += [i] * len(part)
    record += list(range(len(part)))
  index = io.BytesIO()
  np.savez(index, shard=np.asarray(shard, np.int64), record=np.asarray(record, np.int64),
           length=np.asarray([len(d) for d in docs], np.int64))
  fs.write_bytes(fs.join(data_dir, index_name(split)), index.getvalue())
  return files


def _runs(records: np.ndarray) -> list[tuple[int, int]]:
  """Sorted record numbers -> (first, count) of each run of consecutive ones."""
  breaks = np.flatnonzero(np.diff(records) != 1) + 1
  return [(int(r[0]), len(r)) for r in np.split(records, breaks)] if records.size else []


class DocumentReader:
  """Reads documents by number from one split's shards with tf.data.

  `read(doc_ids)` reads exactly the records asked for: each run of consecutive records is
  `TFRecordDataset.skip(first).take(count)`, and tf.data's skip steps over the records
  before it by their length headers (small records still pass through its read buffer).
  Documents read by the previous call are reused; `records_read` counts the records taken
  off the files so far. When the data has target masks (meta "target_mask"), `masks` holds
  those of the documents the last `read` returned, by document (else it is None).
  """

  def __init__(self, data_dir: str, split: str, field: str):
    self.meta = tokenizers.read_meta(data_dir, field)
    if split not in self.meta["splits"]:
      raise ConfigError(f"{field}={data_dir!r} has no split {split!r} (it has "
                        f"{sorted(self.meta['splits'])}); set the input's split to one of them.")
    self.data_dir, self.split = data_dir, split
    # The shards' bytes are read by tf.data (TensorFlow's own gs:// client for a bucket).
    self.files = [fs.join(data_dir, f) for f in self.meta["splits"][split]["files"]]
    with np.load(io.BytesIO(fs.read_bytes(fs.join(data_dir, index_name(split))))) as idx:
      self.shard, self.record, self.lengths = idx["shard"], idx["record"], idx["length"]
    self._cache: dict[int, np.ndarray] = {}
    self.with_masks = bool(self.meta.get("target_mask", False))
    self.masks: dict[int, np.ndarray] | None = {} if self.with_masks else None
    self.records_read = 0

  def read(self, doc_ids) -> dict[int, np.ndarray]:
    ids = sorted(set(int(d) for d in doc_ids))
    got = {d: self._cache[d] for d in ids if d in self._cache}
    masks = {d: self.masks[d] for d in got} if self.with_masks else None
    todo = np.asarray([d for d in ids if d not in got], np.int64)
    runs = [(int(self.shard[d0]), int(self.record[d0]), n, d0)  # (shard, record, count, doc)
            for s in np.unique(self.shard[todo])
            for d0, n in _runs(todo[self.shard[todo] == s])]  # documents number shard by shard
    if runs:
      tf = tensorflow()
      shards, firsts, counts, _ = (np.asarray(c, np.int64) for c in zip(*runs))
      files = tf.constant(self.files)
      spec = {k: tf.io.RaggedFeature(tf.int64)
              for k in (("tokens", "mask") if self.with_masks else ("tokens",))}
      ds = tf.data.Dataset.from_tensor_slices((shards, firsts, counts)).flat_map(
          lambda s, first, n: tf.data.TFRecordDataset(tf.gather(files, s)).skip(first).take(n))
      docs = [d0 + k for _, _, n, d0 in runs for k in range(n)]
      for d, ex in zip(docs, ds.map(lambda r: tf.io.parse_single_example(r, spec))
                       .as_numpy_iterator(), strict=True):
        got[d] = ex["tokens"].astype(np.int32)
        if self.with_masks:
          masks[d] = ex["mask"].astype(np.int32)
          if len(masks[d]) != len(got[d]):
            raise ValueError(f"{self.data_dir}: document {d} has {len(got[d])} tokens but a "
                             f"mask of {len(masks[d])}; the data dir is inconsistent.")
        self.records_read += 1
    for d, toks in got.items():
      if len(toks) != self.lengths[d]:
        raise ValueError(f"{self.data_dir}: document {d} has {len(toks)} tokens, its index "
                         f"{self.lengths[d]}; the data dir is inconsistent (prepare it again).")
      tokenizers.check_ids(toks, int(self.meta["vocab_size"]), f"{self.data_dir} document {d}")
    self._cache, self.masks = got, masks
    return got


@dataclasses.dataclass
class PackedLmInput(StepIndexedInput):
  """Packed next-token batches of a prepared corpus (see the module and `packing` docs).

  Batches: `inputs`, `targets`, `weights`, `segment_ids`, `positions`, each [rows, seq_len];
  on data with target masks (`target_mask` True) `weights` is 1 only where the target is a
  target token.
  `efficiency(step)` is batch `step`'s real tokens / row tokens (the same in every
  process); `last_batch_efficiency` is that of the batch `next` returned last.

  Attributes:
    data_dir: a prepared data dir.
    split: 'train' or 'eval'.
    batch_size: the GLOBAL batch size (rows); each process makes its contiguous slice.
    seq_len: tokens per row.
    repeat: repeat the plan forever; else one pass (the last batch may be partial).
    max_open_rows: rows first-fit may still add to (more packs tighter, plans slower).
    model: the model fed (share task.model's config); its vocab_size must be the data's.
    num_batches: None = all; else at most this many batches.
  """
  data_dir: str = ""
  split: str = "train"
  batch_size: int = 16
  seq_len: int = 256
  repeat: bool = True
  max_open_rows: int = 64
  model: object | None = None
  num_batches: int | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    self._reader = DocumentReader(self.data_dir, self.split, "datasets[...].data_dir")
    data_dirs.check_kind(self._reader.meta, self.data_dir, "datasets[...].data_dir",
                         ("chat", "text"), " (packed as documents, a pair's rejected answer "
                         "would be learned like its chosen one)")
    if self.model is not None:
      tokenizers.check_vocab(self._reader.meta, self.model.vocab_size, self.data_dir)
    self.target_mask = self._reader.with_masks  # weights mark target tokens only
    self.last_batch_efficiency = None

  @functools.cached_property
  def _plan(self) -> tuple[np.ndarray, list[list[int]]]:
    """(pieces [P, 3] as (doc, start, length), rows as piece indices): one epoch."""
    parts = packing.pieces(self._reader.lengths, self.seq_len)
    rows = packing.first_fit(parts[:, 2], self.seq_len, self.max_open_rows)
    if not rows:
      raise ConfigError(f"datasets[...].data_dir={self.data_dir!r}: split {self.split!r} has no "
                        "document of 2 or more tokens to train on.")
    logging.info("Packed %s/%s: %d documents, %d pieces -> %d rows of %d tokens; packing "
                 "efficiency %.4f (real tokens / row tokens).", self.data_dir, self.split,
                 len(self._reader.lengths), len(parts), len(rows), self.seq_len,
                 packing.efficiency(rows, parts[:, 2], self.seq_len))
    return parts, rows

  @property
  def num_examples(self) -> int | None:
    """Rows in one pass when not repeating (None: endless)."""
    return None if self.repeat else len(self._plan[1])

  def _rows(self, global_rows: np.ndarray) -> list[list[int]]:
    rows = self._plan[1]
    return [rows[int(r) % len(rows)] for r in global_rows]

  def efficiency(self, step: int) -> float:
    """Real tokens / row tokens of global batch `step`."""
    rows = step * self.batch_size + np.arange(self.batch_size)
    if self.num_examples is not None:
      rows = rows[rows < self.num_examples]
    return packing.efficiency(self._rows(rows), self._plan[0][:, 2], self.seq_len)

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch `step`."""
    parts = self._plan[0]
    rows = self._rows(self.local_rows(step))
    docs = self._reader.read(parts[[i for row in rows for i in row], 0])
    # A piece is a slice of its document (pieces of a long one overlap by a token); its mask
    # the same slice. A piece without a target still packs, with weights all 0.
    piece = lambda arrays, i: arrays[int(parts[i, 0])][parts[i, 1]:parts[i, 1] + parts[i, 2]]
    masks = self._reader.masks
    return packing.make_rows(
        [[piece(docs, i) for i in row] for row in rows], self.seq_len,
        None if masks is None else [[piece(masks, i) for i in row] for row in rows])

  def __next__(self) -> dict[str, np.ndarray]:
    step = self._step
    batch = super().__next__()
    self.last_batch_efficiency = self.efficiency(step)
    return batch

  @property
  def records_read(self) -> int:
    """Documents (TFRecord records) this process has read so far."""
    return self._reader.records_read

  def get_state(self) -> dict[str, int]:
    logging.info("PackedLmInput %s/%s: process %d of %d at batch %d has read %d records.",
                 self.data_dir, self.split, *self._where(), self._step, self.records_read)
    return super().get_state()


@dataclasses.dataclass
class TextPromptInput(StepIndexedInput):
  """Decode prompts: the first tokens of a prepared split's documents, in order.

  Batches are `{'prompts': [b, prompt_len] (left-aligned, 0-padded), 'prompt_lens': [b],
  'ids': [b]}` like `prompts.SyntheticPromptInput`; `tokenizer` turns ids back into text.
  A prompt is the document's first `prompt_len` tokens (fewer for a shorter document,
  its end-of-document id excluded).
  """
  data_dir: str = ""
  split: str = "eval"
  batch_size: int = 8
  prompt_len: int = 32
  num_examples: int = 8
  model: object | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    self._reader = DocumentReader(self.data_dir, self.split, "decode_datasets[...].data_dir")
    if self.model is not None:
      tokenizers.check_vocab(self._reader.meta, self.model.vocab_size, self.data_dir)
    available = int(np.sum(self._reader.lengths >= 2))
    if self.num_examples > available:
      raise ConfigError(f"decode_datasets[...].num_examples={self.num_examples}, but split "
                        f"{self.split!r} of {self.data_dir} has {available} usable documents.")
    self._docs = np.flatnonzero(self._reader.lengths >= 2)

  @functools.cached_property
  def tokenizer(self):
    return tokenizers.load(self.data_dir, self._reader.meta, "decode_datasets[...].data_dir")

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    ids = self.local_rows(step)
    docs = self._reader.read(self._docs[ids])
    return prompts.prompt_batch(
        ids, [docs[int(self._docs[example])][:-1][:self.prompt_len] for example in ids],
        self.prompt_len)
