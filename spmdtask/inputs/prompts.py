"""Prompt inputs for --mode=decode: synthetic ones, deterministic per (seed, example), the
texts a person gives (`--prompt`, `--prompts_file`) through a tokenizer, and conversations
rendered with a prepared chat data dir's template."""
import dataclasses

import numpy as np

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.inputs import chat, records, tokenizers
from spmdtask.core.host_input import StepIndexedInput


@dataclasses.dataclass
class SyntheticPromptInput(StepIndexedInput):
  """Prompts that count up from a random start by a random stride, of random length.

  Each batch is `{'prompts': [b, prompt_len] int32 (left-aligned, 0-padded),
  'prompt_lens': [b] int32, 'ids': [b] int32 (the example number)}`. The last batch
  may be partial: a process yields only its rows below `num_examples`.

  Attributes:
    batch_size: the GLOBAL batch size; each process yields its contiguous slice.
    prompt_len: the padded prompt length; each prompt has min_prompt_len..prompt_len tokens.
    min_prompt_len: the shortest prompt.
    vocab_size: tokens are in [0, vocab_size).
    num_examples: prompts in all; the input ends after them.
    seed: with the example id, fixes every prompt.
    tokenizer: None, an object with `decode(ids) -> str` used for text output, or a
      tokenizer spec (`tokenizers.from_spec`: 'hf:PATH/tokenizer.json', ...).
    model: None, or the model fed (share task.model's config): its vocab_size is the
      prompts' (not `vocab_size`).
  """
  batch_size: int = 8
  prompt_len: int = 8
  min_prompt_len: int = 2
  vocab_size: int = 256
  num_examples: int = 16
  seed: int = 0
  tokenizer: object | None = None
  model: object | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    if self.model is not None:
      self.vocab_size = self.model.vocab_size
    if isinstance(self.tokenizer, str):
      self.tokenizer = tokenizers.from_spec(self.tokenizer,
                                            field="decode_datasets[...].tokenizer")

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of batch `step` (fewer, or none, in a partial last batch)."""
    ids = self.local_rows(step)
    return prompt_batch(ids, [self._prompt(int(example)) for example in ids], self.prompt_len)

  def _prompt(self, example: int) -> np.ndarray:
    g = np.random.default_rng((self.seed, example))
    n = int(g.integers(self.min_prompt_len, self.prompt_len + 1))
    start, stride = g.integers(0, self.vocab_size), g.integers(1, 8)
    return (start + stride * np.arange(n)) % self.vocab_size


@dataclasses.dataclass
class TokenizedPrompts(StepIndexedInput):
  """Given prompts, one row each in order (example id = the prompt's index), encoded by
  `tokenizer` (`encode(text) -> ids`, `decode(ids) -> text`); with `chat` (a `chat.Chat`)
  each is one user message rendered with its template and generation prompt instead, and
  `tokenizer` becomes the chat's, decoding special tokens too (as `ChatPromptInput`).

  Batches are like `SyntheticPromptInput`'s, `prompt_len` the longest prompt's tokens.
  """
  texts: tuple[str, ...] = ()
  tokenizer: object | None = None
  batch_size: int = 8
  chat: object | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    if self.chat is not None:
      self.tokenizer = self.chat.tokenizer.with_special_tokens()
      self.token_ids = [self.chat.prompt_ids([{"role": "user", "content": t}],
                                             f"--prompt {i}: ")
                        for i, t in enumerate(self.texts)]
    else:
      self.token_ids = [list(self.tokenizer.encode(t)) for t in self.texts]
    self.num_examples = len(self.texts)
    self.prompt_len = max(map(len, self.token_ids), default=1)

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    ids = self.local_rows(step)
    return prompt_batch(ids, [self.token_ids[int(example)] for example in ids], self.prompt_len)


@dataclasses.dataclass
class ChatPromptInput(StepIndexedInput):
  """Conversations as decode prompts: each line of `prompts_file` (`{"messages": [...]}`, the
  last message not the assistant's) rendered with the chat template of `data_dir` (a dir of
  tools/prepare_chat_data.py) and its generation prompt, one row each in order.

  Batches are like `SyntheticPromptInput`'s, `prompt_len` the longest prompt's tokens;
  `tokenizer` turns output ids back into text, special tokens kept (the prompt as rendered,
  a reply's end-of-turn token). `end_of_turn_id` is the template's: decoding
  stops a row there when task.decode.eos_id is set to it (prepare_chat_data prints the flag).
  """
  data_dir: str = ""
  prompts_file: str = ""
  batch_size: int = 8
  model: object | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    field = "decode_datasets[...].data_dir"
    meta = tokenizers.read_meta(self.data_dir, field)
    if self.model is not None:
      tokenizers.check_vocab(meta, self.model.vocab_size, self.data_dir)
    conv = chat.Chat.from_data_dir(self.data_dir, meta, field)
    self.tokenizer = conv.tokenizer.with_special_tokens()
    self.end_of_turn_id = conv.end_of_turn_id
    if not self.prompts_file or not fs.glob(self.prompts_file):
      raise ConfigError(f"decode_datasets[...].prompts_file={self.prompts_file!r} names no "
                        'file; give a JSONL file of {"messages": [...]} a line.')
    self.token_ids = [conv.prompt_ids(chat.prompt_messages(record, where), where)
                      for where, record in records.read(
                          self.prompts_file, "decode_datasets[...].prompts_file")]
    if not self.token_ids:
      raise ConfigError(f"decode_datasets[...].prompts_file={self.prompts_file!r} holds no "
                        'conversation; write {"messages": [...]} a line.')
    self.num_examples = len(self.token_ids)
    self.prompt_len = max(map(len, self.token_ids))

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    ids = self.local_rows(step)
    return prompt_batch(ids, [self.token_ids[int(example)] for example in ids], self.prompt_len)


def prompt_batch(ids: np.ndarray, rows, prompt_len: int) -> dict[str, np.ndarray]:
  """The decode batch of examples `ids` whose prompts are `rows` (token ids, each at most
  `prompt_len`): prompts left-aligned and 0-padded, their lengths, the ids."""
  prompts = np.zeros((len(ids), prompt_len), np.int32)
  lens = np.zeros((len(ids),), np.int32)
  for i, toks in enumerate(rows):
    prompts[i, :len(toks)], lens[i] = toks, len(toks)
  return {"prompts": prompts, "prompt_lens": lens, "ids": ids.astype(np.int32)}
