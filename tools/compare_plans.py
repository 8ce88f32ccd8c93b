"""Plans one job for two targets and prints their collectives side by side.

    python tools/compare_plans.py --exp=lm.TinyLm --fdl_set="task.ici_mesh_shape=(1, 64, 1)" \\
        --fdl_set="datasets['train'].batch_size=64" --a=cpu:64 --b=tpu:v5e:8x8

A target is `cpu:N` (N emulated CPU devices, --plan_devices) or `tpu:TOPOLOGY`
(--plan_topology, XLA:TPU). Each plan runs `python -m spmdtask.main --mode=plan` in its own
process (job dirs under --out); the table shows, per collective kind, how often it runs per
step and its result bytes per device per step, as each compiler emitted them.
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from spmdtask import console  # pylint: disable=wrong-import-position


def plan_json(out: str, target: str) -> str:
  """Where `plan(..., target, out)` leaves the plan of `target`."""
  return os.path.join(out, target.replace(":", "_"), "plan.json")


def plan(exp: str, overrides: list[str], target: str, out: str) -> dict:
  """Runs the plan for `target`; its plan.json."""
  kind, _, where = target.partition(":")
  flag = {"cpu": f"--plan_devices={where}", "tpu": f"--plan_topology={where}"}[kind]
  job = os.path.dirname(plan_json(out, target))
  cmd = [sys.executable, "-m", "spmdtask.main", f"--exp={exp}", f"--job_log_dir={job}",
         "--mode=plan", flag, "--device_memory_gib=1e9"] + [f"--fdl_set={o}" for o in overrides]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  with open(plan_json(out, target)) as f:
    return json.load(f)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--exp", required=True)
  p.add_argument("--fdl_set", action="append", default=[])
  p.add_argument("--a", default="cpu:64")
  p.add_argument("--b", default="tpu:v5e:8x8")
  p.add_argument("--out", default="/tmp/spmdtask_compare_plans")
  args = p.parse_args()
  plans = {t: plan(args.exp, args.fdl_set, t, args.out) for t in (args.a, args.b)}
  kinds = sorted({k for pl in plans.values() for k in pl["collectives"]})
  print(f"{args.exp} {' '.join(args.fdl_set)}: collectives per step, per device")
  print(f"{'kind':24}" + "".join(f"{t:>34}" for t in plans))
  for k in kinds:
    cells = []
    for pl in plans.values():
      c = pl["collectives"].get(k)
      cells.append(f"x{c['count']} {console.human_bytes(c['bytes'])}" if c else "-")
    print(f"{k:24}" + "".join(f"{c:>34}" for c in cells))
  for t, pl in plans.items():
    print(f"{t}: mesh {pl['mesh']}, FLOPs/step {pl['flops_per_step']['xla']:.4g}, peak "
          f"{console.human_bytes(pl['compiled']['peak_estimate_bytes'])} per device")


if __name__ == "__main__":
  main()
