"""Compile time of the train step at 32 layers vs 4 layers (target ratio <= 1.5, thanks to scan).

`python benchmarks/compile.py [--exp=lm.TinyLm]`
"""
import argparse
import time

import common  # pylint: disable=unused-import  (sets 8 CPU devices first)
import jax

from spmdtask.core import program as program_lib


def compile_seconds(exp: str, num_layers: int) -> float:
  run = common.build(exp, [f"task.model.num_layers={num_layers}"])
  local = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, local)
  t = time.perf_counter()
  program.lowerings(local)[0].lower().compile()
  return time.perf_counter() - t


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--exp", default="lm.TinyLm")
  args = parser.parse_args()
  jax.jit(lambda x: x + 1)(1.0)  # pay backend start-up outside the timings
  t4, t32 = compile_seconds(args.exp, 4), compile_seconds(args.exp, 32)
  print(f"exp={args.exp} compile: 4 layers {t4:.2f} s, 32 layers {t32:.2f} s, "
        f"ratio 32/4 = {t32 / t4:.3f}  (target <= 1.5)")


if __name__ == "__main__":
  main()
