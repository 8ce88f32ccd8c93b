"""Per-device memory of TinyLm's train step on one long row, its sequence split over
context 1, 2, 4, 8 (XLA:CPU's compiled programs; nothing runs).

`python benchmarks/context_memory.py [--seq_len=8192] [--methods=all_gather,ring]`

lm.TinyLm with one row of `seq_len` tokens on a (data 1, fsdp 1, context cp, model 1) mesh
of cp emulated CPU devices, compiled per (cp, task.model.context_attention); prints
memory_analysis per device: arguments, temporaries (the activations, attention's scores a
chunk at a time) and the peak estimate. cp = 1 has no context axis to attend across: it is
the one-device program (the attention field does not apply).

The chunk of scores is a fixed size (task.model.context_score_block pairs per head), so past
a few shards it outweighs TinyLm's activations, which shrink as 1/cp. The last columns
compile the same program again with one query a chunk (context_score_block=1): what is left
is the activations (and all_gather's gathered K/V, which are the whole row's).
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


def measure(cp: int, method: str, seq_len: int, score_block: int | None = None
            ) -> dict[str, int]:
  """memory_analysis of TinyLm's compiled train step, one row split over `cp` devices
  (`score_block`: task.model.context_score_block; None: its default)."""
  chunk = [] if score_block is None else [f"task.model.context_score_block={score_block}"]
  cfg = main_lib.resolved_config("lm.TinyLm", [
      f"task.model.max_seq_len={seq_len}", f"datasets['train'].seq_len={seq_len}",
      "datasets['train'].batch_size=1"] + chunk)
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
  print("| context | attention | arguments | temporaries | peak | temporaries, one query a "
        "chunk | that x context |")
  print("|---|---|---|---|---|---|---|")
  for cp in (int(c) for c in args.contexts.split(",")):
    for method in args.methods.split(",")[:1] if cp == 1 else args.methods.split(","):
      m = measure(cp, method, args.seq_len)
      temp = m["temp_size_in_bytes"] / MIB
      row = f"| {cp} | {'-' if cp == 1 else method} | {m['argument_size_in_bytes'] / MIB:.1f} | "
      row += f"{temp:.1f} | {m['peak_estimate_bytes'] / MIB:.1f} | "
      if cp == 1:  # the one-device program has no chunked attention
        print(row + "- | - |", flush=True)
        continue
      acts = measure(cp, method, args.seq_len, score_block=1)["temp_size_in_bytes"] / MIB
      print(row + f"{acts:.1f} | {acts * cp:.1f} |", flush=True)


if __name__ == "__main__":
  main()
