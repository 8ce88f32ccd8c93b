"""Turns JSONL conversations into a prepared data dir: tokens and a target mask per document.

    python tools/prepare_chat_data.py --input='/data/chats/*.jsonl' \
        --tokenizer=/models/Llama-3.1-8B-Instruct --output_dir=/data/chats_l31 --max_len=2048

Each line is one conversation (`{"messages": [...]}`, roles system, user, assistant, tool)
or a prompt/completion pair (`{"prompt": ..., "completion": ...}`, both lists of messages
or both strings). It is rendered with the --tokenizer dir's own chat template
(chat_template.jinja, or `chat_template` in tokenizer_config.json) as transformers renders
it, tokenized with its tokenizer.json, and masked: the assistant turns (text and
end-of-turn token) are targets, the rest context (spmdtask.inputs.chat). A conversation of
more than --max_len tokens is dropped or cut (--overlong). Conversations are shuffled once
(--seed), the first --eval_fraction become the eval split.

The output dir has prepare_text_data.py's layout plus a `mask` beside each document's
`tokens`, `chat_template.jinja`, and meta.json's "target_mask": true and "chat"
(end_of_turn_id, template_source, special_tokens). Any bad line stops the tool (exit 2)
before anything is written; an existing prepared dir is never overwritten.
"""
import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.inputs import chat, chat_template, text, tokenizers
from tools.prepare_text_data import check_new_output_dir, split_documents, write_staged


def encode_all(pattern: str, conv: chat.Chat, max_len: int, overlong: str) -> dict:
  """Every line of the files matching `pattern` as (ids, mask), overlong ones dropped or
  cut; ConfigError (naming FILE:LINE) for the first bad line. Returns {'docs', 'masks',
  'dropped', 'truncated', 'no_target_after_cut'}."""
  lines = chat.read_jsonl(pattern)
  if not lines:
    raise ConfigError(f"--input={pattern!r} matches no non-empty JSONL line; give files of "
                      'one conversation a line ({"messages": [...]}).')
  out = {"docs": [], "masks": [], "dropped": 0, "truncated": 0, "no_target_after_cut": 0}
  for where, line in lines:
    ids, mask = chat.parse(line, where).encode(conv, where)
    if len(ids) > max_len:
      if overlong == "drop":
        out["dropped"] += 1
        continue
      ids, mask = ids[:max_len], mask[:max_len]
      out["truncated"] += 1
      if not mask[1:].any():  # the cut left only context: nothing to learn
        out["no_target_after_cut"] += 1
        continue
    out["docs"].append(ids.tolist())
    out["masks"].append(mask.tolist())
  return out


def prepare(pattern: str, model_dir: str, output_dir: str, max_len: int, overlong: str = "drop",
            eval_fraction: float = 0.05, num_shards: int = 4, seed: int = 0,
            end_of_turn_token: str | None = None) -> dict:
  """Writes the data dir (local, or gs:// through a local stage); returns meta.json's
  contents. Everything is read and checked before the first file is written."""
  check_new_output_dir(output_dir)
  if max_len < 2:
    raise ConfigError(f"--max_len={max_len}: a conversation needs at least 2 tokens; give "
                      "the row length you will train with (e.g. --max_len=2048).")
  conv = chat.Chat.from_model_dir(model_dir, end_of_turn_token)
  enc = encode_all(pattern, conv, max_len, overlong)
  if len(enc["docs"]) < 2:
    raise ConfigError(f"--input={pattern!r} leaves {len(enc['docs'])} conversation(s) after "
                      f"--max_len={max_len} (--overlong={overlong}); a train and an eval split "
                      "need at least 2. Raise --max_len or add conversations.")
  return write_staged(output_dir, lambda local: _write(
      local, enc, conv, pattern, model_dir, max_len, overlong, eval_fraction, num_shards, seed))


