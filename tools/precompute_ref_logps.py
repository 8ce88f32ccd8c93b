"""Runs a DPO experiment's reference once over a preference data dir and writes its summed
log-probs beside the pairs, so training need not run the reference in every step.

    python tools/precompute_ref_logps.py --exp=TinyLmDpo --data_dir=/data/prefs_l31 \\
        --fdl_set=task.model.vocab_size=300

The reference is the one training would run in its step (spmdtask.run.reference: the
objective's reference_checkpoint_dir, else task.train.init_checkpoint_dir, else the fresh
init; a LoRA model's is its base, adapters off), on the experiment's mesh and batch. For each
split of the data dir it writes `<split>_ref_logps.npy` [pairs, 2] float32 (chosen,
rejected). Then train with --fdl_set=task.objective.reference=\\'precomputed\\' (the input
then reads them). A config error exits 2 with one paragraph.
"""
import argparse
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
import fiddle as fdl
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdtask import fs, main as spmdtask_main
from spmdtask.core import objective as objective_lib, program as program_lib, sharding, steps
from spmdtask.core.objective import Reference
from spmdtask.errors import ConfigError
from spmdtask.inputs import preferences
from spmdtask.objectives import dpo
from spmdtask.run import checkpoints, reference


def reference_params(task, program):
  """The live (padded) reference params training would use (module doc)."""
  kind = program.reference_kind
  if kind is Reference.PARAMS:
    return reference.attach(task, program).reference
  if kind is Reference.ADAPTERS_OFF:
    state = checkpoints.initial_state(None, program, None, None,
                                      task.train.init_checkpoint_dir)
    return objective_lib.adapters_off(state.params)
  raise ConfigError("The experiment's objective needs no reference (task.objective is "
                    f"{type(task.objective).__name__}); precompute is for DPO.")


def precompute(exp: str, data_dir: str, overrides: list[str]) -> dict[str, np.ndarray]:
  """{split: [pairs, 2] float32 reference log-probs} of every split of `data_dir`, written
  beside its pairs (process 0 writes)."""
  # The reference runs here, so the config's own inputs must not look for these files.
  cfg = spmdtask_main.resolved_config(exp, overrides + ["task.objective.reference='in_step'"],
                                      data_dir)
  run = fdl.build(cfg)
  task = run.task
  if not isinstance(task.objective, dpo.Dpo):
    raise ConfigError(f"--exp={exp} trains no DPO objective (task.objective is "
                      f"{type(task.objective).__name__}); give a DPO experiment, e.g. TinyLmDpo.")
  program = program_lib.setup(task, run.datasets["train"].batch_at(0))
  ref = reference_params(task, program)
  model, layout = program.model, program.layout
  objective = task.objective

  def logps(padded, batch):
    rows = objective.model_batch(batch)
    params = sharding.unpad(padded, layout.logical.params)
    return dpo.sequence_logps(model, params, rows).reshape(-1, 2)

  fn = steps.partition(logps, program.mesh, (layout.split.params, program.batch_specs), P())
  out = {}
  for split in sorted(run.datasets):
    inputs = run.datasets[split]
    if not isinstance(inputs, preferences.PreferenceInput):
      continue
    got, step = [], 0
    while sum(len(g) for g in got) < inputs.num_pairs:
      got.append(np.asarray(jax.device_get(fn(ref, program.global_batch(inputs.batch_at(step))))))
      step += 1
    out[split] = np.concatenate(got)[:inputs.num_pairs].astype(np.float32)
    if jax.process_index() == 0:
      buf = io.BytesIO()
      np.save(buf, out[split])
      fs.write_bytes(fs.join(data_dir, preferences.ref_logps_name(split)), buf.getvalue())
  if not out:
    raise ConfigError(f"--exp={exp} reads no prepared pairs from --data_dir={data_dir!r}; give "
                      "an experiment whose datasets are PreferenceInputs (e.g. TinyLmDpo).")
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--exp", required=True, help="a DPO experiment, e.g. TinyLmDpo")
  parser.add_argument("--data_dir", required=True, help="a tools/prepare_pref_data.py dir")
  parser.add_argument("--fdl_set", action="append", default=[],
                      help="path=value, as spmdtask.main takes it")
  args = parser.parse_args(argv)
  try:
    out = precompute(args.exp, args.data_dir, args.fdl_set)
  except ConfigError as e:
    print(f"precompute_ref_logps: config error: {e}", file=sys.stderr)
    sys.exit(2)
  for split, x in out.items():
    print(f"{fs.join(args.data_dir, preferences.ref_logps_name(split))}: {len(x)} pairs, "
          f"mean reference log-prob chosen {x[:, 0].mean():.4f}, rejected {x[:, 1].mean():.4f}")
  print("Train with them: add --fdl_set=task.objective.reference=\\'precomputed\\'")


if __name__ == "__main__":
  main()
