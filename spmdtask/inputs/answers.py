"""Prompts with a reference answer, for GRPO: a prompts data dir (`PromptData`), a JSONL
file (`AnswerPrompts`), or synthetic sums.

AnswerPrompts' JSONL line is one example: `{"prompt": P, "answer": A}`, P a string (encoded
as is by `tokenizer`, as TRL takes a plain prompt) or a list of messages (rendered with the
chat template of `data_dir`, a dir of tools/prepare_chat_data.py, generation prompt on); A a
string or a number (what the rewards compare against). A prompts data dir renders both
kinds with the model's template when prepared (`inputs.prompt_data`).

Batches are decode batches (`spmdtask.inputs.prompts.prompt_batch`) plus the answers:
`{'prompts' [b, prompt_len] int32, 'prompt_lens' [b], 'ids' [b], 'answers' [b] object}`;
each process reads its rows of every batch; the input repeats (epoch after epoch).
`tokenizer.decode` gives the rewards the prompts' and completions' text.
"""
import dataclasses

import numpy as np

from spmdtask.errors import ConfigError
from spmdtask.inputs import chat, prompt_data, records, tokenizers
from spmdtask.inputs.prompts import prompt_batch
from spmdtask.core.host_input import StepIndexedInput


class _AnswerRows(StepIndexedInput):
  """Rows `token_ids[i]` with `answers[i]`, repeated over epochs; `stop_ids` end a completion
  (where the objective names none)."""
  token_ids: list
  answers: list
  stop_ids: tuple[int, ...] = ()

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    rows = self.local_rows(step)
    examples = rows % len(self.token_ids)
    batch = prompt_batch(rows, [self.token_ids[int(e)] for e in examples], self.prompt_len)
    batch["answers"] = np.empty(len(examples), object)  # any JSON value, as the rewards get it
    batch["answers"][:] = [self.answers[int(e)] for e in examples]
    return batch


@dataclasses.dataclass
class PromptData(_AnswerRows):
  """A prompts data dir (tools/prepare_prompt_data.py; `--data_dir` sets `data_dir`): its
  prompts, rendered with the model's chat template, in file order, repeated; each answer any
  JSON value; `stop_ids` from its meta.json (eos and the template's end-of-turn). `model`
  (share task.model's config): its vocab_size must be the data's."""
  data_dir: str = ""
  batch_size: int = 8
  model: object | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    field = "datasets['train'].data_dir"
    self.token_ids, self.answers, meta = prompt_data.read(self.data_dir, field)
    if self.model is not None:
      tokenizers.check_vocab(meta, self.model.vocab_size, self.data_dir)
    # special tokens kept: the rewards read the prompt as the template rendered it
    self.tokenizer = tokenizers.load(self.data_dir, meta, field).with_special_tokens()
    self.stop_ids = tuple(meta["stop_ids"])
    self.num_examples = None  # repeats
    self.prompt_len = max(map(len, self.token_ids))


