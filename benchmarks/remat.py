"""One model planned under every remat preset: device and host memory, recompute, step bound.

Compiles the train step for each policy (None, then spmdtask.core.remat.PRESETS) on the
target and prints, per chip: device temporaries, host memory holding offloaded
activations, matmul FLOPs over no remat's (spmdtask.plan.flops: loops multiplied out) and the
roofline step bound of the plan (compute, HBM, ICI, host link for offloaded activations).

  # Llama 3 8B, FSDP over a v5e 16x16 pod (ahead of time, through libtpu), 1 x 8192 per chip
  python benchmarks/remat.py --exp=llama.Llama3_8B --topology=v5e:16x16
  # the same dims on TinyLm's model (what the numbers in the remat note were taken with)
  python benchmarks/remat.py --topology=v5e:16x16 --preset_model=llama3_8b \
      --fdl_set="task.model.attention_impl='splash'"
  # TinyLm fully sharded over 8 emulated CPU devices (no roofline: no chip facts)
  python benchmarks/remat.py
"""
import argparse
import os
import re
import time

import common  # pylint: disable=unused-import  (sets 8 CPU devices first)

from spmdtask.plan import planner, targets
from spmdtask.core import remat

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


def plan_policy(exp: str, overrides: list[str], field: str, policy, target) -> tuple[dict, float]:
  """The plan of `exp` under `policy` on `target`, and the seconds it took."""
  run = common.build(exp, overrides + [f"{field}={policy!r}"])
  t = time.perf_counter()
  result = planner.make_plan(run, exp, target)
  return result, time.perf_counter() - t


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--exp", default="lm.TinyLmFsdp")
  parser.add_argument("--topology", default=None, help="a TPU topology, e.g. v5e:16x16")
  parser.add_argument("--preset_model", default=None, choices=["llama3_8b"])
  parser.add_argument("--field", default="task.model.remat_policy")
  parser.add_argument("--policies", default=",".join(remat.PRESETS + ("None",)))
  parser.add_argument("--fdl_set", action="append", default=[])
  args = parser.parse_args()
  target = targets.tpu(args.topology) if args.topology else targets.present()
  overrides = preset_overrides(args.preset_model, len(target.devices)) + args.fdl_set
  print(f"exp={args.exp} {args.preset_model or ''} on {target.describe()} "
        f"{' '.join(overrides)}")
  gib = 2.0 ** 30
  print(f"{'policy':30} {'device GiB':>10} {'peak GiB':>9} {'host GiB':>9} {'FLOPs ratio':>11} "
        f"{'XLA TFLOPs':>10} {'step bound':>12} {'bound by':>9} {'plan s':>7}")
  for name in args.policies.split(","):
    policy = None if name == "None" else name
    p, seconds = plan_policy(args.exp, overrides, args.field, policy, target)
    r, est = p["remat"], p.get("estimate")
    if "compiler_out_of_memory" in p:  # XLA:TPU refuses programs above HBM; it names the need
      need = re.search(r"temporaries \(([0-9.]+)G\)", p["compiler_out_of_memory"])
      print(f"{name:30} {need.group(1) + 'G' if need else '?':>10} {'':9} {'':9} "
            f"{r['flops_ratio']:11.3f}  does not fit: XLA's need above {p['compiler_out_of_memory'][-40:]}",
            flush=True)
      continue
    bound = f"{est['step_seconds_lower_bound'] * 1e3:9.1f} ms" if est else f"{'-':>12}"
    print(f"{name:30} {r['device_temp_bytes'] / gib:10.3f} "
          f"{p['compiled']['peak_estimate_bytes'] / gib:9.3f} {r['host_temp_bytes'] / gib:9.3f} "
          f"{r['flops_ratio']:11.3f} {p['flops_per_step']['xla_per_device'] / 1e12:10.2f} "
          f"{bound:>12} {est['bound'] if est else '-':>9} {seconds:7.1f}", flush=True)
  print("Per chip: device GiB = XLA's temporaries (activations, gradients, scratch); peak GiB = "
        "arguments + outputs - aliased + temporaries; host GiB = offloaded activations; FLOPs "
        "ratio = traced matmul FLOPs / no remat's; XLA TFLOPs = compiled FLOPs per step (loops "
        "per trip); step bound = the roofline's largest term (compute, hbm, ici, host_link).")


if __name__ == "__main__":
  os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
  main()
