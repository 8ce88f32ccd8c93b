"""Turns text files into a prepared data dir: tokenized documents as TFRecord shards.

    python tools/prepare_text_data.py --input='/data/books/*.txt' --output_dir=/data/books_sp \
        --tokenizer=sentencepiece --vocab_size=4096
    python tools/prepare_text_data.py --input='/data/books/*.txt' --output_dir=/data/books_l32 \
        --tokenizer=hf:/models/Llama-3.2-1B/tokenizer.json

Each input file is one document (UTF-8; another encoding is refused, naming FILE:LINE).
Documents are shuffled once (--seed), the first --eval_fraction of them become the eval
split, the rest train. Every document is tokenized whole and closed by the end-of-document
id. With --tokenizer=sentencepiece a BPE model is trained (offline) on the train
documents' lines with --vocab_size; with --tokenizer=hf:PATH a Hugging Face tokenizer.json
(an imported model's own) is used as is, its end-of-document id the --eod_token's, else
the eos_token of the tokenizer_config.json beside it. The output dir gets
`train-*.tfrecord`, `eval-*.tfrecord`, their `*_index.npz`, the tokenizer
(`tokenizer.model` or `tokenizer.json`; none for bytes) and `meta.json` (see
spmdtask.inputs.tokenizers). A non-empty --output_dir is refused; a
prepared one is replaced only with --overwrite (spmdtask.inputs.data_dirs).
Train on it with `--exp=lm.TextLm` (docs/data.md).
"""
import argparse
import json
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TensorFlow (imported to write the TFRecords) and JAX's plugins print start-up notices from
# C++ (oneDNN, CUDA probes) that TF_CPP_MIN_LOG_LEVEL does not reach.
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
from spmdtask import console, fs
from spmdtask.errors import ConfigError
from spmdtask.inputs import data_dirs, text, tokenizers


DEFAULT_VOCAB = 4096  # SentencePiece's --vocab_size when none is given


def read_documents(pattern: str, progress: console.Progress | None = None
                   ) -> tuple[list[str], list[str]]:
  """(paths, texts) of the non-empty files matching `pattern`, in sorted path order; a file
  that is not UTF-8 is a ConfigError naming FILE:LINE."""
  paths, texts = [], []
  progress = progress or console.Progress("prepare_text_data")
  for path in fs.glob(pattern):
    progress.update(lambda: f"{len(texts)} documents read")
    if fs.isfile(path):
      content = fs.read_text(path)
      if content:
        paths.append(path)
        texts.append(content)
  return paths, texts


