"""Per-chip memory of a Llama-3-8B-sized train step on a TPU topology, xla vs splash attention.

`python tools/bench_attention_memory.py [--topology=v5e:16x16] [--seq_len=8192]`

Builds lm.TinyLm with Llama 3 8B's dims (d 4096, 32 layers, 32 heads, 8 KV heads, MLP
14336, vocab 128256, RoPE θ 500000), FSDP over every chip, one sequence per chip, bf16
compute with fp32 params and AdamW state, full remat (`nothing_saveable`), then sets the
program up on the TPU topology's devices (libtpu's ahead-of-time compiler, no TPU needed),
compiles the train step once per `task.model.attention_impl` and prints XLA:TPU's
memory_analysis per chip: arguments, outputs, aliased, temporaries, the peak estimate
(arguments + outputs - aliased + temporaries), and the compile time. Nothing is allocated.
libtpu's start-up warnings go to --log, not the console.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU devices come from the topology
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Compiling for a topology claims no chip: other processes may hold libtpu's lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiddle as fdl  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
from jax.experimental import topologies  # pylint: disable=wrong-import-position

from spmdtask import console, plan  # pylint: disable=wrong-import-position
from spmdtask import main as main_lib  # pylint: disable=wrong-import-position
from spmdtask import program as program_lib  # pylint: disable=wrong-import-position

M = "task.model"
LLAMA3_8B = [
    f"{M}.vocab_size=128256", f"{M}.d_model=4096", f"{M}.num_layers=32", f"{M}.num_heads=32",
    f"{M}.num_kv_heads=8", f"{M}.head_dim=128", f"{M}.d_ff=14336", f"{M}.rope_theta=500000.0",
    f"{M}.norm_eps=1e-5", f"{M}.fprop_dtype='bfloat16'", f"{M}.remat_policy='nothing_saveable'",
    "datasets['train'].vocab_size=128256",
]


def llama3_8b_run(impl: str, chips: int, seq_len: int, num_layers: int):
  overrides = LLAMA3_8B + [
      f"{M}.num_layers={num_layers}", f"{M}.max_seq_len={seq_len}",
      f"{M}.attention_impl='{impl}'", "task.ici_mesh_shape=(1, -1, 1)",  # FSDP over all
      f"datasets['train'].seq_len={seq_len}", f"datasets['train'].batch_size={chips}"]
  return fdl.build(main_lib.resolved_config("lm.TinyLm", overrides))


def measure(impl: str, devices, seq_len: int, num_layers: int, log: list[str]) -> dict:
  t = time.perf_counter()
  try:
    with plan.captured_fd2(log):
      run = llama3_8b_run(impl, len(devices), seq_len, num_layers)
      batch = run.datasets["train"].batch_at(0)
      program = program_lib.setup(run.task, batch, devices=devices)
      compiled, printed = plan.compile_train(program, batch)
  except Exception as e:  # pylint: disable=broad-except
    # XLA:TPU refuses a program that cannot fit the chip's HBM (RESOURCE_EXHAUSTED,
    # CompileTimeHbmOom); its message says how many bytes of temporaries it needed.
    if "RESOURCE_EXHAUSTED" not in str(e) and "exceeds available HBM" not in str(e):
      raise
    return dict(error=str(e).splitlines()[0], seconds=time.perf_counter() - t)
  log.append(printed)
  seconds = time.perf_counter() - t
  mem = compiled.memory_analysis()
  out = dict(arguments=mem.argument_size_in_bytes, outputs=mem.output_size_in_bytes,
             aliased=mem.alias_size_in_bytes, temporaries=mem.temp_size_in_bytes)
  out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
  out["seconds"] = seconds
  # The splash kernel is a Mosaic custom call in the compiled program.
  out["kernel_calls"] = compiled.as_text().count('custom_call_target="tpu_custom_call"')
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--topology", default="v5e:16x16")
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--num_layers", type=int, default=32)
  parser.add_argument("--impls", default="xla,splash")
  parser.add_argument("--log", default="/tmp/bench_attention_memory.log",
                      help="where libtpu's and XLA's stderr goes")
  args = parser.parse_args()
  log: list[str] = []
  with plan.captured_fd2(log):
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
  print(f"Llama-3-8B-sized LM ({args.num_layers} layers), {args.topology}: {len(devices)} "
        f"{devices[0].device_kind} chips, FSDP {len(devices)}, 1 x {args.seq_len} tokens per "
        "chip, bf16, full remat. XLA:TPU memory_analysis per chip:")
  gib = 1 << 30
  for impl in args.impls.split(","):
    r = measure(impl, devices, args.seq_len, args.num_layers, log)
    if "error" in r:
      print(f"  attention_impl={impl:7s} does not fit; XLA:TPU: {r['error']}  (setup + "
            f"compile {console.duration(r['seconds'])})", flush=True)
      continue
    print(f"  attention_impl={impl:7s} arguments {r['arguments'] / gib:6.2f} GiB  outputs "
          f"{r['outputs'] / gib:6.2f}  aliased {r['aliased'] / gib:6.2f}  temporaries "
          f"{r['temporaries'] / gib:6.2f} GiB  peak {r['peak'] / gib:6.2f} GiB  "
          f"Pallas calls in HLO {r['kernel_calls']}  (setup + compile "
          f"{console.duration(r['seconds'])})", flush=True)
  with open(args.log, "w", encoding="utf-8") as f:
    f.write("".join(log))
  print(f"(libtpu/XLA stderr: {args.log})")


if __name__ == "__main__":
  main()
