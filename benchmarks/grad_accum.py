"""Gradient accumulation: compiled train-step memory (`memory_analysis`) vs microbatches.

    python benchmarks/grad_accum.py [--exp=lm.TinyLm] [--microbatches=1,2,4,8]

Compiles the train step of `--exp` (on all local devices; 8 emulated CPU devices by
default) with `task.train.num_microbatches` = each value and prints the per-device
temporary bytes (activations live across the backward pass) and their ratio to M = 1.
Nothing runs: the step is only lowered and compiled.
"""
import argparse

import common  # pylint: disable=unused-import  (sets 8 CPU devices first)

from spmdtask.core import program as program_lib


def temp_bytes(exp: str, microbatches: int, overrides) -> tuple[int, int]:
  run = common.build(exp, [*overrides, f"task.train.num_microbatches={microbatches}"])
  local = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, local)
  compiled = program.lowerings(local)[0].lower().compile()
  mem = compiled.memory_analysis()
  return mem.temp_size_in_bytes, mem.argument_size_in_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--exp", default="lm.TinyLm")
  parser.add_argument("--microbatches", default="1,2,4,8")
  parser.add_argument("--batch_size", type=int, default=64)
  args = parser.parse_args()
  overrides = [f"datasets['train'].batch_size={args.batch_size}", "datasets['train'].seq_len=256"]
  rows = [(m, *temp_bytes(args.exp, m, overrides)) for m in map(int, args.microbatches.split(","))]
  base = rows[0][1]
  print(f"exp={args.exp} global batch {args.batch_size} x seq 256, per device:")
  print(f"{'M':>3} {'temp MiB':>10} {'args MiB':>10} {'temp / M=1':>11}")
  for m, temp, arg in rows:
    print(f"{m:>3} {temp / 2**20:10.2f} {arg / 2**20:10.2f} {temp / base:11.3f}")


if __name__ == "__main__":
  main()
