"""Evaluation: the eval datasets of a run, exact token-weighted metrics, summaries, JSON lines.

Every dataset of `RunConfig.datasets` other than 'train' is an eval set. One eval
pass runs `eval_steps` batches, or the whole of a finite dataset. A partial last
batch is padded to the full batch with weight-0 rows, so it compiles nothing new
and its padding counts nowhere. Whatever metrics the model returns (`Weighted` sums and
weights, spmdtask.core.model) are summed on the host in float64 over the batches and reported
as sum / weight: e.g. the loss is the mean over real tokens, whatever the batch split
or mesh.
"""
import json
import math
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from spmdtask import console, fs
from spmdtask.run import summaries
from spmdtask.errors import ConfigError
from spmdtask.core.host_input import batches_of_examples, empty, num_batches
from spmdtask.core.objective import TARGET_TOKENS  # a count by its weight: 1.0 as a mean

EVAL_METRICS_FILE = "eval_metrics.jsonl"


def eval_datasets(datasets: dict[str, Any]) -> dict[str, Any]:
  """The eval sets of a run: every dataset but 'train', in name order."""
  return {k: datasets[k] for k in sorted(datasets) if k != "train"}


def example(run, train_example: Callable[[Any], dict]) -> dict:
  """The process-local batch --mode=eval sets its program up with: `train_example(run)`
  (the train input's), or the first eval dataset's first batch where the train input is
  empty (a data dir prepared for evaluation alone needs no train split)."""
  evals = eval_datasets(run.datasets)
  if evals and "train" in run.datasets and empty(run.datasets["train"]):
    return next(iter(evals.values())).batch_at(0)
  return train_example(run)


def pad_batch(local: dict, rows: int) -> dict:
  """Pads every array of a host-local batch to `rows` rows with zeros (weights 0)."""
  def pad(x):
    x = np.asarray(x)
    if x.shape[0] == rows:
      return x
    return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)])
  return {k: pad(v) for k, v in local.items()}


def _batches(name: str, inputs, eval_steps: int | None):
  """Host-local batches of one eval pass (from the start of the dataset each time)."""
  total = num_batches(inputs)
  if eval_steps is None and total is None:
    raise ConfigError(
        f"Eval dataset {name!r} is endless, so an eval pass needs a length: set "
        "task.train.eval_steps (batches per eval), or make the dataset finite (e.g. its "
        "num_examples field).")
  n = total if eval_steps is None else (eval_steps if total is None else min(eval_steps, total))
  if hasattr(inputs, "batch_at"):
    return (inputs.batch_at(i) for i in range(n))
  it = iter(inputs)
  return (next(it) for _ in range(n))


def evaluate(program, state, inputs, eval_steps: int | None = None,
             name: str = "eval") -> dict[str, float]:
  """One eval pass of `inputs` with `program.eval`.

  Returns every model metric as sum(value · weight) / sum(weight) over every batch,
  plus `weight` (the loss's summed weight, e.g. real tokens or examples), `num_batches` and,
  where the dataset says how many examples it has, `dataset_batches` (its whole pass: the
  pass covered all of it where the two are equal).
  """
  rows = getattr(inputs, "local_batch_size", None)
  results = []
  for local in _batches(name, inputs, eval_steps):
    rows = rows or next(iter(local.values())).shape[0]
    results.append(program.eval(state, program.global_batch(pad_batch(local, rows))))
  fetched = jax.device_get(results)
  out = {}
  for key in (fetched[0] if fetched else {}):
    total = math.fsum(float(m[key].weight) for m in fetched)
    out[key] = math.fsum(float(m[key].sum) for m in fetched) / total if total else float("nan")
  out["weight"] = math.fsum(float(m["loss"].weight) for m in fetched)
  out["num_batches"] = float(len(fetched))
  whole = batches_of_examples(inputs)
  if whole is not None:
    out["dataset_batches"] = float(whole)
  return out


