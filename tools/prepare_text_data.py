"""Turns a UTF-8 text file into TFRecords of byte tokens (vocab 256) for TfRecordLmInput.

`python tools/prepare_text_data.py --input=corpus.txt --output=/data/corpus.tfrecord --seq_len=64`
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spmdtask.inputs.tfdata import write_records  # pylint: disable=wrong-import-position


def chunks(data: bytes, seq_len: int):
  """Non-overlapping windows of seq_len + 1 byte tokens (the last partial one dropped)."""
  step = seq_len + 1
  for start in range(0, len(data) - step + 1, step):
    yield list(data[start:start + step])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--input", required=True)
  parser.add_argument("--output", required=True)
  parser.add_argument("--seq_len", type=int, default=64)
  args = parser.parse_args()
  with open(args.input, "rb") as f:
    n = write_records(args.output, chunks(f.read(), args.seq_len))
  print(f"wrote {n} records of {args.seq_len + 1} tokens to {args.output}")


if __name__ == "__main__":
  main()
