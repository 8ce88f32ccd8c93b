"""Turns conversations into a prepared data dir: tokens and a target mask per document.

    python tools/prepare_chat_data.py --input='/data/chats/*.jsonl' \
        --tokenizer=/models/Llama-3.1-8B-Instruct --output_dir=/data/chats_l31 --max_len=2048

--input is JSONL files (a glob), Parquet files (*.parquet) or a dir written by datasets'
save_to_disk (spmdtask.inputs.records). Each record is one conversation (`{"messages":
[...]}` in OpenAI's form, content parts and tool calls included, or ShareGPT's
`{"conversations": [{"from", "value"}, ...]}`) or a prompt/completion pair (`{"prompt": ...,
"completion": ...}`, both lists of messages or both strings). It is rendered with the
--tokenizer dir's own chat template (chat_template.jinja, or `chat_template` in
tokenizer_config.json) as transformers renders it, tokenized with its tokenizer.json, and
masked: the assistant turns (text and end-of-turn token) are targets, the rest context
(spmdtask.inputs.chat). Turns after the last assistant reply are dropped and counted. A
conversation of more than --max_len tokens is dropped or cut (--overlong). Conversations
are shuffled once (--seed), the first --eval_fraction become the eval split.

The output dir has prepare_text_data.py's layout plus a `mask` beside each document's
`tokens`, `chat_template.jinja`, and meta.json's "kind": "chat", "target_mask": true and
"chat" (end_of_turn_id, template_source, special_tokens). Any bad record stops the tool
(exit 2) before anything is written; a non-empty --output_dir is refused, a prepared one
replaced only with --overwrite.
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
from spmdtask import console, fs
from spmdtask.errors import ConfigError
from spmdtask.hf import model_overrides
from spmdtask.inputs import chat, chat_template, data_dirs, records, text, tokenizers
from tools.prepare_text_data import split_documents


def encode_all(source: str, conv: chat.Chat, max_len: int, overlong: str,
               progress: console.Progress) -> dict:
  """Every record of `source` (records.read) as (ids, mask), overlong ones dropped or cut;
  ConfigError (naming FILE:LINE or FILE:row N) for the first bad record. Returns {'docs',
  'masks', 'read', 'trailing', 'dropped', 'truncated', 'no_target_after_cut'}."""
  out = {"docs": [], "masks": [], "read": 0, "trailing": 0, "dropped": 0, "truncated": 0,
         "no_target_after_cut": 0}
  for where, record in records.read(source):
    out["read"] += 1
    progress.update(lambda: f"{out['read']} records read, {len(out['docs'])} kept")
    example = chat.example(record, where)
    out["trailing"] += example.trailing > 0
    ids, mask = example.encode(conv, where)
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
  if not out["read"]:
    raise ConfigError(f"--input={source!r} holds no record; give conversations, one a "
                      'line ({"messages": [...]}) or a row.')
  return out


def prepare(pattern: str, model_dir: str, output_dir: str, max_len: int, overlong: str = "drop",
            eval_fraction: float = 0.05, num_shards: int = 4, seed: int = 0,
            end_of_turn_token: str | None = None, overwrite: bool = False) -> dict:
  """Writes the data dir (local, or gs:// through a local stage); returns meta.json's
  contents. Everything is read and checked before the first file is written."""
  data_dirs.check_output_dir(output_dir, overwrite)
  if max_len < 2:
    raise ConfigError(f"--max_len={max_len}: a conversation needs at least 2 tokens; give "
                      "the row length you will train with (e.g. --max_len=2048).")
  conv = chat.Chat.from_model_dir(model_dir, end_of_turn_token)
  progress = console.Progress("prepare_chat_data")
  enc = encode_all(pattern, conv, max_len, overlong, progress)
  if len(enc["docs"]) < 2:
    raise ConfigError(f"--input={pattern!r} leaves {len(enc['docs'])} conversation(s) after "
                      f"--max_len={max_len} (--overlong={overlong}); a train and an eval split "
                      "need at least 2. Raise --max_len or add conversations.")
  progress.next_phase(f"all read; writing {len(enc['docs'])} conversations to {output_dir}")
  return data_dirs.write(output_dir, lambda local: _write(
      local, enc, conv, pattern, model_dir, max_len, overlong, eval_fraction, num_shards, seed,
      progress), overwrite)


def _write(output_dir, enc, conv, pattern, model_dir, max_len, overlong, eval_fraction,
           num_shards, seed, progress) -> dict:
  train_ids, eval_ids = split_documents(len(enc["docs"]), eval_fraction, seed)
  splits = {}
  for name, ids in (("train", train_ids), ("eval", eval_ids)):
    docs, masks = [enc["docs"][i] for i in ids], [enc["masks"][i] for i in ids]
    files = text.write_split(output_dir, name, docs,
                             num_shards if name == "train" else max(1, num_shards // 4), masks,
                             progress)
    splits[name] = {"files": files, "num_documents": len(docs),
                    "num_tokens": int(sum(map(len, docs))),
                    "num_target_tokens": int(sum(sum(m[1:]) for m in masks))}
  meta = {**write_chat_files(output_dir, conv, model_dir), "kind": "chat",
          "input": pattern, "seed": seed, "eval_fraction": eval_fraction, "splits": splits,
          "records": enc["read"], "trailing_turns_dropped": enc["trailing"],
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


def stage_command(stage: str, output_dir: str, model_dir: str, suffix: str) -> list[str]:
  """The lines that continue the user's model with `stage` (stages.Sft, stages.Dpo) on
  `output_dir`, as a shell runs them from any dir: --init_from is `model_dir` where it is an
  import's job dir (tools/convert_hf.py --from_hf), else a placeholder and how to make it."""
  absolute = lambda d: d if "://" in d else os.path.abspath(d)
  data_dir = absolute(output_dir)
  is_import = fs.isfile(fs.join(model_dir, model_overrides.OVERRIDES_FILE))
  start = shlex.quote(absolute(model_dir)) if is_import else "IMPORT_DIR"
  lines = [" ".join([f"python -m spmdtask.main --exp={stage}",
                     f"--job_log_dir={shlex.quote(data_dir.rstrip('/') + suffix)}",
                     f"--init_from={start}", f"--data_dir={shlex.quote(data_dir)}"])]
  if not is_import:
    lines.append("(IMPORT_DIR: your model's job dir, from python tools/convert_hf.py "
                 f"--from_hf={shlex.quote(absolute(model_dir))} --job_log_dir=IMPORT_DIR, or "
                 "the job dir of the stage before)")
  return lines


def report(output_dir: str, meta: dict) -> str:
  counts = ", ".join(f"{k}: {v['num_documents']} documents, {v['num_tokens']} tokens "
                     f"({v['num_target_tokens']} targets)" for k, v in meta["splits"].items())
  cut = (f"; {meta['truncated']} cut to {meta['max_len']} tokens"
         + (f" ({meta['no_target_after_cut']} of them left without a target: dropped)"
            if meta["no_target_after_cut"] else "")) if meta["truncated"] else ""
  return (f"{output_dir}: {meta['records']} conversations read; vocab_size="
          f"{meta['vocab_size']}, end_of_turn_id={meta['chat']['end_of_turn_id']}; {counts}; "
          f"{meta['trailing_turns_dropped']} ended with turns after the last assistant reply "
          f"(those turns dropped); {meta['dropped']} over --max_len={meta['max_len']} "
          f"dropped{cut}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--input", required=True,
                      help="JSONL files (a glob; a conversation a line), Parquet files "
                      "(*.parquet) or a dir written by datasets' save_to_disk")
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
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a prepared data dir at --output_dir")
  args = parser.parse_args(argv)
  try:
    meta = prepare(args.input, args.tokenizer, args.output_dir, args.max_len, args.overlong,
                   args.eval_fraction, args.num_shards, args.seed, args.end_of_turn_token,
                   args.overwrite)
  except ConfigError as e:
    print(f"prepare_chat_data: config error: {e}", file=sys.stderr)
    sys.exit(2)
  print(report(args.output_dir, meta))
  print("Fine-tune your model on it:\n  " + "\n  ".join(
      stage_command("stages.Sft", args.output_dir, args.tokenizer, "_sft")))


if __name__ == "__main__":
  main()
