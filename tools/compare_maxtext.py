"""Compiles a train step both ways, spmdtask's and MaxText's, for the same TPU slice
(XLA:TPU ahead of time, libtpu, on this machine) and prints them side by side.

    python tools/compare_maxtext.py --maxtext_dir=/work/maxtext \\
        --maxtext_python=/work/mtvenv/bin/python --config=all --out=/tmp/compare_maxtext

Configs (`--config`, or `all`):
  llama3_8b_v5e256    Llama-3-8B on v5e-256: `llama.Llama3_8B` against MaxText's
                      `train_compile ... model_name=llama3-8b per_device_batch_size=1
                      max_target_length=8192 ici_fsdp_parallelism=-1` (its defaults else);
  llama31_8b_v6e256   Llama-3.1-8B on v6e-256: `llama.Llama31_8B_V6e256` against MaxText's
                      published tuning config `llama3_1_8b_8192` (benchmarks/);
  llama2_70b_v5p512   Llama-2-70B on v5p-512: `llama.Llama2_70B_V5p512` against MaxText's
                      `llama2_70b_v5p_128` at 4 rows per chip (see that experiment's doc);
  mixtral_8x7b_v5p128 Mixtral-8x7B on v5p-128: `moe.Mixtral_8x7B` against MaxText's Mixtral
                      end-to-end script's `model_name=mixtral-8x7b per_device_batch_size=4
                      max_target_length=4096 ici_fsdp_parallelism=-1 remat_policy=full
                      attention=flash megablox=True sparse_matmul=True`;
  llama31_8b_128k_v5p128  Llama-3.1-8B on rows of 131,072 tokens on v5p-128:
                      `llama.Llama31_8B_128k` (context 16 x fsdp 4, all_gather attention) against
                      MaxText's `ici_context_parallelism=16 ici_fsdp_parallelism=-1` (4 rows);
  gemma3_27b_v6e256   Gemma 3 27B (text) on v6e-256: `gemma3.Gemma3_27B` (FSDP 16 x 16,
                      1 x 8192 tokens per chip) against MaxText's `model_name=gemma3-27b
                      per_device_batch_size=1 max_target_length=8192 ici_fsdp_parallelism=-1`
                      (its defaults else; its vocabulary 262144, the HF checkpoint's 262208);
  llama3_8b_int8_v5e256  `llama3_8b_v5e256` with int8 matmuls on both sides: spmdtask's
                      `--fdl_set=task.model.quantization='int8'`, MaxText's `quantization=int8`;
  deepseek2_16b_v5p128  DeepSeek-V2-Lite on v5p-128: `deepseek.DeepSeekV2Lite` (FSDP over 64
                      chips, 4 x 4096 tokens per chip) against the pre-training run of MaxText's
                      tests/end_to_end/tpu/deepseek/v2-16b/test_deepseek.sh at those tokens:
                      `model_name=deepseek2-16b per_device_batch_size=4 max_target_length=4096
                      ici_fsdp_parallelism=-1 attention=flash sparse_matmul=True megablox=True
                      dtype=bfloat16` (full remat, base.yml's default, as the script; float32
                      weights, as spmdtask's, where it sets bfloat16; megablox's gmm where it
                      sets use_tokamax_gmm=True, which an ahead-of-time compile on a CPU host
                      refuses);
  deepseek3_671b_v5p1024  DeepSeek-V3 on v5p-1024: `deepseek.DeepSeekV3_V5p1024` (6 x 8192
                      tokens per chip) against MaxText's published tuning config
                      `deepseek3_671b_v5p_1024` (benchmarks/maxtext_v5p_model_configs.py).
MaxText (e591f30cb, which asks for Python >= 3.12) runs unpatched under Python 3.11: its one
3.12-only construct on the train step's imports, `type X = ...` in kernels/mhc/, is compiled
as `X = ...` by tools/maxtext_step.py's import hook; docs/plans.md builds that Python.
MaxText's side runs tools/maxtext_step.py under `--maxtext_python` (MaxText's own
`train_compile`, its compiled step kept; MaxText's benchmark config read from its source,
its XLA flags set in LIBTPU_INIT_ARGS). spmdtask's side runs `python -m spmdtask.main
--mode=plan` in a subprocess (tools/compare_plans.py) under its experiment's own flags
(`task.xla_flags`), as a user's plan and run get them. Both compiled programs are then read
the same way, by spmdtask's planner (`planner.compiled_report`): memory_analysis,
collectives per step (spmdtask.plan.hlo), XLA's FLOPs with loops counted per trip
(spmdtask.plan.xla_cost), the roofline (spmdtask.plan.roofline, chips.py's facts) and the
compiled schedule's step estimate (spmdtask.plan.overlap). MaxText's program hides its Pallas
kernels' FLOPs from XLA as spmdtask's does; its roofline is charged the FLOPs its own kernels
state (megablox's cost_estimate, per call as its program runs them) and, for kernels that
state none (splash), spmdtask's traced count for the same attention shapes; the MFU bound
of both divides the same model FLOPs
(spmdtask's formula, 6·N·T + attention). `--out`/results.json holds every number (and
`--out`/CONFIG/results.json each config's).
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

from spmdtask.plan import chips, planner, targets, xla_cost  # pylint: disable=wrong-import-position
from tools import compare_plans  # pylint: disable=wrong-import-position

GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Config:
  """One comparison: spmdtask's experiment and TPU topology, MaxText's arguments."""
  exp: str
  topology: str               # spmdtask's --plan_topology, e.g. 'v5e:16x16'
  maxtext_args: tuple[str, ...]  # train_compile's key=value arguments after base.yml
  benchmark: str | None = None   # MaxText benchmarks/ config 'module:name' (tools/maxtext_step.py)
  fdl_set: tuple[str, ...] = ()  # spmdtask's --fdl_set overrides of `exp`


LLAMA3_8B_V5E256 = ("compile_topology=v5e-256", "compile_topology_num_slices=1",
                    "model_name=llama3-8b", "per_device_batch_size=1", "max_target_length=8192",
                    "ici_fsdp_parallelism=-1", "dataset_type=synthetic")

CONFIGS = {
    "llama3_8b_v5e256": Config("llama.Llama3_8B", "v5e:16x16", LLAMA3_8B_V5E256),
    "llama3_8b_int8_v5e256": Config(
        "llama.Llama3_8B", "v5e:16x16", (*LLAMA3_8B_V5E256, "quantization=int8"),
        fdl_set=("task.model.quantization='int8'",)),
    "llama31_8b_v6e256": Config(
        "llama.Llama31_8B_V6e256", "v6e:16x16",
        ("compile_topology=v6e-256", "compile_topology_num_slices=1"),
        "maxtext_trillium_model_configs:llama3_1_8b_8192"),
    "llama2_70b_v5p512": Config(
        "llama.Llama2_70B_V5p512", "v5p:4x8x8",
        ("compile_topology=v5p-512", "compile_topology_num_slices=1", "per_device_batch_size=4"),
        "maxtext_v5p_model_configs:llama2_70b_v5p_128"),
    # MaxText's Mixtral end-to-end script's setup (its source holds no v5p Mixtral config);
    # float32 weights (base.yml's default), as spmdtask's.
    "mixtral_8x7b_v5p128": Config(
        "moe.Mixtral_8x7B", "v5p:4x4x4",
        ("compile_topology=v5p-128", "compile_topology_num_slices=1",
         "model_name=mixtral-8x7b", "per_device_batch_size=4", "max_target_length=4096",
         "ici_fsdp_parallelism=-1", "remat_policy=full", "attention=flash", "megablox=True",
         "sparse_matmul=True", "dataset_type=synthetic")),
    "llama31_8b_128k_v5p128": Config(
        "llama.Llama31_8B_128k", "v5p:4x4x4",
        ("compile_topology=v5p-128", "compile_topology_num_slices=1", "model_name=llama3.1-8b",
         "per_device_batch_size=0.0625", "max_target_length=131072",
         "ici_context_parallelism=16", "ici_fsdp_parallelism=-1", "remat_policy=full",
         "attention=flash", "dataset_type=synthetic")),
    "gemma3_27b_v6e256": Config(
        "gemma3.Gemma3_27B", "v6e:16x16",
        ("compile_topology=v6e-256", "compile_topology_num_slices=1", "model_name=gemma3-27b",
         "per_device_batch_size=1", "max_target_length=8192", "ici_fsdp_parallelism=-1",
         "dataset_type=synthetic")),
    # MaxText's DeepSeek end-to-end script's pre-training run (tests/end_to_end/tpu/deepseek/
    # v2-16b/test_deepseek.sh) at the 4 x 4096 tokens per chip over the whole slice;
    # float32 weights (base.yml's default, as spmdtask's) where the script sets bfloat16;
    # megablox's gmm where it sets use_tokamax_gmm=True (tokamax's ragged_dot picks its kernel
    # by the device it traces on: "Not supported on cpu" in an ahead-of-time compile).
    "deepseek2_16b_v5p128": Config(
        "deepseek.DeepSeekV2Lite", "v5p:4x4x4",
        ("compile_topology=v5p-128", "compile_topology_num_slices=1",
         "model_name=deepseek2-16b", "per_device_batch_size=4", "max_target_length=4096",
         "ici_fsdp_parallelism=-1", "attention=flash", "sparse_matmul=True", "megablox=True",
         "dtype=bfloat16", "dataset_type=synthetic")),
    "deepseek3_671b_v5p1024": Config(
        "deepseek.DeepSeekV3_V5p1024", "v5p:8x8x8",
        ("compile_topology=v5p-1024", "compile_topology_num_slices=1"),
        "maxtext_v5p_model_configs:deepseek3_671b_v5p_1024"),
}


def maxtext_compile(cfg: Config, maxtext_dir: str, python: str, out: str) -> dict:
  """Runs MaxText's train_compile for `cfg` (tools/maxtext_step.py); the config it ran."""
  cmd = [python, os.path.join(REPO, "tools", "maxtext_step.py"), out]
  cmd += [f"--benchmark={cfg.benchmark}"] if cfg.benchmark else []
  cmd += ["src/maxtext/configs/base.yml", *cfg.maxtext_args]
  # Another process here (spmdtask's own plan) may hold libtpu's lockfile.
  env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", PYTHONPATH=".:src",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  done = subprocess.run(cmd, cwd=maxtext_dir, env=env, capture_output=True, text=True,
                        check=False)
  if done.returncode:
    sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  with open(os.path.join(out, "config.json")) as f:
    return json.load(f)


