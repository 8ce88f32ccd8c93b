"""GRPO's prompts: a JSONL file of prompts with answers -> a prompts data dir, and back.

A record (`inputs.records`: a JSONL line, a Parquet row, a saved dataset's row) is one
example, `{"prompt": P, "answer": A}`:
- P a list of messages (OpenAI or ShareGPT, normalized by `inputs.conversation`), rendered with the model's chat template and its generation prompt, as
  TRL renders a conversational prompt;
- or P a string: one user message, rendered likewise (`raw`: the string encoded as is,
  with the tokenizer's own special tokens, as TRL takes a plain-text prompt);
- A any JSON value (absent: null), handed to the rewards as it is.

The data dir (`write`):
  meta.json          {"kind": "prompts", "tokenizer": "hf", "vocab_size", "eod_id",
                      "stop_ids" (eos, the template's end-of-turn, the model's eos ids),
                      "chat": {end_of_turn_id, template_source, special_tokens} (with a
                      template),
                      "raw", "num_prompts", "longest", "max_prompt_len", "dropped", ...}
  prompts.jsonl      one line per prompt: {"ids": [...], "answer": A}
  tokenizer.json, chat_template.jinja (the model's, as rendered with)
`read` gives (ids, answers, meta) back; `inputs.answers.PromptData` feeds them to GRPO.

`--tokenizer` (`model_chat`) is a Hugging Face model dir (tokenizer.json, its chat template,
config.json's eos ids) or the job dir of an import (tools/convert_hf.py --from_hf: its
tokenizer files and hf_source.json; the template from the model dir it was imported from
where the job dir holds none).
"""
import json
import os

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.inputs import chat, chat_template, conversation, data_dirs, records, tokenizers

KIND = "prompts"
PROMPTS_FILE = "prompts.jsonl"
HF_SOURCE = "hf_source.json"  # what tools/convert_hf.py --from_hf writes into its job dir


def _has_template(model_dir: str) -> bool:
  return (fs.isfile(fs.join(model_dir, chat_template.TEMPLATE_FILE))
          or "chat_template" in chat_template.read_config(model_dir))


def _config_eos(config: dict) -> list[int]:
  eos = config.get("eos_token_id")
  return [eos] if isinstance(eos, int) else [e for e in eos or () if isinstance(e, int)]


def model_chat(path: str, raw: bool = False, field: str = "--tokenizer"
               ) -> tuple[chat.Chat | None, tokenizers.HfTokenizer, list[int]]:
  """(the chat of `path`, its tokenizer, the model's eos ids from config.json /
  generation_config.json). `path`: a Hugging Face model dir or an import's job dir. With
  `raw` a dir without a chat template gives chat None."""
  if not fs.isfile(fs.join(path, tokenizers.HF_FILE)):
    raise ConfigError(f"{field}={path!r} holds no {tokenizers.HF_FILE}; give a Hugging Face "
                      "model dir (tokenizer.json and its chat template) or the job dir of "
                      "tools/convert_hf.py --from_hf.")
  eos, template_dir = [], path
  for name in ("config.json", "generation_config.json"):
    if fs.isfile(fs.join(path, name)):
      eos += _config_eos(json.loads(fs.read_text(fs.join(path, name))))
  if fs.isfile(fs.join(path, HF_SOURCE)):  # an import's job dir
    source = json.loads(fs.read_text(fs.join(path, HF_SOURCE)))
    eos += _config_eos(source.get("config", {}))
    origin = source.get("base_model_name_or_path") or ""
    if not _has_template(path) and origin and fs.isdir(origin) and _has_template(origin):
      template_dir = origin
  tok = tokenizers.HfTokenizer(fs.join(path, tokenizers.HF_FILE))
  if raw and not _has_template(template_dir):
    return None, tok, eos
  template = chat_template.load(template_dir, field)
  if template_dir != path:  # the job dir's own tokenizer_config names its special tokens
    template.special_tokens.update(chat_template.special_tokens(chat_template.read_config(path)))
  return chat.Chat(template, tok), tok, eos


def stop_ids(conv: chat.Chat | None, tok: tokenizers.HfTokenizer,
             model_eos: list[int]) -> list[int]:
  """The ids that end a completion, each once: the template's end-of-turn, the tokenizer's
  eos, the model's configured eos ids (as transformers' generate stops at any of them)."""
  ids = [] if conv is None else [conv.end_of_turn_id, conv.eos_id]
  ids += [tok.eod_id] + list(model_eos)
  return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _messages(value: list, where: str) -> list[dict]:
  messages = conversation.normalize(value, where, "prompt")
  if messages[-1]["role"] == "assistant":
    raise ConfigError(f"{where}the prompt ends with an assistant message; a GRPO prompt ends "
                      "where the model is to answer (drop the last message).")
  return messages


