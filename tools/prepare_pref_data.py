"""Turns preference pairs into a prepared data dir for DPO (spmdtask.objectives.dpo).

    python tools/prepare_pref_data.py --input='/data/prefs/*.jsonl' \\
        --tokenizer=/models/Llama-3.1-8B-Instruct --output_dir=/data/prefs_l31 --max_len=1024

--input is JSONL files (a glob), Parquet files (*.parquet) or a dir written by datasets'
save_to_disk (spmdtask.inputs.records). Each record is one pair in one of TRL's preference
formats (messages in any form prepare_chat_data.py reads: content parts, ShareGPT, tool
calls):
  conversational  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}: the
                  prompt rendered with the --tokenizer dir's chat template and its generation
                  prompt, each completion's assistant turns (text and end-of-turn token) the
                  targets (spmdtask.inputs.chat);
  implicit prompt {"chosen": [messages], "rejected": [messages]}: two whole conversations;
                  the messages they share from the start are the prompt;
  plain text      {"prompt": "...", "chosen": "...", "rejected": "..."}: prompt + completion
                  with the tokenizer's special tokens, closed by eos; the completion and eos
                  are the targets.
Turns after a completion's last assistant reply are dropped and counted. A pair whose chosen
or rejected sequence is longer than --max_len tokens is dropped. Pairs are shuffled once
(--seed), the first --eval_fraction become the eval split.

The output dir has prepare_chat_data.py's layout, pair p being documents 2p (chosen) and
2p + 1 (rejected), and meta.json's "kind": "preferences" and "preferences": true
(spmdtask.inputs.preferences reads it). Any bad record (a pair whose chosen and rejected are
the same tokens among them) stops the tool (exit 2) before anything is written; a non-empty
--output_dir is refused, a prepared one replaced only with --overwrite.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
from spmdtask import console
from spmdtask.errors import ConfigError
from spmdtask.inputs import chat, data_dirs, records, text, tokenizers
from tools.prepare_chat_data import stage_command, write_chat_files
from tools.prepare_text_data import split_documents


def parse(record: dict, where: str) -> tuple[chat.Example, chat.Example]:
  """(chosen, rejected) `chat.Example`s of one record; ConfigError naming `where`."""
  if not {"chosen", "rejected"} <= set(record):
    raise ConfigError(f"{where}has no 'chosen' and 'rejected'; write {{\"prompt\": ..., "
                      "\"chosen\": ..., \"rejected\": ...}} (TRL's preference format).")
  if "prompt" in record:
    return tuple(chat.example({"prompt": record["prompt"], "completion": record[k]},
                              f"{where}{k}: ") for k in ("chosen", "rejected"))
  if isinstance(record["chosen"], str):
    raise ConfigError(f"{where}gives plain-text chosen and rejected without a 'prompt'; add "
                      "the prompt they share as \"prompt\".")
  chosen, rejected = (chat.example({"messages": record[k]}, f"{where}{k}: ").messages
                      for k in ("chosen", "rejected"))
  shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b),
                min(len(chosen), len(rejected)))
  if shared == 0:
    raise ConfigError(f"{where}chosen and rejected share no first message, so they have no "
                      "common prompt; give the prompt as \"prompt\".")
  return tuple(chat.example({"prompt": list(m[:shared]), "completion": list(m[shared:])},
                            f"{where}{k}: ")
               for k, m in (("chosen", chosen), ("rejected", rejected)))


def encode_all(source: str, conv: chat.Chat, max_len: int,
               progress: console.Progress) -> dict:
  """Every record as two (ids, mask) documents, over-long pairs dropped; ConfigError
  (naming FILE:LINE or FILE:row N) for the first bad record. Returns {'docs', 'masks',
  'read', 'trailing', 'dropped'}."""
  out = {"docs": [], "masks": [], "read": 0, "trailing": 0, "dropped": 0}
  for where, record in records.read(source):
    out["read"] += 1
    progress.update(lambda: f"{out['read']} pairs read, {len(out['docs']) // 2} kept")
    pair = parse(record, where)
    out["trailing"] += any(e.trailing for e in pair)
    (c_ids, c_mask), (r_ids, r_mask) = (e.encode(conv, where) for e in pair)
    if c_ids.tolist() == r_ids.tolist():
      raise ConfigError(
          f"{where}chosen and rejected are identical ({len(c_ids)} tokens): DPO learns "
          "nothing from such a pair (its two log-ratios cancel) and it usually means a "
          "broken export. Fix the line's rejected completion or drop the line.")
    if max(len(c_ids), len(r_ids)) > max_len:
      out["dropped"] += 1
      continue
    out["docs"] += [c_ids.tolist(), r_ids.tolist()]
    out["masks"] += [c_mask.tolist(), r_mask.tolist()]
  if not out["read"]:
    raise ConfigError(f"--input={source!r} holds no record; give pairs, one a line "
                      '({"prompt": ..., "chosen": ..., "rejected": ...}) or a row.')
  return out


def prepare(pattern: str, model_dir: str, output_dir: str, max_len: int,
            eval_fraction: float = 0.05, num_shards: int = 4, seed: int = 0,
            end_of_turn_token: str | None = None, overwrite: bool = False) -> dict:
  """Writes the data dir (local, or gs:// through a local stage); returns meta.json's
  contents. Everything is read and checked before the first file is written."""
  data_dirs.check_output_dir(output_dir, overwrite)
  if max_len < 2:
    raise ConfigError(f"--max_len={max_len}: a sequence needs at least 2 tokens; give the "
                      "sequence length you will train with plus one (e.g. --max_len=1025).")
  conv = chat.Chat.from_model_dir(model_dir, end_of_turn_token)
  progress = console.Progress("prepare_pref_data")
  enc = encode_all(pattern, conv, max_len, progress)
  if len(enc["docs"]) < 4:
    raise ConfigError(f"--input={pattern!r} leaves {len(enc['docs']) // 2} pair(s) after "
                      f"--max_len={max_len}; a train and an eval split need at least 2. Raise "
                      "--max_len or add pairs.")
  progress.next_phase(f"all read; writing {len(enc['docs']) // 2} pairs to {output_dir}")
  return data_dirs.write(output_dir, lambda local: _write(
      local, enc, conv, pattern, max_len, eval_fraction, num_shards, seed, model_dir,
      progress), overwrite)


def _write(output_dir, enc, conv, pattern, max_len, eval_fraction, num_shards, seed,
           model_dir, progress) -> dict:
  train_ids, eval_ids = split_documents(len(enc["docs"]) // 2, eval_fraction, seed)
  splits = {}
  for name, ids in (("train", train_ids), ("eval", eval_ids)):
    docs = [i for p in ids for i in (2 * int(p), 2 * int(p) + 1)]
    files = text.write_split(output_dir, name, [enc["docs"][i] for i in docs],
                             num_shards if name == "train" else max(1, num_shards // 4),
                             [enc["masks"][i] for i in docs], progress)
    # Shards hold whole documents in order, so a pair's two stay adjacent by number.
    splits[name] = {"files": files, "num_documents": len(docs), "num_pairs": len(ids),
                    "num_tokens": int(sum(len(enc["docs"][i]) for i in docs)),
                    "num_target_tokens": int(sum(sum(enc["masks"][i][1:]) for i in docs))}
  meta = {**write_chat_files(output_dir, conv, model_dir), "kind": "preferences",
          "preferences": True, "input": pattern, "seed": seed, "eval_fraction": eval_fraction,
          "splits": splits, "records": enc["read"], "trailing_turns_dropped": enc["trailing"],
          "max_len": max_len, "dropped": enc["dropped"]}
  with open(os.path.join(output_dir, tokenizers.META_FILE), "w") as f:
    json.dump(meta, f, indent=1)
  return meta


def report(output_dir: str, meta: dict) -> str:
  counts = ", ".join(f"{k}: {v['num_pairs']} pairs, {v['num_tokens']} tokens "
                     f"({v['num_target_tokens']} targets)" for k, v in meta["splits"].items())
  return (f"{output_dir}: {meta['records']} pairs read; vocab_size={meta['vocab_size']}; "
          f"{counts}; {meta['trailing_turns_dropped']} with turns after a completion's last "
          f"assistant reply (those turns dropped); {meta['dropped']} pairs over "
          f"--max_len={meta['max_len']} dropped")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--input", required=True,
                      help="JSONL files (a glob; a pair a line), Parquet files (*.parquet) or "
                      "a dir written by datasets' save_to_disk")
  parser.add_argument("--tokenizer", required=True,
                      help="a Hugging Face model dir: tokenizer.json and its chat template")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--max_len", type=int, required=True,
                      help="the longest sequence (prompt + completion) kept, in tokens")
  parser.add_argument("--end_of_turn_token", default=None,
                      help="the token ending an assistant turn (default: found in the template)")
  parser.add_argument("--eval_fraction", type=float, default=0.05)
  parser.add_argument("--num_shards", type=int, default=4, help="train shards")
  parser.add_argument("--seed", type=int, default=0, help="pair shuffle seed")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a prepared data dir at --output_dir")
  args = parser.parse_args(argv)
  try:
    meta = prepare(args.input, args.tokenizer, args.output_dir, args.max_len,
                   args.eval_fraction, args.num_shards, args.seed, args.end_of_turn_token,
                   args.overwrite)
  except ConfigError as e:
    print(f"prepare_pref_data: config error: {e}", file=sys.stderr)
    sys.exit(2)
  print(report(args.output_dir, meta))
  print("Align your fine-tuned model on it (DPO; its reference is the start):\n  " +
        "\n  ".join(stage_command("stages.Dpo", args.output_dir, args.tokenizer, "_dpo")))


if __name__ == "__main__":
  main()