@dataclasses.dataclass
class AnswerPrompts(_AnswerRows):
  """Prompts and answers from `path` (JSONL, see the module). `tokenizer`: a spec
  ('bytes', 'hf:PATH/tokenizer.json', ...) for string prompts; `data_dir`: a prepared chat
  data dir whose template and tokenizer render message prompts (and encode string ones)."""
  path: str = ""
  batch_size: int = 8
  tokenizer: object | None = None
  data_dir: str = ""
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    field = "datasets['train']"
    conv = None
    if self.data_dir:
      meta = tokenizers.read_meta(self.data_dir, f"{field}.data_dir")
      conv = chat.Chat.from_data_dir(self.data_dir, meta, f"{field}.data_dir")
      self.tokenizer = conv.tokenizer.with_special_tokens()
      self.stop_ids = tuple(dict.fromkeys(
          i for i in (conv.end_of_turn_id, conv.eos_id) if i is not None))
    elif isinstance(self.tokenizer, str):
      self.tokenizer = tokenizers.from_spec(self.tokenizer, field=f"{field}.tokenizer")
    if self.tokenizer is None:
      raise ConfigError(f"{field}.tokenizer is None: GRPO's rewards read text. Name the "
                        "tokenizer ('bytes', 'hf:PATH/tokenizer.json') or a chat data_dir.")
    self.token_ids, self.answers = [], []
    for where, record in records.read(self.path, f"{field}.path") if self.path else ():
      prompt, answer = _parse(record, where)
      if isinstance(prompt, list):
        if conv is None:
          raise ConfigError(f"{where}the prompt is a list of messages, which needs a chat "
                            f"template: set {field}.data_dir to a prepared chat data dir "
                            "(tools/prepare_chat_data.py), or give the prompt as a string.")
        ids = conv.prompt_ids(chat.prompt_messages({"messages": prompt}, where), where)
      else:
        ids = list(self.tokenizer.encode(prompt))
      if not ids:
        raise ConfigError(f"{where}the prompt is empty; give a non-empty prompt.")
      self.token_ids.append(ids)
      self.answers.append(answer)
    if not self.token_ids:
      raise ConfigError(f"{field}.path={self.path!r} holds no example; give a JSONL file of "
                        '{"prompt": ..., "answer": ...} a line.')
    self.num_examples = None  # repeats
    self.prompt_len = max(map(len, self.token_ids))


def _parse(record: dict, where: str):
  if "prompt" not in record or "answer" not in record:
    raise ConfigError(f'{where}needs "prompt" (a string or a list of messages) and "answer"; '
                      f"it has {sorted(record)}.")
  prompt = record["prompt"]
  if not isinstance(prompt, (str, list)):
    raise ConfigError(f'{where}"prompt" is a {type(prompt).__name__}; give a string or a list '
                      "of messages.")
  return prompt, str(record["answer"])


@dataclasses.dataclass
class SumPrompts(_AnswerRows):
  """Synthetic prompts 'a+b=' (bytes) with the answer a+b, a and b in [0, max_operand],
  `num_examples_per_epoch` draws from `seed`, repeated; rows padded to at least
  `min_prompt_len` (a plan's prompt shape)."""
  batch_size: int = 8
  max_operand: int = 9
  num_examples_per_epoch: int = 256
  seed: int = 0
  min_prompt_len: int = 0
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    self.tokenizer = tokenizers.ByteTokenizer()
    g = np.random.default_rng(self.seed)
    pairs = g.integers(0, self.max_operand + 1, size=(self.num_examples_per_epoch, 2))
    self.token_ids = [self.tokenizer.encode(f"{a}+{b}=") for a, b in pairs]
    self.answers = [str(a + b) for a, b in pairs]
    self.num_examples = None
    self.prompt_len = max(self.min_prompt_len, *map(len, self.token_ids))


@dataclasses.dataclass
class SumSft(StepIndexedInput):
  """Supervised rows for warm-starting a model on `SumPrompts`' task: 'a+b=' then the sum
  and the end-of-document byte id (256) as targets, `weights` 1 on those only; a and b drawn
  per (seed, row) in [0, max_operand], rows 0-padded to `seq_len`."""
  batch_size: int = 16
  seq_len: int = 8
  max_operand: int = 9
  seed: int = 1
  num_examples: int | None = None
  process_index: int | None = None
  process_count: int | None = None
  target_mask = True

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    rows = self.local_rows(step)
    tok = tokenizers.ByteTokenizer()
    tokens = np.zeros((len(rows), self.seq_len + 1), np.int32)
    weights = np.zeros((len(rows), self.seq_len), np.float32)
    for i, row in enumerate(rows):
      a, b = np.random.default_rng((self.seed, int(row))).integers(0, self.max_operand + 1, 2)
      prompt, answer = tok.encode(f"{a}+{b}="), tok.encode(str(a + b)) + [tok.eod_id]
      ids = (prompt + answer)[:self.seq_len + 1]
      tokens[i, :len(ids)] = ids
      weights[i, len(prompt) - 1:len(ids) - 1] = 1.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}
