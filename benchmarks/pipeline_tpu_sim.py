"""MPMD schedules against the SPMD pipeline on a TPU topology, from compiled costs.

    python benchmarks/pipeline_tpu_sim.py --topology=v5e:2x4 --stages=4 --microbatches=8
    python benchmarks/pipeline_tpu_sim.py --topology=v5e:2x2 --stages=2 --microbatches=4 \\
        --layers=4 --d_model=256 --d_ff=1024 --heads=4 --seq=256 --vocab=1024 --batch=8 --json

One TinyLm-style LM (bf16, no remat), one topology, one global batch, compiled by XLA:TPU
ahead of time on this CPU machine (libtpu; nothing runs):
  mpmd    the part programs of each stage on its submesh (chips / stages each): forward,
          backward, input_grad, weight_grad (stage_costs); each program's roofline time is
          its action's cost per microbatch, a hop between stages costs the activation bytes
          a chip receives over its ICI ingress; `simulate` runs 1F1B, ZB-H1, ZB-V (two
          parts a stage) and GPipe under these per-part costs; each stage's optimizer
          update (its roofline) follows its last action;
  spmd    the whole-step program of the stage-dim pipeline (GPipe; circular with 2
          repeats): its roofline step time. Its loop runs M*R + S - 1 iterations; XLA's
          FLOPs, counted per trip (xla_cost), include the S - 1 bubble iterations' work;
  scan    the unpipelined step, FSDP over every chip: the reference.
Prints one table (or `--json`: one object). What is modeled is printed under it.
"""
import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _chips(topology: str) -> int:
  """Chips of a topology name ('v5e:2x4' -> 8), to emulate as many CPU devices."""
  return math.prod(int(d) for d in re.sub(r"^[^:]*:", "", topology).split("x"))


def _flags(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--topology", default="v5e:2x4")
  p.add_argument("--stages", type=int, default=4)
  p.add_argument("--microbatches", type=int, default=8)
  p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--d_model", type=int, default=1024)
  p.add_argument("--d_ff", type=int, default=4096)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--term", default=None, choices=["compute", "hbm", "ici"],
                 help="time every program by this roofline term alone (default: the bound)")
  p.add_argument("--json", action="store_true", help="print one JSON object instead")
  return p.parse_args(argv)


if __name__ == "__main__":  # emulated CPU devices build the MPMD program (before jax loads)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={max(8, _chips(_flags().topology))}")

# pylint: disable=wrong-import-position
import fiddle as fdl
import jax

from spmdtask import main
from spmdtask.plan import planner, targets
from spmdtask.core import program as program_lib
from spmdtask.pipeline.mpmd import report, stages as mpmd_stages, stage_costs
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig

MS = 1e-3 / 1e-6  # milliseconds in the costs' unit (microseconds)


def build(args, chips: int, pipeline=None, mesh=None):
  """The built run of the model under one strategy (`task.pipeline`, mesh axes / shape)."""
  head_dim = args.d_model // args.heads
  cfg = main.resolved_config("lm.TinyLm", [
      f"task.model.d_model={args.d_model}", f"task.model.num_layers={args.layers}",
      f"task.model.num_heads={args.heads}", f"task.model.num_kv_heads={args.heads}",
      f"task.model.head_dim={head_dim}", f"task.model.d_ff={args.d_ff}",
      f"task.model.max_seq_len={args.seq}", f"task.model.vocab_size={args.vocab}",
      "task.model.fprop_dtype='bfloat16'", "task.model.remat_policy=None",
      f"datasets['train'].batch_size={args.batch}", f"datasets['train'].seq_len={args.seq}",
      f"datasets['train'].vocab_size={args.vocab}"])
  if mesh is not None:
    cfg.task.mesh_axis_names, cfg.task.ici_mesh_shape = mesh
  else:
    cfg.task.ici_mesh_shape = (1, chips, 1)  # FSDP over every chip
  cfg.task.pipeline = pipeline
  return fdl.build(cfg)