def _write(output_dir, enc, conv, pattern, model_dir, max_len, overlong, eval_fraction,
           num_shards, seed) -> dict:
  train_ids, eval_ids = split_documents(len(enc["docs"]), eval_fraction, seed)
  splits = {}
  for name, ids in (("train", train_ids), ("eval", eval_ids)):
    docs, masks = [enc["docs"][i] for i in ids], [enc["masks"][i] for i in ids]
    files = text.write_split(output_dir, name, docs,
                             num_shards if name == "train" else max(1, num_shards // 4), masks)
    splits[name] = {"files": files, "num_documents": len(docs),
                    "num_tokens": int(sum(map(len, docs))),
                    "num_target_tokens": int(sum(sum(m[1:]) for m in masks))}
  meta = {**write_chat_files(output_dir, conv, model_dir),
          "input": pattern, "seed": seed, "eval_fraction": eval_fraction, "splits": splits,
          "max_len": max_len, "overlong": overlong, "dropped": enc["dropped"],
          "truncated": enc["truncated"], "no_target_after_cut": enc["no_target_after_cut"]}
  with open(os.path.join(output_dir, tokenizers.META_FILE), "w") as f:
    json.dump(meta, f, indent=1)
  return meta


def write_chat_files(output_dir: str, conv: chat.Chat, model_dir: str) -> dict:
  """Copies the model's tokenizer and writes the chat template into `output_dir`; returns
  the meta.json fields every chat data dir has (tokenizer, vocabulary, end ids, template)."""
  fs.write_bytes(os.path.join(output_dir, tokenizers.HF_FILE),
                 fs.read_bytes(fs.join(model_dir, tokenizers.HF_FILE)))
  with open(os.path.join(output_dir, chat_template.TEMPLATE_FILE), "w", encoding="utf-8") as f:
    f.write(conv.template.source)
  eod = conv.eos_id if conv.eos_id is not None else conv.end_of_turn_id
  return {"tokenizer": "hf", "vocab_size": conv.tokenizer.vocab_size, "eod_id": int(eod),
          "target_mask": True,
          "chat": {"end_of_turn_id": conv.end_of_turn_id, "template_source": conv.template.origin,
                   "special_tokens": conv.template.special_tokens}}


def train_command(output_dir: str, meta: dict) -> str:
  """A command that trains on `output_dir` (masked rows) and stops decoding at the end of
  an assistant turn, as a shell runs it from any dir."""
  data_dir = output_dir if "://" in output_dir else os.path.abspath(output_dir)
  job = data_dir.rstrip("/") + "_sft"
  return " ".join(["python -m spmdtask.main --exp=lm.TinyLmSft",
                   f"--job_log_dir={shlex.quote(job)}", f"--data_dir={shlex.quote(data_dir)}",
                   f"--fdl_set=task.model.vocab_size={meta['vocab_size']}",
                   f"--fdl_set=task.decode.eos_id={meta['chat']['end_of_turn_id']}"])


def report(output_dir: str, meta: dict) -> str:
  counts = ", ".join(f"{k}: {v['num_documents']} documents, {v['num_tokens']} tokens "
                     f"({v['num_target_tokens']} targets)" for k, v in meta["splits"].items())
  cut = (f"; {meta['truncated']} cut to {meta['max_len']} tokens"
         + (f" ({meta['no_target_after_cut']} of them left without a target: dropped)"
            if meta["no_target_after_cut"] else "")) if meta["truncated"] else ""
  return (f"{output_dir}: vocab_size={meta['vocab_size']}, end_of_turn_id="
          f"{meta['chat']['end_of_turn_id']}; {counts}; {meta['dropped']} conversations "
          f"over --max_len={meta['max_len']} dropped{cut}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--input", required=True, help="glob of JSONL files, a conversation a line")
  parser.add_argument("--tokenizer", required=True,
                      help="a Hugging Face model dir: tokenizer.json and its chat template "
                      "(chat_template.jinja or tokenizer_config.json's chat_template)")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--max_len", type=int, required=True,
                      help="the longest conversation kept, in tokens (the row length)")
  parser.add_argument("--overlong", choices=("drop", "truncate"), default="drop",
                      help="what to do with a longer conversation")
  parser.add_argument("--end_of_turn_token", default=None,
                      help="the token ending an assistant turn (default: found in the template)")
  parser.add_argument("--eval_fraction", type=float, default=0.05)
  parser.add_argument("--num_shards", type=int, default=4, help="train shards")
  parser.add_argument("--seed", type=int, default=0, help="conversation shuffle seed")
  args = parser.parse_args(argv)
  try:
    meta = prepare(args.input, args.tokenizer, args.output_dir, args.max_len, args.overlong,
                   args.eval_fraction, args.num_shards, args.seed, args.end_of_turn_token)
  except ConfigError as e:
    print(f"prepare_chat_data: config error: {e}", file=sys.stderr)
    sys.exit(2)
  print(report(args.output_dir, meta))
  print("Train on it:\n  " + train_command(args.output_dir, meta))


if __name__ == "__main__":
  main()
