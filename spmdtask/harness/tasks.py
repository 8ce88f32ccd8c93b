"""--mode=lm_eval: lm-evaluation-harness tasks scored with a checkpoint's params on the mesh.

`run_tasks` restores the checkpoint into the decode program's layout (the stack
unpipelined, `run.decoding.decode_task`), finds the tasks (`find_tasks`), runs lm-eval's
`simple_evaluate` with `harness.backend.SpmdtaskLm` and, on process 0, writes
`job_log_dir/lm_eval/results_step<N>.json` (lm-eval's results: metrics, task configs,
versions, few-shot counts), `samples_<task>_step<N>.jsonl` (each document, its requests'
arguments and responses; a later run on the same step writes `..._step<N>_run2...`, never
over an earlier one), the metrics to TensorBoard (`summaries/lm_eval`, `task/metric`
at the checkpoint's step) and one console line per task. Every process runs the same
requests (each feeds its share of each batch's rows: `harness.programs`).

Tasks: lm-eval's own (its index of built-in task YAMLs, which takes lm-eval ~30 s to build
on 2 cores) and those of `include_path` (a dir of task YAMLs: e.g. `dataset_path: json`
with `dataset_kwargs: {data_files: {test: FILE.jsonl}}` reads a local file, a relative
path from that dir: the tasks run with it as the working dir); when every name is in
`include_path` the built-in index is not built. An unknown name, or a task whose
dataset is neither local nor reachable, is a ConfigError.
"""
import contextlib
import dataclasses
import difflib
import io
import json
import time
from typing import Any, Callable

import jax
from absl import logging

from spmdtask import console, fs
from spmdtask.errors import ConfigError
from spmdtask.run import summaries

RESULTS_DIR = "lm_eval"


@dataclasses.dataclass(frozen=True)
class Options:
  """What the command line asks of lm-eval (`--tasks` and the lm_eval flags);
  `include_path` absolute (the tasks run with it as the working dir)."""
  tasks: tuple[str, ...]
  include_path: str | None = None
  num_fewshot: int | None = None
  limit: float | None = None
  batch_size: int = 8
  apply_chat_template: bool = False


def find_tasks(names: tuple[str, ...], include_path: str | None):
  """lm-eval's TaskManager that knows every name (ConfigError, with close names, else)."""
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  if not names:
    raise ConfigError("--mode=lm_eval needs --tasks: lm-eval task names, comma-separated, e.g. "
                      "--tasks=hellaswag,arc_easy (or your own tasks' names with "
                      "--lm_eval_include_path=DIR).")
  if include_path is not None:
    if not fs.isdir(include_path):
      raise ConfigError(f"--lm_eval_include_path={include_path!r} is not a directory; give "
                        "the dir of your lm-eval task YAML files.")
    local = TaskManager(include_path=include_path, include_defaults=False)
    if all(n in local.all_tasks for n in names):
      return local
  console.say("lm-eval: indexing its built-in tasks (lm-eval takes ~30 s for this)")
  manager = TaskManager(include_path=include_path)
  check_known(names, manager.all_tasks)
  return manager


def check_known(names: tuple[str, ...], known: list[str]) -> None:
  """ConfigError naming each of `names` not in `known`, with the known names close to it."""
  unknown = [n for n in names if n not in known]
  if unknown:
    close = {n: difflib.get_close_matches(n, known, n=5) for n in unknown}
    hints = "; ".join(f"{n!r} (close: {', '.join(c)})" if c else repr(n)
                      for n, c in close.items())
    raise ConfigError(
        f"--tasks: no lm-eval task, group or tag is named {hints}. Fix the name (`lm-eval ls "
        "tasks` lists them all), or put your own task YAML in a dir and pass "
        "--lm_eval_include_path=DIR.")


def offline_error(error: Exception, names: tuple[str, ...]) -> ConfigError:
  """The ConfigError for a task whose dataset is neither local nor reachable."""
  return ConfigError(
      f"--tasks={','.join(names)}: a task's dataset is not on this machine and could not be "
      f"fetched ({error}). Run once with network access (datasets keeps it in its cache), or "
      "point a task at local files: a task YAML with `dataset_path: json` and "
      "`dataset_kwargs: {data_files: {test: /path/to/test.jsonl}}` (and `test_split: test`) "
      "in a dir given as --lm_eval_include_path=DIR.")


def evaluate(lm, options: Options, manager) -> dict:
  """lm-eval's results dict (`samples` included) of `lm` on the tasks; relative paths in
  the task YAMLs (a `data_files` entry) are read from `options.include_path`."""
  import lm_eval  # pylint: disable=g-import-not-at-top
  # lm-eval's progress bars go to the log; the console says every minute that it runs.
  where = options.include_path
  with console.elapsed(f"lm-eval: {', '.join(options.tasks)}", every=60.0), \
       contextlib.redirect_stderr(io.StringIO()) as bars, \
       (contextlib.chdir(where) if where else contextlib.nullcontext()):
    try:
      return lm_eval.simple_evaluate(
          model=lm, tasks=list(options.tasks), num_fewshot=options.num_fewshot,
          limit=options.limit, task_manager=manager, log_samples=True,
          apply_chat_template=options.apply_chat_template)
    except ConnectionError as e:  # the datasets library, offline or unreachable
      raise offline_error(e, options.tasks) from None
    finally:
      logging.info("lm-eval's progress bars: %s", bars.getvalue()[-4000:])