def stored_compiled(out: str):
  """What tools/maxtext_step.py wrote, as the parts of a compiled object the planner reads."""
  with open(os.path.join(out, "hlo.txt")) as f:
    text = f.read()
  with open(os.path.join(out, "memory.json")) as f:
    memory = types.SimpleNamespace(**json.load(f))
  with open(os.path.join(out, "cost.json")) as f:
    cost = json.load(f)
  return types.SimpleNamespace(as_text=lambda: text, memory_analysis=lambda: memory,
                               cost_analysis=lambda: cost)


def spmdtask_plan(cfg: Config, out: str) -> dict:
  """spmdtask's plan.json for `cfg` (tools/compare_plans.py), also where XLA refused it."""
  try:
    return compare_plans.plan(cfg.exp, list(cfg.fdl_set), f"tpu:{cfg.topology}", out)
  except SystemExit:  # exit 4 on XLA's out-of-memory: the plan says so
    path = compare_plans.plan_json(out, f"tpu:{cfg.topology}")
    if not os.path.exists(path):
      raise
    with open(path) as f:
      return json.load(f)


def maxtext_report(out: str, topology: str, plan: dict) -> dict:
  """MaxText's compiled step read by spmdtask's planner, with spmdtask's `plan` (same model,
  same tokens) giving the model FLOPs and the Pallas kernels' FLOPs (none where XLA refused
  spmdtask's step: then no MFU bound): the traced FLOPs of spmdtask's kernels that state
  none (splash: the blocks its mask runs), plus the FLOPs MaxText's own kernels state
  (megablox gmm's cost_estimate, per call as its program runs them: its remat may rerun
  more of them than spmdtask's)."""
  target = targets.Target("tpu", (), topology, chip=chips.CHIPS[topology.split(":")[0]])
  flops = plan.get("flops_per_step", {"model": 0.0, "kernels_per_device": None})
  compiled = stored_compiled(out)
  kernels = flops["kernels_per_device"]
  if kernels:
    kernels += (xla_cost.stated_kernel_flops(compiled.as_text())
                - flops["kernels_stated_per_device"])
  tokens = plan["batch_shape"][0] * plan["batch_shape"][1]
  return planner.compiled_report(compiled, target, plan["num_devices"], flops["model"],
                                 tokens, kernels or None)