def parse(record: dict, where: str) -> tuple[str | list[dict], object]:
  """(the prompt: a string or normalized messages, the answer) of one record
  (`records.read`); ConfigError naming `where` ('FILE:LINE: ')."""
  if "prompt" not in record:
    raise ConfigError(f'{where}has no "prompt" (it has {sorted(record)}); write '
                      '{"prompt": "..." or [messages], "answer": ...}.')
  prompt = record["prompt"]
  if isinstance(prompt, str):
    if not prompt:
      raise ConfigError(f"{where}the prompt is empty; give its text.")
    return prompt, record.get("answer")
  if isinstance(prompt, list) and prompt:
    return _messages(prompt, where), record.get("answer")
  shown = "null" if prompt is None else "an empty list" if prompt == [] else type(prompt).__name__
  raise ConfigError(f'{where}"prompt" is {shown}; give a string or a non-empty list of '
                    "messages.")


def encode(prompt: str | list[dict], conv: chat.Chat | None, tok: tokenizers.HfTokenizer,
           raw: bool, where: str) -> list[int]:
  """A prompt's token ids: messages (a string: one user message) rendered with the chat
  template and its generation prompt; with `raw` a string as is."""
  if isinstance(prompt, str) and raw:
    return tok.encode(prompt)
  if conv is None:
    raise ConfigError(f"{where}the prompt is a list of messages, and --tokenizer has no chat "
                      "template to render it; give a chat model's dir, or a string prompt.")
  messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
  return conv.prompt_ids(messages, where)


def encode_all(source: str, conv: chat.Chat | None, tok: tokenizers.HfTokenizer, raw: bool,
               max_prompt_len: int | None, progress=None) -> dict:
  """Every record of `source` (`records.read`: JSONL, Parquet, a saved dataset) as token ids
  with its answer; a prompt over `max_prompt_len` tokens is dropped and counted; ConfigError
  for the first bad record. `progress` (a console.Progress) is updated per record. Returns
  {'ids', 'answers', 'read', 'dropped', 'plain', 'no_answer'}."""
  out = {"ids": [], "answers": [], "read": 0, "dropped": 0, "plain": 0, "no_answer": 0}
  for where, record in records.read(source):
    out["read"] += 1
    if progress is not None:
      progress.update(lambda: f"{out['read']} records read, "
                      f"{len(out['ids'])} kept")
    prompt, answer = parse(record, where)
    ids = encode(prompt, conv, tok, raw, where)
    out["plain"] += isinstance(prompt, str)
    out["no_answer"] += answer is None
    if max_prompt_len is not None and len(ids) > max_prompt_len:
      out["dropped"] += 1
    else:
      out["ids"].append(ids)
      out["answers"].append(answer)
  if not out["read"]:
    raise ConfigError(f"--input={source!r} holds no prompt; write one JSON object a line: "
                      '{"prompt": ..., "answer": ...}.')
  if not out["ids"]:
    raise ConfigError(f"--input={source!r}: all {out['read']} prompts are longer than "
                      f"--max_prompt_len={max_prompt_len} tokens; raise it (the model's "
                      "max_seq_len must hold a prompt and its completion).")
  return out


def read(data_dir: str, field: str) -> tuple[list[list[int]], list, dict]:
  """(ids, answers, meta) of a prompts data dir; ConfigError naming `field` for another
  kind of dir."""
  meta = tokenizers.read_meta(data_dir, field)
  data_dirs.check_kind(meta, data_dir, field, (KIND,),
                       " (GRPO samples completions of prompts)")
  ids, answers = [], []
  for line in fs.read_text(fs.join(data_dir, PROMPTS_FILE)).splitlines():
    row = json.loads(line)
    ids.append(row["ids"])
    answers.append(row["answer"])
  return ids, answers, meta


def write(output_dir: str, ids: list[list[int]], answers: list, conv: chat.Chat | None,
          tok: tokenizers.HfTokenizer, meta: dict) -> dict:
  """Writes the data dir into local `output_dir` (tokenizer and template copied from the
  model); returns meta.json's contents (`meta` plus the tokenizer's and counts)."""
  fs.write_bytes(os.path.join(output_dir, tokenizers.HF_FILE), fs.read_bytes(tok.model_file))
  chat_meta = {}  # none without a template (--raw): readers take "chat" for a template
  if conv is not None:
    fs.write_text(os.path.join(output_dir, chat_template.TEMPLATE_FILE), conv.template.source)
    chat_meta = {"chat": {"end_of_turn_id": conv.end_of_turn_id,
                          "template_source": conv.template.origin,
                          "special_tokens": conv.template.special_tokens}}
  eod = meta["stop_ids"][0] if meta["stop_ids"] else 0  # 0: no stop id (runs to the limit)
  meta = {"kind": KIND, "tokenizer": "hf", "vocab_size": tok.vocab_size, "eod_id": int(eod),
          **chat_meta, **meta, "num_prompts": len(ids), "longest": max(map(len, ids))}
  with open(os.path.join(output_dir, PROMPTS_FILE), "w", encoding="utf-8") as f:
    for row, answer in zip(ids, answers):
      f.write(json.dumps({"ids": row, "answer": answer}, ensure_ascii=False) + "\n")
  with open(os.path.join(output_dir, tokenizers.META_FILE), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  return meta
