"""Plans a pipeline before any device is used: a schedule's time chart, bubble and memory, and
balanced stage cuts of per-layer costs.

    python tools/plan_pipeline.py --schedule=1f1b --stages=4 --microbatches=8
    python tools/plan_pipeline.py --schedule=interleaved_1f1b --stages=4 --microbatches=8 \\
        --chunks=2 --costs=1,1,1 --latency=0.1 --json
    python tools/plan_pipeline.py --schedule_file=my_schedule.txt --costs=1,2,0
    python tools/plan_pipeline.py --schedule_file=torch_schedule.csv --write=mine.txt
    python tools/plan_pipeline.py --schedule=zb_v --stages=4 --microbatches=8 --chunks=2 \\
        --write=zb_v.csv
    python tools/plan_pipeline.py --stages=4 --layer_costs=1,4,4,4,4,4,4,9
    python tools/plan_pipeline.py --stages=2 --exp=lm.TinyLm [--fdl_set=task.model.vocab_size=32000]

A schedule (`--schedule` or `--schedule_file`: the text form of spmdtask.pipeline.schedules.schedule, or
a torch.distributed.pipelining compute_only `.csv`) is validated and simulated with
`--costs=F,B,W` per microbatch through one whole stage (an unsplit B costs B + W). Layer costs
(`--layer_costs`, or from `--exp`: compiled FLOPs of the embedding, each block and the head
with the loss) are cut into stages x chunks contiguous parts that minimise the slowest.
`--write=PATH` converts: it writes the validated schedule to PATH in torch's CSV when PATH
ends in `.csv`, else in the text form. `--json` prints one JSON object instead. A bad flag
or schedule file prints one paragraph and exits with status 2.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import balance as balance_lib
from spmdtask.pipeline.schedules import generators
from spmdtask.pipeline.schedules import schedule as schedule_lib
from spmdtask.pipeline.schedules import files
from spmdtask.pipeline.schedules import simulate as simulate_lib


def _floats(text: str, flag: str, count: int | None = None) -> list[float]:
  try:
    values = [float(x) for x in text.split(",")]
  except ValueError:
    values = []
  if not values or (count is not None and len(values) != count):
    raise ConfigError(f"{flag}={text!r} must be {count or 'one or more'} comma-separated "
                      f"numbers, e.g. {flag}=" + ",".join(["1"] * (count or 3)) + ".")
  return values


def _costs(args) -> simulate_lib.Costs:
  f, b, w = _floats(args.costs, "--costs", 3)
  return simulate_lib.Costs(forward=f, backward=b, weight=w, latency=args.latency)


def _schedule(args) -> tuple[schedule_lib.Schedule, str] | None:
  if args.schedule_file:
    source = f"--schedule_file={args.schedule_file}"
    return files.load(args.schedule_file, source), source
  if args.schedule:
    if args.stages is None or args.microbatches is None:
      raise ConfigError(f"--schedule={args.schedule} needs --stages and --microbatches.")
    sched = generators.generate(args.schedule, args.stages, args.microbatches, args.chunks)
    return sched, f"--schedule={args.schedule}"
  return None


def _layer_costs(args) -> list[float] | None:
  if args.layer_costs:
    return _floats(args.layer_costs, "--layer_costs")
  if not args.exp:
    return None
  # pylint: disable=g-import-not-at-top
  from spmdtask import main as main_lib
  from spmdtask.core.model import LayerCosts
  cfg = main_lib.build(main_lib.resolved_config(args.exp, args.fdl_set))
  if not isinstance(cfg.task.model, LayerCosts):
    raise ConfigError(f"--exp={args.exp}: its model ({type(cfg.task.model).__name__}) does not "
                      "measure its layer costs (spmdtask.core.model.LayerCosts); give --layer_costs.")
  train = cfg.datasets["train"]
  # The embedding runs with layer 0, the head with the last layer: cuts are layer_cuts.
  return balance_lib.stack_costs(cfg.task.model.layer_costs(train.batch_size, train.seq_len))


def plan(args) -> dict:
  """Everything the tool reports, as one JSON-ready dict (and the chart under 'chart')."""
  out = {}
  found = _schedule(args)
  if found:
    sched, source = found
    sim = simulate_lib.simulate(sched, _costs(args), source)
    if args.write:
      files.dump(sched, args.write)
      out["written"] = args.write
    out.update(
        schedule=args.schedule or args.schedule_file, stages=sched.num_stages,
        microbatches=sched.num_microbatches, chunks=sched.num_chunks,
        placement=sched.placement, makespan=float(sim.makespan),
        bubble_fraction=float(sim.bubble_fraction),
        bubble_fractions=[float(x) for x in sim.bubble_fractions],
        busy=[float(x) for x in sim.busy],
        peak_activations=[float(x) for x in sim.peak_activations],
        peak_weight_grad_stash=[float(x) for x in sim.peak_weight_grad_stash],
        chart=simulate_lib.chart(sim))
  costs = _layer_costs(args)
  if costs is not None:
    stages = out.get("stages", args.stages)
    if stages is None:
      raise ConfigError("Balancing layer costs needs --stages (or a schedule).")
    parts = stages * out.get("chunks", args.chunks)
    cut = balance_lib.balance(costs, parts)
    out.update(layer_costs=costs, parts=parts, cuts=list(cut.cuts),
               stage_costs=list(cut.stage_costs),
               balanced_max_over_mean=max(cut.stage_costs) / (sum(costs) / parts))
  if not out:
    raise ConfigError("Nothing to plan: give --schedule (with --stages and --microbatches), "
                      "--schedule_file, --layer_costs or --exp.")
  return out


def _print_text(out: dict) -> None:
  if "makespan" in out:
    print(f"schedule {out['schedule']}: {out['stages']} stages, {out['microbatches']} "
          f"microbatches, {out['chunks']} chunk(s) per stage ({out['placement']} placement)")
    print(out["chart"])
    print(f"makespan {out['makespan']:g}; bubble fraction (max over stages) "
          f"{out['bubble_fraction']:.4f}")
    for s in range(out["stages"]):
      print(f"  stage{s}: busy {out['busy'][s]:g}  bubble {out['bubble_fractions'][s]:.4f}  "
            f"peak activation sets {out['peak_activations'][s]:g}  "
            f"peak weight-grad stash {out['peak_weight_grad_stash'][s]:g}")
  if "cuts" in out:
    bounds = [0] + out["cuts"] + [len(out["layer_costs"])]
    print(f"balanced cuts of {len(out['layer_costs'])} layer costs into {out['parts']} parts: "
          f"layer_cuts={tuple(out['cuts'])} (slowest / mean = "
          f"{out['balanced_max_over_mean']:.4f})")
    for i, c in enumerate(out["stage_costs"]):
      print(f"  part {i}: layers {bounds[i]}..{bounds[i + 1] - 1}  cost {c:g}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--schedule", help=f"one of {', '.join(generators.GENERATORS)}")
  parser.add_argument("--schedule_file", help="a schedule in the text form, to validate")
  parser.add_argument("--stages", type=int, help="pipeline stages P")
  parser.add_argument("--microbatches", type=int, help="microbatches M")
  parser.add_argument("--chunks", type=int, default=1, help="chunks per stage V")
  parser.add_argument("--costs", default="1,1,1", help="F,B,W per microbatch and stage")
  parser.add_argument("--latency", type=float, default=0.0, help="stage-to-stage transfer")
  parser.add_argument("--layer_costs", help="comma-separated per-layer costs to balance")
  parser.add_argument("--exp", help="take layer costs from this experiment's model")
  parser.add_argument("--fdl_set", action="append", default=[], help="override for --exp")
  parser.add_argument("--write", help="write the schedule here (.csv: torch's compute_only "
                      "CSV; else spmdtask's text form)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  args = parser.parse_args(argv)
  try:
    out = plan(args)
  except ConfigError as e:
    print(f"plan_pipeline: error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps({k: v for k, v in out.items() if k != "chart"}))
  else:
    _print_text(out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