def quantities(report: dict) -> dict:
  """The compared numbers of one side (a plan.json or a compiled_report): per chip per step."""
  if "compiled" not in report:
    return {"XLA refused (out of memory)": report["compiler_out_of_memory"][:80]}
  out = {"temporaries GiB": report["compiled"]["temp_size_in_bytes"] / GIB,
         "peak GiB": report["compiled"]["peak_estimate_bytes"] / GIB}
  for kind in sorted(report["collectives"]):
    c = report["collectives"][kind]
    out[f"{kind} ops"] = c["count"]
    out[f"{kind} GiB"] = c["bytes"] / GIB
    received = report.get("collective_bytes_received_by_kind", {}).get(kind)
    if received is not None:  # what the links carry (a two-axis gather's results overcount)
      out[f"{kind} received GiB"] = received / GIB
  f = report["flops_per_step"]
  out["XLA TFLOP (kernels excl.)"] = (f["xla_per_device"] - f["kernels_per_device"]) / 1e12
  out["kernel TFLOP"] = f["kernels_per_device"] / 1e12
  est = report.get("estimate")
  if est:
    out["step bound s"] = est["step_seconds_lower_bound"]
    out["bound by"] = est["bound"]
    out["MFU bound"] = est["mfu_upper_bound"] or None  # no model FLOPs: none
  step = report.get("step_estimate")
  if step:  # the compiled schedule's estimate (spmdtask.plan.overlap), both read alike
    out["step estimate s"] = step["step_seconds"]
    out["exposed comm s"] = step["exposed_seconds"]
    out["MFU estimate"] = step["mfu_estimate"]
  return out


