"""generation_config.json of an export. transformers' `generate` stops at its eos_token_id,
so a chat model's holds the token that ends an assistant turn (found by rendering the chat
template, as spmdtask's chat data does) first, then the tokenizer's eos and those the
import's generation_config.json and config.json named; the import's other fields (its
sampling defaults) are kept.
"""
from spmdtask import fs
from spmdtask.inputs import chat as chat_lib
from spmdtask.inputs import chat_template, tokenizers


def stop_ids(tokenizer_dir: str) -> list[int]:
  """[end-of-turn id, tokenizer eos id] of a dir's chat template and tokenizer (what of
  them it has; [] without a tokenizer.json)."""
  if not fs.isfile(fs.join(tokenizer_dir, tokenizers.HF_FILE)):
    return []
  config = chat_template.read_config(tokenizer_dir)
  if fs.isfile(fs.join(tokenizer_dir, chat_template.TEMPLATE_FILE)) or config.get("chat_template"):
    chat = chat_lib.Chat.from_model_dir(tokenizer_dir, field="the export's tokenizer dir")
    return [chat.end_of_turn_id] + ([chat.eos_id] if chat.eos_id is not None else [])
  eos = chat_template.special_tokens(config).get("eos_token")
  eos_id = tokenizers.HfTokenizer(fs.join(tokenizer_dir, tokenizers.HF_FILE)).token_id(eos) \
      if eos else None
  return [eos_id] if eos_id is not None else []


def generation_config(cfg: dict, tokenizer_dir: str, previous: dict | None) -> dict:
  """generation_config.json for the model of HF config `cfg` whose tokenizer files are in
  `tokenizer_dir`; `previous`: the import's generation_config.json, if it had one."""
  out = dict(previous or {})
  ids = stop_ids(tokenizer_dir)
  for named in (out.get("eos_token_id"), cfg.get("eos_token_id")):
    ids += named if isinstance(named, list) else [named] if isinstance(named, int) else []
  ids = list(dict.fromkeys(ids))
  if ids:
    out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
  for key in ("bos_token_id", "pad_token_id"):
    if key not in out and isinstance(cfg.get(key), int):
      out[key] = cfg[key]
  return out
