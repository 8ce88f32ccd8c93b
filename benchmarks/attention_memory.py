"""Per-chip memory of `llama.Llama3_8B`'s train step on a TPU topology, xla vs splash attention.

`python benchmarks/attention_memory.py [--topology=v5e:16x16] [--seq_len=8192]`

Llama3_8B as configured (FSDP over every chip, one 8192-token row per chip, bf16 compute
with fp32 params and AdamW state, full remat), set up on the topology's compile-only
devices (libtpu's ahead-of-time compiler, no TPU needed) and compiled once per
`task.model.attention_impl`, side by side in one process. Prints XLA:TPU's memory_analysis
per chip (arguments, outputs, aliased, temporaries, the peak estimate), how many Pallas
kernel calls the compiled step holds, and the setup + compile time. Where XLA:TPU refuses
the program (its temporaries exceed the chip's HBM) it prints the compiler's figure.
Nothing is allocated. libtpu's and XLA's stderr go to --log, not the console.
`--mode=plan --plan_topology=v5e:16x16` gives the full plan of one choice.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU devices come from the topology
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiddle as fdl  # pylint: disable=wrong-import-position

from spmdtask import console
from spmdtask.plan import planner, targets  # pylint: disable=wrong-import-position
from spmdtask import main as main_lib  # pylint: disable=wrong-import-position
from spmdtask.core import program as program_lib  # pylint: disable=wrong-import-position

GIB = 1 << 30


def measure(exp: str, impl: str, devices, seq_len: int, extra: list[str],
            log: list[str]) -> dict:
  """memory_analysis of `exp`'s compiled train step with `impl`, or the compiler's refusal."""
  overrides = [f"task.model.attention_impl='{impl}'", f"task.model.max_seq_len={seq_len}",
               f"datasets['train'].seq_len={seq_len}"] + extra
  t = time.perf_counter()
  try:
    with console.captured_fd2(log):
      run = fdl.build(main_lib.resolved_config(exp, overrides))
      batch = run.datasets["train"].batch_at(0)
      program = program_lib.setup(run.task, batch, devices=devices)
    compiled, printed = planner.compile_train(program, batch)
  except planner.CompilerOutOfMemory as e:
    return dict(error=str(e), seconds=time.perf_counter() - t)
  log.append(printed)
  out = planner.compiled_memory(compiled)
  out["seconds"] = time.perf_counter() - t
  # The splash kernel is a Mosaic custom call in the compiled program.
  out["kernel_calls"] = compiled.as_text().count('custom_call_target="tpu_custom_call"')
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--exp", default="llama.Llama3_8B")
  parser.add_argument("--topology", default="v5e:16x16")
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--impls", default="splash,xla")
  parser.add_argument("--set", action="append", default=[],
                      help="more --fdl_set-style overrides, e.g. task.model.num_layers=2")
  parser.add_argument("--log", default="/tmp/bench_attention_memory.log",
                      help="where libtpu's and XLA's stderr goes")
  args = parser.parse_args()
  target = targets.tpu(args.topology)
  log = [target.log]
  print(f"{args.exp} on {args.topology} ({len(target.devices)} "
        f"{target.devices[0].device_kind} chips), {args.seq_len} tokens per row; XLA:TPU "
        "memory_analysis per chip:")
  for impl in args.impls.split(","):
    r = measure(args.exp, impl, target.devices, args.seq_len, args.set, log)
    took = f"(setup + compile {console.duration(r['seconds'])})"
    if "error" in r:
      print(f"  attention_impl={impl:7s} does not fit; XLA:TPU: {r['error']}  {took}",
            flush=True)
      continue
    print(f"  attention_impl={impl:7s} arguments {r['argument_size_in_bytes'] / GIB:5.2f} GiB  "
          f"outputs {r['output_size_in_bytes'] / GIB:5.2f}  aliased "
          f"{r['alias_size_in_bytes'] / GIB:5.2f}  temporaries {r['temp_size_in_bytes'] / GIB:5.2f}"
          f" GiB  peak {r['peak_estimate_bytes'] / GIB:5.2f} GiB  Pallas calls in HLO "
          f"{r['kernel_calls']}  {took}", flush=True)
  with open(args.log, "w", encoding="utf-8") as f:
    f.write("".join(log))
  print(f"(libtpu / XLA stderr: {args.log})")


if __name__ == "__main__":
  main()