def split_documents(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval) document numbers: one seeded shuffle, the first eval_fraction to eval."""
  order = np.random.default_rng(seed).permutation(n)
  num_eval = max(1, int(round(eval_fraction * n))) if n > 1 else 0
  return order[num_eval:], order[:num_eval]


def make_tokenizer(kind: str, train_texts: list[str], output_dir: str, vocab_size: int | None,
                   eod_token: str | None = None):
  """The tokenizer `kind` names ('bytes', 'sentencepiece' or 'hf:PATH'), its file in output_dir."""
  if kind == "bytes":
    return tokenizers.ByteTokenizer()
  if kind.startswith("hf:"):
    tok = tokenizers.from_spec(kind, eod_token)
    if tok.eod_id is None:
      raise ConfigError(f"--tokenizer={kind}: no end-of-document token; there is no "
                        f"{tokenizers.HF_CONFIG_FILE} with an eos_token beside it. Pass "
                        "--eod_token=TOKEN (one of its special tokens, e.g. '<|end_of_text|>').")
    copy = os.path.join(output_dir, tokenizers.HF_FILE)
    if fs.absolute(kind[3:]) != fs.absolute(copy):
      fs.write_bytes(copy, fs.read_bytes(kind[3:]))
    return tokenizers.HfTokenizer(copy, eod_id=tok.eod_id)
  lines = [line for t in train_texts for line in t.splitlines() if line.strip()]
  given = (f"--vocab_size={vocab_size}" if vocab_size else
           f"--vocab_size={DEFAULT_VOCAB} (the default)")
  vocab_size = vocab_size or DEFAULT_VOCAB
  need = tokenizers.sentencepiece_min_vocab(lines)
  if vocab_size < need:  # checked here: SentencePiece's own refusal is a C++ RuntimeError
    raise ConfigError(
        f"{given} is too small for this corpus: SentencePiece keeps each of its "
        f"{need - tokenizers.SP_FIXED_PIECES} distinct characters as a piece, beside "
        f"{tokenizers.SP_FIXED_PIECES} fixed ones (256 byte fallbacks, unknown, end of "
        f"document, newline, tab). Pass --vocab_size={need} or more.")
  try:
    model = tokenizers.train_sentencepiece(
        lines, os.path.join(output_dir, os.path.splitext(tokenizers.SP_MODEL_FILE)[0]),
        vocab_size)
  except RuntimeError as e:  # e.g. more pieces asked for than the corpus has
    if "vocab" not in str(e).lower():
      raise
    said = str(e).rsplit("] ", 1)[-1].strip()
    raise ConfigError(f"{given}: SentencePiece refused it on this corpus: {said} Pass a "
                      "--vocab_size it accepts.") from None
  return tokenizers.SentencePieceTokenizer(model)


def prepare(pattern: str, output_dir: str, kind: str, vocab_size: int | None = None,
            eval_fraction: float = 0.05, num_shards: int = 4, seed: int = 0,
            eod_token: str | None = None, overwrite: bool = False) -> dict:
  """Writes the data dir (local, or gs://: written locally, uploaded, the local copy
  deleted); returns its meta.json contents. Everything is read and checked first."""
  data_dirs.check_output_dir(output_dir, overwrite)
  progress = console.Progress("prepare_text_data")
  paths, texts = read_documents(pattern, progress)
  if len(texts) < 2:
    raise ConfigError(f"--input={pattern!r} matches {len(texts)} non-empty file(s); a train "
                      "and an eval split need at least 2 documents (one a file).")
  progress.next_phase(f"all {len(texts)} documents read; tokenizing")
  return data_dirs.write(output_dir, lambda local: _write(
      local, paths, texts, pattern, kind, vocab_size, eval_fraction, num_shards, seed,
      eod_token, progress), overwrite)


def _write(output_dir, paths, texts, pattern, kind, vocab_size, eval_fraction, num_shards,
           seed, eod_token, progress) -> dict:
  """Writes the data dir into local `output_dir`; returns meta.json's contents."""
  train_ids, eval_ids = split_documents(len(texts), eval_fraction, seed)
  tok = make_tokenizer(kind, [texts[i] for i in train_ids], output_dir, vocab_size, eod_token)
  splits = {}
  for name, ids in (("train", train_ids), ("eval", eval_ids)):
    docs = []
    for i in ids:
      progress.update(lambda: f"{name}: {len(docs)} of {len(ids)} documents tokenized")
      docs.append(tok.encode(texts[i]) + [tok.eod_id])
    files = text.write_split(output_dir, name, docs,
                             num_shards if name == "train" else max(1, num_shards // 4),
                             progress=progress)
    splits[name] = {"files": files, "num_documents": len(docs),
                    "num_tokens": int(sum(len(d) for d in docs)),
                    "sources": [os.path.relpath(paths[i], os.path.dirname(pattern) or ".")
                                for i in ids]}
  meta = {"kind": "text", "tokenizer": tok.kind, "vocab_size": tok.vocab_size,
          "eod_id": tok.eod_id,
          "input": pattern, "seed": seed, "eval_fraction": eval_fraction, "splits": splits}
  with open(os.path.join(output_dir, tokenizers.META_FILE), "w") as f:
    json.dump(meta, f, indent=1)
  return meta


def train_command(output_dir: str, meta: dict) -> str:
  """The command that trains lm.TextLm on `output_dir`, as a shell runs it from any dir."""
  data_dir = output_dir if "://" in output_dir else os.path.abspath(output_dir)
  job = data_dir.rstrip("/") + "_textlm"
  return " ".join(["python -m spmdtask.main --exp=lm.TextLm",
                   f"--job_log_dir={shlex.quote(job)}", f"--data_dir={shlex.quote(data_dir)}",
                   f"--fdl_set=task.model.vocab_size={meta['vocab_size']}"])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--input", required=True, help="glob of text files, one document each")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--tokenizer", default="bytes",
                      help="bytes, sentencepiece (trained here), or hf:PATH (a Hugging Face "
                      "tokenizer.json, e.g. an imported model's)")
  parser.add_argument("--eod_token", default=None,
                      help="hf: the end-of-document token (default: the eos_token of the "
                      "tokenizer_config.json beside tokenizer.json)")
  parser.add_argument("--vocab_size", type=int, default=None,
                      help=f"SentencePiece vocabulary size (default {DEFAULT_VOCAB})")
  parser.add_argument("--eval_fraction", type=float, default=0.05)
  parser.add_argument("--num_shards", type=int, default=4, help="train shards")
  parser.add_argument("--seed", type=int, default=0, help="document shuffle seed")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a prepared data dir at --output_dir")
  args = parser.parse_args(argv)
  if args.tokenizer not in ("bytes", "sentencepiece") and not args.tokenizer.startswith("hf:"):
    parser.error(f"--tokenizer={args.tokenizer!r}: use bytes, sentencepiece or hf:PATH.")
  if args.vocab_size is not None and args.tokenizer != "sentencepiece":
    parser.error("--vocab_size is for --tokenizer=sentencepiece (the others fix their own).")
  try:
    meta = prepare(args.input, args.output_dir, args.tokenizer, args.vocab_size,
                   args.eval_fraction, args.num_shards, args.seed, args.eod_token,
                   args.overwrite)
  except ConfigError as e:
    print(f"prepare_text_data: config error: {e}", file=sys.stderr)
    sys.exit(2)
  counts = ", ".join(f"{k}: {v['num_documents']} documents, {v['num_tokens']} tokens"
                     for k, v in meta["splits"].items())
  print(f"{args.output_dir}: {meta['tokenizer']} tokenizer, vocab_size={meta['vocab_size']}, "
        f"eod_id={meta['eod_id']}; {counts}")
  print("Train on it:\n  " + train_command(args.output_dir, meta))


if __name__ == "__main__":
  main()
