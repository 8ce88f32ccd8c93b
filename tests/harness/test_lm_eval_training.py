"""lm-eval during training (`task.train.lm_eval_*`, `harness.training`): a 2-step fine-tune of
the tiny imported Llama of tests/harness/data/lm_eval, scored after each step on the three
local tasks (2 documents each) on the live params, equals --mode=lm_eval's backend on the
step's checkpoint; the fields' mistakes are ConfigErrors before any step.

One training and one reference scoring for the module (in-process, 8 emulated devices).
"""
import dataclasses
import json
import os

import numpy as np
import pytest

from spmdtask import console
from spmdtask.errors import ConfigError
from spmdtask.harness import command, tasks, training
from spmdtask.run import goodput_events, loop, rollout
from spmdtask.task import TrainParams
from tests import util
from tests.harness.test_lm_eval import (NAMES, TASK_DIR, import_run, leaves, offline,
                                        run_of)

STEPS = 2
EVAL = ("task.train.learning_rate=0.01", f"task.train.num_train_steps={STEPS}",
        "task.train.save_interval_steps=1", "task.train.lm_eval_every_n_steps=1",
        f"task.train.lm_eval_tasks={list(NAMES)!r}",
        f"task.train.lm_eval_include_path={TASK_DIR!r}", "task.train.lm_eval_limit=2")


def _read(job: str, name: str):
  with open(os.path.join(job, "lm_eval", name)) as f:
    return json.load(f) if name.endswith(".json") else [json.loads(l) for l in f]


def _responses(samples: list) -> list:
  return json.loads(json.dumps([s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(job dir, its run config, the console's lines, --mode=lm_eval's results on the last
  checkpoint)."""
  job = str(tmp_path_factory.mktemp("lm_eval_training") / "job")
  import_run(job)  # the step-0 checkpoint training starts from
  run = run_of(job, *EVAL)
  lines = []
  with pytest.MonkeyPatch.context() as patch:
    offline(patch)
    patch.setattr(console, "say", lambda fmt, *args: lines.append(fmt % args if args else fmt))
    loop.train(run, job_log_dir=job, hooks=command.train_hooks(run, job))
    options = tasks.Options(NAMES, TASK_DIR, limit=2)
    lm, step = tasks.backend(run, command.text_of(run, False), 8, job, STEPS, rollout.example(run))
    assert step == STEPS
    reference = tasks.evaluate(lm, options, tasks.find_tasks(NAMES, TASK_DIR))
  return job, run, lines, reference


def test_each_eval_writes_its_step_and_the_last_equals_lm_eval_mode_on_its_checkpoint(trained):
  job, _, lines, reference = trained
  for step in range(1, STEPS + 1):
    assert set(_read(job, f"results_step{step}.json")["configs"]) == set(NAMES)
    assert f"lm_eval: wrote {os.path.join(job, 'lm_eval', f'results_step{step}.json')} (and " \
           "the samples beside it)" in lines
    (head,) = [i for i, l in enumerate(lines) if l.startswith(f"lm_eval step {step}: 3 tasks")]
    assert [l.split(":")[0] for l in lines[head + 1:head + 4]] == [f"  {n}" for n in NAMES]
  # Step 2's numbers, per request and per metric, equal a --mode=lm_eval run on step 2's
  # checkpoint: the same params (float32 round trip through the checkpoint), the same programs.
  written = _read(job, f"results_step{STEPS}.json")
  for task in NAMES:
    got = _responses(_read(job, f"samples_{task}_step{STEPS}.jsonl"))
    want = _responses(reference["samples"][task])
    assert len(got) == len(want) == 2 and len(leaves(got)) == len(leaves(want)), task
    for g, w in zip(leaves(got), leaves(want)):
      if isinstance(w, float):
        assert abs(g - w) <= 1e-5, (task, g, w)
      else:
        assert g == w, (task, g, w)  # is_greedy, generated strings
    for metric, value in tasks.metrics_of(reference)[task].items():
      np.testing.assert_allclose(tasks.metrics_of(written)[task][metric], value, rtol=1e-5,
                                 err_msg=f"{task} {metric}")
  # Training moved the params between the evals: step 1's perplexity is not step 2's.
  ppl = [tasks.metrics_of(_read(job, f"results_step{s}.json"))["tiny_ppl"]["word_perplexity"]
         for s in (1, 2)]
  assert abs(ppl[0] / ppl[1] - 1) > 1e-3, ppl


def test_the_scalars_go_where_lm_eval_mode_puts_them_and_goodput_counts_an_eval(trained):
  # (what they hold: tasks.write's, as tests/harness/test_lm_eval.py reads them back)
  assert any(n.startswith("events.out.tfevents")
             for n in os.listdir(os.path.join(trained[0], "summaries", "lm_eval")))
  (lines,) = goodput_events.read(trained[0])
  assert sum(w["seconds"].get("eval", 0.0) for w in lines if "seconds" in w) > 0


def test_the_fields_mistakes_are_config_errors(trained):
  def check(match, **fields):
    with pytest.raises(ConfigError, match=match):
      TrainParams(**fields).validate()
  check(r"lm_eval_tasks=\('a',\) and task.train.lm_eval_every_n_steps=0 go together",
        lm_eval_tasks=("a",))
  check(r"lm_eval_tasks=\(\) and .*lm_eval_every_n_steps=5 go together", lm_eval_every_n_steps=5)
  check(r"lm_eval_tasks='a,b' must be a list", lm_eval_tasks="a,b", lm_eval_every_n_steps=5)
  check(r"lm_eval_every_n_steps=-1 must be an integer >= 0", lm_eval_every_n_steps=-1)
  check(r"lm_eval_limit=0 must be", lm_eval_tasks=("a",), lm_eval_every_n_steps=1,
        lm_eval_limit=0)
  job, run = trained[:2]
  text = command.text_of(run, False)
  options = tasks.Options(NAMES, TASK_DIR)
  piped = dataclasses.replace(run, task=dataclasses.replace(run.task, pipeline=object()))
  with pytest.raises(ConfigError, match="task.pipeline=object.*--mode=lm_eval --restore_step"):
    training.PeriodicLmEval(piped, text, options, 1, job)
  no_tokenizer = util.build_run("lm.TinyLm", ["task.train.lm_eval_every_n_steps=1",
                                              "task.train.lm_eval_tasks=['tiny_mc']"])
  with pytest.raises(ConfigError, match="task.train.lm_eval_tasks needs the experiment's tok"):
    command.train_hooks(no_tokenizer, job)