def metrics_of(results: dict) -> dict[str, dict[str, float]]:
  """{task: {metric: value}} of lm-eval's numeric results ('acc,none' -> 'acc'; a filter
  other than 'none' stays in the name: 'exact_match,strict-match')."""
  out = {}
  for task, values in results.get("results", {}).items():
    row = {}
    for key, value in values.items():
      if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      metric, _, flt = key.partition(",")
      row[metric if flt == "none" else f"{metric},{flt}"] = float(value)
    out[task] = row
  return out


def table(metrics: dict[str, dict[str, float]], step: int, seconds: float) -> list[str]:
  """Console lines: one per task, its metrics (stderr as ±)."""
  lines = [f"lm_eval step {step}: {console.count(len(metrics), 'task')} in {seconds:.1f} s"]
  for task, row in metrics.items():
    shown = [f"{m} {v:.4f}" + (f" ± {row[m + '_stderr']:.4f}" if m + "_stderr" in row else "")
             for m, v in row.items() if not m.endswith("_stderr")]
    lines.append(f"  {task}: {'  '.join(shown)}")
  return lines


def free_suffix(out_dir: str, step: int) -> str:
  """The suffix that names a new run's files of `step` in `out_dir`: '' for the first run
  of that step, then '_run2', '_run3', ... (an earlier run's files are never overwritten)."""
  taken = set(fs.listdir(out_dir))
  k = 1
  while f"results_step{step}{'' if k == 1 else f'_run{k}'}.json" in taken:
    k += 1
  return "" if k == 1 else f"_run{k}"


def write(job_log_dir: str, step: int, results: dict, seconds: float) -> str:
  """Process 0: results JSON, samples JSONL per task, TensorBoard scalars, the console
  table. Returns the results file's path: `lm_eval/results_step<N>.json`, or where an
  earlier run scored the same step, `results_step<N>_run<k>.json` (`free_suffix`; its
  samples files take the same suffix)."""
  from lm_eval.utils import handle_non_serializable  # pylint: disable=g-import-not-at-top
  metrics = metrics_of(results)
  for line in table(metrics, step, seconds):
    console.say("%s", line)
  if jax.process_index() != 0:
    return ""
  out_dir = fs.join(job_log_dir, RESULTS_DIR)
  fs.makedirs(out_dir)
  suffix = free_suffix(out_dir, step)
  dump = lambda x: json.dumps(x, default=handle_non_serializable, ensure_ascii=False)
  for task, samples in results.get("samples", {}).items():
    fs.write_text(fs.join(out_dir, f"samples_{task}_step{step}{suffix}.jsonl"),
                  "".join(dump(s) + "\n" for s in samples))
  path = fs.join(out_dir, f"results_step{step}{suffix}.json")
  fs.write_text(path, json.dumps({k: v for k, v in results.items() if k != "samples"},
                                 default=handle_non_serializable, indent=1, ensure_ascii=False))
  writer = summaries.SummaryWriter(summaries.summary_dir(job_log_dir, RESULTS_DIR))
  writer.scalars(step, {f"{task}/{m}": v for task, row in metrics.items() for m, v in row.items()})
  writer.close()
  console.say("lm_eval: wrote %s (and the samples beside it)", path)
  return path


def lm_for(run, program, text, batch_size: int, field: str) -> Callable[[Any], Any]:
  """`params -> backend_lib.SpmdtaskLm` scoring with those (live, padded) params of
  `program` (an unpipelined program of `run.task`: decode's, or a scanned train program);
  its scorer and generator are built once, so every call reuses their compiled programs.
  `text` is the job's `harness.backend.Text`; `field` names the batch size in errors."""
  # pylint: disable=g-import-not-at-top  # lm-eval is imported by this mode alone
  from spmdtask.harness import backend as backend_lib, programs
  max_length = int(run.task.model.max_seq_len)
  scorer = programs.Scorer(program, batch_size, max_length, field)
  generator = programs.Generator(program, batch_size, max_length, field)
  return lambda params: backend_lib.SpmdtaskLm(scorer, generator, params, text, max_length,
                                               run.task.decode.stop_ids)


def backend(run, text, batch_size: int, job_log_dir: str, restore_step: int | None,
            example: dict):
  """(`backend_lib.SpmdtaskLm` on the checkpoint's params, its step): the decode
  program of `run.task` set up with `example` (a process-local batch) and restored from
  `job_log_dir`; `text` is the job's `harness.backend.Text`."""
  # pylint: disable=g-import-not-at-top
  from spmdtask.core import program as program_lib
  from spmdtask.run import checkpoints, decoding
  program = program_lib.setup(decoding.decode_task(run.task), example)
  make = lm_for(run, program, text, batch_size, "--lm_eval_batch_size")
  state, step = checkpoints.restore_state(job_log_dir, program, restore_step)
  return make(state.params), step


def score_and_write(lm, options: Options, manager, job_log_dir: str, step: int) -> dict:
  """lm-eval's results of `lm` on the tasks (`evaluate`), written as of `step` (`write`)."""
  t0 = time.perf_counter()
  results = evaluate(lm, options, manager)
  write(job_log_dir, step, results, time.perf_counter() - t0)
  return results


def run_tasks(run, text, options: Options, job_log_dir: str, restore_step: int | None,
              example: dict) -> dict:
  """--mode=lm_eval (module doc); returns lm-eval's results."""
  manager = find_tasks(options.tasks, options.include_path)  # before any restore
  lm, step = backend(run, text, options.batch_size, job_log_dir, restore_step, example)
  return score_and_write(lm, options, manager, job_log_dir, step)