def _say(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def whole_step(run, target, term=None) -> dict:
  """A one-program strategy's roofline step on `target` (plan.compiled_report)."""
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example, devices=list(target.devices))
  compiled, _ = planner.compile_train(program, example)
  batch = jax.tree.leaves(example)[0].shape[0]
  rep = planner.compiled_report(compiled, target, len(target.devices),
                             float(program.work.train_flops) * batch,
                             float(program.work.tokens) * batch)
  est = rep["estimate"]
  step = est["step_seconds_lower_bound"] if term is None else est["seconds"][term]
  return {"step_ms": step * 1e3, "bound": est["bound"],
          "terms_ms": {k: v * 1e3 for k, v in est["seconds"].items()},
          "flops_xla": rep["flops_per_step"]["xla"], "flops_model": rep["flops_per_step"]["model"],
          "loop_trips": sorted({l["trips"] for l in rep["loops"]}),
          "mfu_upper_bound": est["mfu_upper_bound"]}


def mpmd_pipeline(args, chips, target, cuts, schedule, num_chunks, kinds):
  """(pipeline on the target, roofline times of its programs of `kinds`, update times)."""
  per = chips // args.stages
  cfg = fdl.Config(MpmdConfig, layer_cuts=cuts, submesh_shapes=((per, 1, 1),) * args.stages,
                   schedule=schedule, num_microbatches=args.microbatches, num_chunks=num_chunks)
  run = build(args, chips, cfg)
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example, devices=jax.devices("cpu")[:chips])
  on = stage_costs.on_target(program, run.task, target.devices)
  lws = [lw for lw in report.lowerings(on) + stage_costs.split_lowerings(on.pipeline)
         if lw.name.split(" ", 4)[-1] in kinds]
  times = stage_costs.roofline(lws, target, lambda name: _say(f"compiling {schedule}: {name}"))
  updates = [stage_costs.seconds(times[f"stage {s} optimizer update"], args.term) / 1e-6
             for s in range(args.stages)]
  return on.pipeline, times, updates


def _row(strategy, schedule, step_ms, bubble, per_stage=None, bound=""):
  return {"strategy": strategy, "schedule": schedule, "step_ms": step_ms, "bubble": bubble,
          "per_stage_ms": per_stage, "bound": bound}


def _per_stage(pl, costs):
  """Per stage: F, B (or I), W in ms, each summed over its parts (per microbatch)."""
  out = []
  for s in range(pl.schedule.num_stages):
    mine = [c for p, c in zip(pl.parts, costs) if p.stage == s]
    out.append([sum(getattr(c, k) for c in mine) / MS for k in ("forward", "backward", "weight")])
  return out


