"""Turns a JSONL file of prompts with answers into a prompts data dir for GRPO.

    python tools/prepare_prompt_data.py --input=prompts.jsonl \
        --tokenizer=/models/Llama-3.1-8B-Instruct --output_dir=/data/prompts --max_prompt_len=256

A record (a JSONL line, a Parquet row) is `{"prompt": "What is 2+3?", "answer": 5}`: the prompt a string (one user message)
or a list of messages, rendered with the --tokenizer dir's chat template and its generation
prompt (`--raw`: a string prompt is encoded as is); the answer any JSON value, handed to the
rewards. --tokenizer is a Hugging Face model dir or an import's job dir. A prompt of more
than --max_prompt_len tokens is dropped and counted. The dir's meta.json names the
tokenizer, the template and the ids that stop a completion (eos and the end-of-turn token),
which GRPO stops at (spmdtask.inputs.prompt_data). Any bad line stops the tool (exit 2,
FILE:LINE) before anything is written; a non-empty --output_dir is refused, a prepared
data dir there replaced only with --overwrite (spmdtask.inputs.data_dirs).
"""
import argparse
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
from spmdtask.inputs import data_dirs, prompt_data


def prepare(pattern: str, tokenizer: str, output_dir: str, max_prompt_len: int | None = None,
            raw: bool = False, overwrite: bool = False) -> dict:
  """Writes the data dir; returns meta.json's contents plus the counts the report shows.
  Everything is read and checked before anything is written."""
  data_dirs.check_output_dir(output_dir, overwrite)
  if max_prompt_len is not None and max_prompt_len < 1:
    raise ConfigError(f"--max_prompt_len={max_prompt_len}: give a positive number of tokens "
                      "(or leave it out: no limit).")
  conv, tok, model_eos = prompt_data.model_chat(tokenizer, raw)
  enc = prompt_data.encode_all(pattern, conv, tok, raw, max_prompt_len, console.Progress("prepare_prompt_data"))
  stops = prompt_data.stop_ids(conv, tok, model_eos)
  meta = {"stop_ids": stops, "raw": raw, "input": pattern, "model": tokenizer,
          "max_prompt_len": max_prompt_len, "dropped": enc["dropped"]}
  meta = data_dirs.write(output_dir, lambda local: prompt_data.write(
      local, enc["ids"], enc["answers"], conv, tok, meta), overwrite)
  return {**meta, "plain": enc["plain"], "no_answer": enc["no_answer"]}


def report(output_dir: str, meta: dict) -> str:
  plain = ("" if not meta["plain"] else
           f"; {meta['plain']} plain-string prompts " +
           ("encoded as is (--raw)" if meta["raw"] else "rendered as one user message each"))
  dropped = (f"; {meta['dropped']} over --max_prompt_len={meta['max_prompt_len']} dropped"
             if meta["max_prompt_len"] is not None else "")
  missing = f"; {meta['no_answer']} without an answer (null)" if meta["no_answer"] else ""
  return (f"{output_dir}: {meta['num_prompts']} prompts, the longest {meta['longest']} tokens"
          f"{dropped}{plain}{missing}; vocab_size={meta['vocab_size']}, stop ids "
          f"{meta['stop_ids']}")


def train_command(output_dir: str, model: str) -> str | None:
  """The GRPO stage on `output_dir` from `model`, an import's or a stage's job dir (None for
  another dir: import it first, tools/convert_hf.py --from_hf)."""
  if not fs.isfile(fs.join(model, "model_overrides.txt")):
    return None
  data, base = (d if "://" in d else os.path.abspath(d) for d in (output_dir, model))
  return " ".join(["python -m spmdtask.main --exp=stages.Grpo",
                   f"--job_log_dir={shlex.quote(data.rstrip('/') + '_grpo')}",
                   f"--init_from={shlex.quote(base)}", f"--data_dir={shlex.quote(data)}",
                   "--reward=PATH.py:FN"])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--input", required=True,
                      help='JSONL or Parquet files (a glob) or a saved dataset\'s dir, '
                      '{"prompt": ..., "answer": ...} a record')
  parser.add_argument("--tokenizer", required=True,
                      help="a Hugging Face model dir (tokenizer.json, chat template) or the job "
                      "dir of tools/convert_hf.py --from_hf")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--max_prompt_len", type=int, default=None,
                      help="drop (and count) prompts of more tokens than this")
  parser.add_argument("--raw", action="store_true",
                      help="encode a string prompt as is, not as a user message of the template")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace the prepared data dir at --output_dir")
  args = parser.parse_args(argv)
  try:
    meta = prepare(args.input, args.tokenizer, args.output_dir, args.max_prompt_len,
                   args.raw, args.overwrite)
  except ConfigError as e:
    print(f"prepare_prompt_data: config error: {e}", file=sys.stderr)
    sys.exit(2)
  print(report(args.output_dir, meta))
  command = train_command(args.output_dir, args.tokenizer)
  if command:
    print("Train on it by GRPO (your reward function in place of PATH.py:FN):\n  " + command)


if __name__ == "__main__":
  main()
