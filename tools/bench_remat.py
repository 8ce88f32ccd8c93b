"""One model planned under every remat preset: device and host memory, recompute, step bound.

Compiles the train step for each policy (None, then spmdtask.layers.remat.PRESETS) on the
target and prints, per chip: device temporaries, host memory holding offloaded
activations, matmul FLOPs over no remat's (spmdtask.flops: loops multiplied out) and the
roofline step bound max(FLOPs / peak, host transfers / host link), naming its term.

  # Llama-3-8B-sized, FSDP over a v5e 16x16 pod (ahead of time, through libtpu), 8192 tokens
  python tools/bench_remat.py --topology=v5e:16x16 --preset_model=llama3_8b
  # TinyLm on 8 emulated CPU devices (no roofline: no chip facts)
  python tools/bench_remat.py
"""
import argparse
import os
import time

import bench_common  # pylint: disable=unused-import  (sets 8 CPU devices first)
import jax

from spmdtask import plan, remat_cost
from spmdtask import program as program_lib
from spmdtask.layers import remat

# Per chip. peak: bf16 matmul FLOP/s; host link: host <-> HBM bytes/s one way.
# v5e: 197 TFLOP/s bf16 (cloud.google.com/tpu/docs/v5e, "Key chip specifications");
# PCIe ~1.5e10 B/s per chip ("How to Scale Your Model", jax-ml.github.io/scaling-book/tpus,
# its host-offload figures). Move to the plan's chip-facts table once it has one.
CHIPS = {"v5e": {"peak_flops": 1.97e14, "host_link_bytes_per_s": 1.5e10}}

LLAMA3_8B = [  # Llama 3 8B's dims on TinyLm's model; per-chip batch 1 x 8192 on fsdp
    "task.model.d_model=4096", "task.model.num_layers=32", "task.model.num_heads=32",
    "task.model.num_kv_heads=8", "task.model.head_dim=128", "task.model.d_ff=14336",
    "task.model.vocab_size=128256", "task.model.max_seq_len=8192",
    "task.model.rope_theta=500000.0", "task.model.fprop_dtype='bfloat16'",
    "datasets['train'].vocab_size=128256", "datasets['train'].seq_len=8192",
]


def preset_overrides(name: str, num_devices: int) -> list[str]:
  if name == "llama3_8b":
    return LLAMA3_8B + [f"datasets['train'].batch_size={num_devices}",
                        f"task.ici_mesh_shape=(1, {num_devices}, 1)"]
  return []


def topology_devices(name: str):
  """The devices of a TPU topology, e.g. 'v5e:16x16' (compiled for through libtpu)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  return topologies.get_topology_desc(platform="tpu", topology_name=name).devices


def plan_policy(exp: str, overrides: list[str], field: str, policy, devices, chip):
  """The remat section of the plan of `exp` under `policy`, and the compile seconds."""
  run = bench_common.build(exp, overrides + [f"{field}={policy!r}"])
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example, devices=devices)
  state, batch = plan.abstract_args(program, example)
  t = time.perf_counter()
  compiled, _ = plan.compile_train(program, example)
  seconds = time.perf_counter() - t
  section = remat_cost.plan_section(program, example, state, batch, compiled, chip)
  return section, plan.compiled_memory(compiled)["peak_estimate_bytes"], seconds


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--exp", default="lm.TinyLmFsdp")
  parser.add_argument("--topology", default=None, help="a TPU topology, e.g. v5e:16x16")
  parser.add_argument("--preset_model", default=None, choices=["llama3_8b"])
  parser.add_argument("--field", default="task.model.remat_policy")
  parser.add_argument("--policies", default=",".join(("None",) + remat.PRESETS))
  parser.add_argument("--fdl_set", action="append", default=[])
  args = parser.parse_args()
  devices = topology_devices(args.topology) if args.topology else jax.devices()
  chip = CHIPS.get(args.topology.split(":")[0]) if args.topology else None
  overrides = preset_overrides(args.preset_model, len(devices)) + args.fdl_set
  print(f"exp={args.exp} {args.preset_model or ''} on {args.topology or 'CPU'} "
        f"({len(devices)} devices) {' '.join(overrides)}")
  gib = 2.0 ** 30
  print(f"{'policy':32} {'device GiB':>10} {'peak GiB':>9} {'host GiB':>9} {'FLOPs ratio':>11} "
        f"{'step bound':>12} {'bound by':>9} {'compile s':>9}")
  for name in args.policies.split(","):
    policy = None if name == "None" else name
    r, peak, seconds = plan_policy(args.exp, overrides, args.field, policy, devices, chip)
    rf = r.get("roofline")
    bound = f"{rf['bound_s'] * 1e3:9.1f} ms" if rf else f"{'-':>12}"
    print(f"{name:32} {r['device_temp_bytes'] / gib:10.3f} {peak / gib:9.3f} "
          f"{r['host_temp_bytes'] / gib:9.3f} "
          f"{r['flops_ratio']:11.3f} {bound:>12} {rf['bound_by'] if rf else '-':>9} "
          f"{seconds:9.1f}", flush=True)
  print("per chip: device GiB = XLA's temporaries (activations, gradients, scratch); peak GiB "
        "= arguments + outputs - aliased + temporaries; host GiB = offloaded activations; "
        "FLOPs ratio = traced matmul FLOPs / no remat's; step bound = the roofline's max term.")


if __name__ == "__main__":
  os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
  main()
