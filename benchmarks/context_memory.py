"""Per-device memory of TinyLm's train step on one long row, its sequence split over
context 1, 2, 4, 8 (XLA:CPU's compiled programs; nothing runs).

`python benchmarks/context_memory.py [--seq_len=8192] [--methods=all_gather,ring]`

lm.TinyLm with one row of `seq_len` tokens on a (data 1, fsdp 1, context cp, model 1) mesh
of cp emulated CPU devices, compiled once per (cp, task.model.context_attention); prints
memory_analysis per device: arguments, temporaries (the activations, attention's scores a
chunk at a time) and the peak estimate. cp = 1 has no context axis to attend across: it is the one-device
program (the attention field does not apply).
"""
import argparse
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiddle as fdl  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position

from configs import lm  # pylint: disable=wrong-import-position
from spmdtask import main as main_lib  # pylint: disable=wrong-import-position
from spmdtask.core import program as program_lib  # pylint: disable=wrong-import-position
from spmdtask.plan import planner  # pylint: disable=wrong-import-position

MIB = 1 << 20


def measure(cp: int, method: str, seq_len: int) -> dict[str, int]:
  """memory_analysis of TinyLm's compiled train step, one row split over `cp` devices."""
  cfg = main_lib.resolved_config("lm.TinyLm", [
      f"task.model.max_seq_len={seq_len}", f"datasets['train'].seq_len={seq_len}",
      "datasets['train'].batch_size=1"])
  lm.with_context(cfg.task, (1, 1, cp, 1), method)
  run = fdl.build(cfg)
  batch = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, batch, devices=jax.devices()[:cp])
  compiled, _ = planner.compile_train(program, batch)
  return planner.compiled_memory(compiled)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--methods", default="all_gather,ring")
  parser.add_argument("--contexts", default="1,2,4,8")
  args = parser.parse_args()
  print(f"lm.TinyLm, 1 row of {args.seq_len} tokens, XLA:CPU memory_analysis per device (MiB):")
  print("| context | attention | arguments | temporaries | peak | temporaries x context |")
  print("|---|---|---|---|---|---|")
  for cp in (int(c) for c in args.contexts.split(",")):
    for method in args.methods.split(",")[:1] if cp == 1 else args.methods.split(","):
      m = measure(cp, method, args.seq_len)
      temp = m["temp_size_in_bytes"] / MIB
      print(f"| {cp} | {'-' if cp == 1 else method} | {m['argument_size_in_bytes'] / MIB:.1f} | "
            f"{temp:.1f} | {m['peak_estimate_bytes'] / MIB:.1f} | {temp * cp:.1f} |",
            flush=True)


if __name__ == "__main__":
  main()