def write(job_log_dir: str | None, name: str, step: int, metrics: dict[str, float]) -> None:
  """Process 0: TensorBoard scalars to summaries/eval_<name>, and one JSON line."""
  if jax.process_index() != 0:
    return
  record = {"dataset": name, "step": int(step), **metrics}
  line = json.dumps(record, sort_keys=True)
  logging.info("eval %s", line)
  console.say("%s", readable(name, step, metrics))
  if job_log_dir is None:
    return
  writer = summaries.SummaryWriter(summaries.summary_dir(job_log_dir, f"eval_{name}"))
  writer.scalars(step, metrics)
  writer.close()
  fs.append_text(fs.join(job_log_dir, EVAL_METRICS_FILE), line + "\n")


def readable(name: str, step: int, metrics: dict[str, float]) -> str:
  """One console line: the dataset, the step, the model's metrics, then the counts."""
  shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                    if k not in ("weight", "num_batches", "dataset_batches", TARGET_TOKENS))
  n, whole = metrics.get("num_batches", 0), metrics.get("dataset_batches")
  if whole is None:
    covered = console.count(n, "batch")
  elif n >= whole:
    covered = f"{console.count(n, 'batch')}: all of it"
  else:
    covered = (f"{n:.0f} of its {console.count(whole, 'batch')}: capped by "
               "task.train.eval_steps or the dataset's num_batches")
  return (f"eval dataset {name!r}, step {step}: {shown}  "
          f"({covered}, weight {metrics.get('weight', 0):.0f})")


def evaluate_all(datasets: dict[str, Any], program, padded_state, step: int,
                 eval_steps: int | None, job_log_dir: str | None) -> dict[str, dict]:
  """Evaluates and writes every eval dataset; returns metrics by dataset name."""
  out = {}
  for name, inputs in eval_datasets(datasets).items():
    out[name] = evaluate(program, padded_state, inputs, eval_steps, name)
    write(job_log_dir, name, step, out[name])
  return out


def run_eval(run, program, restore: Callable[[int | None], tuple[Any, int]], job_log_dir: str,
             restore_step: int | None = None, continuous: bool = False,
             available: Callable[[], list[int]] | None = None, poll_s: float = 30.0,
             timeout_s: float = 3600.0) -> dict[int, dict]:
  """--mode=eval: evaluates a checkpoint, or (continuous) each new one exactly once.

  Args:
    run: the built RunConfig.
    program: `program.setup(...)` for run.task.
    restore: `step | None -> (padded_state, step)`, e.g. checkpoints.restore_state bound to
      job_log_dir and program; raises ConfigError when there is no checkpoint.
    restore_step: the step to evaluate; None = the latest.
    continuous: poll `available()` (the complete checkpoint steps) and evaluate every step
      not yet evaluated, oldest first, until the one at num_train_steps is done or none
      appears for `timeout_s`.
  Returns:
    {step: {dataset: metrics}}.
  """
  if not eval_datasets(run.datasets):
    raise ConfigError("The experiment has no eval dataset: Experiment.datasets() returns only "
                      f"{sorted(run.datasets)}. Add one under a name other than 'train'.")
  eval_steps = run.task.train.eval_steps
  if not continuous:
    state, step = restore(restore_step)
    return {step: evaluate_all(run.datasets, program, state, step, eval_steps, job_log_dir)}
  done, last_new = {}, time.monotonic()
  while True:
    new = [s for s in sorted(available()) if s not in done]
    for want in new:
      state, step = restore(want)
      done[step] = evaluate_all(run.datasets, program, state, step, eval_steps, job_log_dir)
      last_new = time.monotonic()
    if done and max(done) >= run.task.train.num_train_steps:
      return done
    if not new and time.monotonic() - last_new > timeout_s:
      logging.info("No new checkpoint for %.0f s; continuous eval ends.", timeout_s)
      return done
    time.sleep(poll_s)