def compare(args) -> dict:
  """Every strategy's step on the topology; the table's rows and the facts under them."""
  target = targets.tpu(args.topology)
  chips, S, M = len(target.devices), args.stages, args.microbatches
  L = args.layers
  rows, facts = [], {}
  # MPMD: stage s holds layers [s*L/S, (s+1)*L/S); ZB-V: 2S parts of L/(2S) layers.
  cuts = tuple(range(L // S, L, L // S))
  pl, times, updates = mpmd_pipeline(args, chips, target, cuts, "zb_h1", 1,
                                     {"forward", "backward", "input_grad", "weight_grad",
                                      "update"})
  for name, split in (("gpipe", False), ("1f1b", False), ("zb_h1", True)):
    schedule = mpmd_stages.make_schedule(MpmdConfig(cuts, ((1,),) * S, name, M))
    costs = stage_costs.part_costs(pl, times, target.chip, split, args.term)
    got = stage_costs.step(schedule, costs, updates)
    rows.append(_row("mpmd", name, got["step"] / MS, got["bubble"], _per_stage(pl, costs)))
    facts[f"mpmd {name}"] = {k: v for k, v in got.items() if k != "simulation"}
  facts["mpmd programs"] = times
  vcuts = tuple(range(L // (2 * S), L, L // (2 * S)))
  plv, timesv, updatesv = mpmd_pipeline(args, chips, target, vcuts, "zb_v", 2,
                                        {"forward", "input_grad", "weight_grad", "update"})
  costs = stage_costs.part_costs(plv, timesv, target.chip, True, args.term)
  got = stage_costs.step(plv.schedule, costs, updatesv)
  rows.append(_row("mpmd", "zb_v", got["step"] / MS, got["bubble"], _per_stage(plv, costs)))
  facts["mpmd zb_v"] = {k: v for k, v in got.items() if k != "simulation"}
  facts["mpmd zb_v programs"] = timesv
  facts["hop_ms"] = costs[0].latency / MS
  mesh = (("stage", "data", "fsdp", "model"), (S, chips // S, 1, 1))
  for name, repeat in (("gpipe", 1), ("circular", 2)):
    cfg = fdl.Config(PipelineConfig, num_stages=S, num_microbatches=M, circular_repeat=repeat,
                     remat_policy=None)
    _say(f"compiling the SPMD {name} step")
    got = whole_step(build(args, chips, cfg, mesh), target, args.term)
    bubble = (S - 1) / (M * repeat + S - 1)
    rows.append(_row("spmd", name, got["step_ms"], bubble, bound=got["bound"]))
    facts[f"spmd {name}"] = got
  _say("compiling the unpipelined (FSDP) step")
  got = whole_step(build(args, chips), target, args.term)
  rows.append(_row("scan", "fsdp", got["step_ms"], 0.0, bound=got["bound"]))
  facts["scan"] = got
  ref = next(r["step_ms"] for r in rows if r["strategy"] == "spmd" and r["schedule"] == "gpipe")
  for r in rows:
    r["vs_spmd_gpipe"] = r["step_ms"] / ref
  return {"topology": args.topology, "term": args.term or "roofline bound", "chips": chips,
          "stages": S, "microbatches": M,
          "batch": args.batch, "seq": args.seq, "model": {k: getattr(args, k) for k in (
              "layers", "d_model", "d_ff", "heads", "vocab")}, "rows": rows, "facts": facts}


NOTES = """Modeled: each program's time is its roofline lower bound on the chip (max of XLA's
FLOPs / peak bf16, HBM bytes / HBM bandwidth, collective bytes / ICI ingress; --term: one
of them), no launch or dispatch overhead. HBM bytes are XLA's 'bytes accessed' (operands and
results of every op, no on-chip reuse): an overcount, so programs tend to show HBM-bound. MPMD: a send delays only its receiver (activation bytes per receiving chip
/ ICI ingress, all links, no contention) and overlaps the sender's compute; the optimizer
update follows each stage's last action; bubble = 1 - busy / makespan, worst stage. SPMD:
the compiled step already holds the S-1 bubble iterations' work (bubble column: (S-1)/(MR+S-1)
of the iterations) and its ppermutes; XLA schedules their overlap. No remat anywhere."""


def table(out: dict) -> str:
  lines = [f"{out['topology']} ({out['chips']} chips), times: {out.get('term')}, "
           f"{out['stages']} stages, "
           f"{out['microbatches']} microbatches, global batch {out['batch']} x {out['seq']} "
           f"tokens, model {out['model']}",
           f"{'strategy':8} {'schedule':9} {'per-stage F/B/W ms (per microbatch)':52} "
           f"{'step ms':>8} {'bubble':>7} {'vs spmd gpipe':>13}"]
  for r in out["rows"]:
    stages = (" ".join("/".join(f"{x:.3f}" for x in st) for st in r["per_stage_ms"])
              if r["per_stage_ms"] else f"(one program, {r['bound']}-bound)")
    lines.append(f"{r['strategy']:8} {r['schedule']:9} {stages:52} {r['step_ms']:8.3f} "
                 f"{r['bubble']:7.1%} {r['vs_spmd_gpipe']:13.3f}")
  lines.append(f"hop (one activation, stage to stage): {out['facts']['hop_ms']:.4f} ms")
  for key in ("mpmd programs", "mpmd zb_v programs"):
    bounds = {}
    for name, t in out["facts"][key].items():
      bounds.setdefault(name.split(" ", 4)[-1], []).append(t["bound"])
    lines.append(f"{key} bound by (stage / part order): " + "; ".join(
        f"{k} {','.join(v)}" for k, v in bounds.items()))
  for k in ("spmd gpipe", "spmd circular", "scan"):
    f = out["facts"][k]
    lines.append(f"{k}: XLA FLOPs {f['flops_xla']:.3g} vs model {f['flops_model']:.3g} "
                 f"(x{f['flops_xla'] / f['flops_model']:.2f}), loop trips {f['loop_trips']}")
  return "\n".join(lines + [NOTES])


if __name__ == "__main__":
  flags = _flags()
  result = compare(flags)
  print(json.dumps(result, indent=1, default=float) if flags.json else table(result))