def _cell(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, str):
    return v
  if isinstance(v, int):
    return str(v)
  return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.4e}"


def table(results: dict[str, dict[str, dict]]) -> str:
  """A markdown table: rows are the quantities, columns spmdtask | MaxText | ratio (spmdtask
  / MaxText) per config. `results`: config -> {'spmdtask': quantities, 'maxtext': ...}."""
  rows = []
  for sides in results.values():
    for q in (*sides["spmdtask"], *sides["maxtext"]):
      if q not in rows:
        rows.append(q)
  head = ["per chip per step"] + [f"{c} {s}" for c in results
                                  for s in ("spmdtask", "MaxText", "ratio")]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for q in rows:
    cells = [q]
    for sides in results.values():
      a, b = sides["spmdtask"].get(q), sides["maxtext"].get(q)
      ratio = (a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
               else None)
      cells += [_cell(a), _cell(b), "-" if ratio is None else f"{ratio:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--maxtext_dir", required=True, help="a MaxText checkout (its src/ and "
                 "benchmarks/)")
  p.add_argument("--maxtext_python", required=True, help="a Python with MaxText's "
                 "requirements and jax[tpu] (libtpu): jax, jaxlib and libtpu at spmdtask's "
                 "versions; Python 3.11 will do (tools/maxtext_step.py; docs/plans.md)")
  p.add_argument("--config", default="all", choices=[*CONFIGS, "all"])
  p.add_argument("--out", default="/tmp/spmdtask_compare_maxtext")
  p.add_argument("--reuse", action="store_true", help="keep compiles already under --out")
  args = p.parse_args()
  names = list(CONFIGS) if args.config == "all" else [args.config]
  results, record = {}, {}
  for name in names:
    cfg, out = CONFIGS[name], os.path.join(args.out, name)
    mt_out = os.path.join(out, "maxtext")
    if args.reuse and os.path.exists(os.path.join(mt_out, "hlo.txt")):
      with open(os.path.join(mt_out, "config.json")) as f:
        mt_cfg = json.load(f)
    else:
      mt_cfg = maxtext_compile(cfg, args.maxtext_dir, args.maxtext_python, mt_out)
    # spmdtask's side compiles under its experiment's own flags (task.xla_flags), as a
    # user's plan and run do; MaxText's was compiled under MaxText's (config.json).
    os.environ.pop("LIBTPU_INIT_ARGS", None)
    plan_json = compare_plans.plan_json(os.path.join(out, "spmdtask"), f"tpu:{cfg.topology}")
    plan = {}
    if args.reuse and os.path.exists(plan_json):
      with open(plan_json) as f:
        plan = json.load(f)
    # A plan written before plans listed their kernels' stated FLOPs is compiled again.
    if not plan or ("compiled" in plan
                    and "kernels_stated_per_device" not in plan["flops_per_step"]):
      plan = spmdtask_plan(cfg, os.path.join(out, "spmdtask"))
    mt = maxtext_report(mt_out, cfg.topology, plan)
    results[name] = {"spmdtask": quantities(plan), "maxtext": quantities(mt)}
    record[name] = {**results[name], "maxtext_config": mt_cfg, "spmdtask_exp": cfg.exp,
                    "topology": cfg.topology, "maxtext_warnings": mt["warnings"]}
    with open(os.path.join(out, "results.json"), "w") as f:
      json.dump(record[name], f, indent=1)
    print(f"{name}: compiled both", flush=True)
  print(table(results))
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(record, f, indent=1)
  print(f"numbers: {os.path.join(args.out, 'results.json')}")


if __name__ == "__main__":
  main()
