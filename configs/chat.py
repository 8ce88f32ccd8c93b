"""Config helpers for experiments that fine-tune on conversations: their train and eval data
(prepared chat data where `--data_dir` names it, else synthetic rows) and their decode
prompts (conversations from `--chat_prompts`, else the experiment's own)."""
import fiddle as fdl

from spmdtask.core import host_input
from spmdtask.errors import ConfigError
from spmdtask.inputs.prompts import ChatPromptInput
from spmdtask.inputs.text import PackedLmInput


def sft_data(data_dir: str, synthetic, packed, require_target_mask: bool = True) -> object:
  """Fine-tuning data: prepared data (`packed(data_dir=data_dir)`, a PackedLmInput partial)
  where `data_dir` is set (--data_dir sets it), else `synthetic` (a built input).

  With `require_target_mask`, ConfigError where the data dir's documents carry no target
  masks: training on every token there would silently not be supervised fine-tuning."""
  if not data_dir:
    return synthetic
  inputs = packed(data_dir=data_dir)
  if require_target_mask and not host_input.target_masked(inputs):
    raise ConfigError(f"datasets[...].data_dir={data_dir!r} holds documents without target "
                      "masks (its meta.json has no \"target_mask\": true), so every token "
                      "would be a target. Prepare conversations with tools/prepare_chat_data.py "
                      "for this experiment; to train on plain text on purpose, set "
                      "--fdl_set=datasets[...].require_target_mask=False (or use --exp=lm.TextLm "
                      "for TinyLm's model).")
  return inputs


def chat_prompts(prompts_file: str, data_dir: str, default, model=None) -> object:
  """Decode prompts: each conversation of `prompts_file` (JSONL; `--chat_prompts` sets it)
  rendered with the chat template of `data_dir` (a tools/prepare_chat_data.py dir; --data_dir
  sets it) and its generation prompt, batched as `default` (a built prompt input, used
  alone where `prompts_file` is empty)."""
  if not prompts_file:
    return default
  if not data_dir:
    raise ConfigError(f"decode_datasets[...].prompts_file={prompts_file!r} (--chat_prompts) "
                      "is rendered with the chat template of a prepared chat data dir, and "
                      "decode_datasets[...].data_dir is empty: add --data_dir=DIR, the dir "
                      "tools/prepare_chat_data.py wrote (the one the job trained on).")
  return ChatPromptInput(data_dir=data_dir, prompts_file=prompts_file,
                         batch_size=default.batch_size, model=model)


def in_model_vocab(sets: dict, model) -> dict:
  """`sets` (synthetic input configs by name) drawing tokens in the vocabulary of `model` (a
  shared config), so an import's model_overrides.txt sets the model's alone."""
  for cfg in sets.values():
    cfg.model = model
    del cfg.vocab_size  # the model's wins (inputs' `model` field)
  return sets


def with_data_dir(sets: dict, model, batch_size: int, seq_len: int,
                  require_target_mask: bool) -> dict:
  """`sets` ('train', 'eval': synthetic input configs) as `sft_data` configs: `--data_dir`
  (their `data_dir` field) switches both to a prepared dir's packed rows (eval: the whole
  of its eval split; task.train.eval_steps, or datasets['eval'].packed.num_batches, caps
  it), whose meta.json vocabulary `model` (a shared config) must match."""
  def packed(split, **kw):
    return fdl.Partial(PackedLmInput, split=split, batch_size=batch_size, seq_len=seq_len,
                       model=model, **kw)
  return {"train": fdl.Config(sft_data, data_dir="", synthetic=sets["train"],
                              packed=packed("train"), require_target_mask=require_target_mask),
          "eval": fdl.Config(sft_data, data_dir="", synthetic=sets["eval"],
                             packed=packed("eval", repeat=False),
                             require_target_mask=require_target_mask)}


def with_chat_prompts(sets: dict, model) -> dict:
  """`sets` ('prompts': a prompt input config) as a `chat_prompts` config: `--chat_prompts`
  (its `prompts_file`) and `--data_dir` turn it into the conversations of that file."""
  return {"prompts": fdl.Config(chat_prompts, prompts_file="", data_dir="",
                                default=sets["prompts"], model=model)}
