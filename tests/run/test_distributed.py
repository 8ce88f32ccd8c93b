"""Multi-host: 2 processes x 4 CPU devices (jax.distributed over gloo), joined through what
`srun` sets, train exactly like one process with 8 devices, and their checkpoint resumes in a
single process. Eval and decode on 2 processes joined by flags give the metrics and tokens of
1 process.

The jobs have the model and the settings of tests/inputs/test_tfdata.py's 2-process job: the
same programs, built once in the persistent XLA cache for both files."""
import json
import os

import numpy as np
import pytest

from tests import subproc as h
from tools import launch_local

# One layer: every check compares runs of the same model; the losses still fall step by step.
STEPS = ("task.train.summary_interval_steps=1", "task.train.save_interval_steps=6",
         "task.train.log_interval_steps=2", "task.model.num_layers=1")


def _launch(job, *args, cluster="flags"):
  python, env = h.python(4)
  results = launch_local.launch(2, 4, h.main_cmd("lm.TinyLm", job, *STEPS, flags=args)[3:],
                                timeout=400, env=env, cluster=cluster, python=python)
  for i, res in enumerate(results):
    assert res.returncode == 0, f"process {i}: {res.stderr[-3000:]}"
  return results


@pytest.fixture(scope="session")
def ref(tmp_path_factory):
  """A 1-process, 8-device run of 8 steps: the losses every layout must give, and at step 8
  its eval (eval_metrics.jsonl): the metrics of 1 process, as --mode=eval gives them (the same
  `evaluation.evaluate_all` on the same state; one launch fewer)."""
  job = str(tmp_path_factory.mktemp("ref") / "job")
  r = h.run(h.main_cmd("lm.TinyLm", job, *STEPS, "task.train.num_train_steps=8",
                       "task.train.eval_interval_steps=8"))
  assert r.returncode == 0, r.stderr[-3000:]
  return job


@pytest.mark.slow
def test_two_processes_in_an_srun_environment_match_one_and_resume_on_one(tmp_path, ref):
  """2 processes given only what `srun` sets (no spmdtask flags) join through JAX's SLURM
  detection (the default --multihost=auto), train like 1 process, and their checkpoint
  resumes in 1 process."""
  multi = str(tmp_path / "multi")
  results = _launch(multi, "--fdl_set=task.train.num_train_steps=6", cluster="slurm")
  assert "Joined a 2-process job (slurm) as process 0." in results[0].stdout
  # Only process 0 writes summaries (one event file) and the config.
  events = list((tmp_path / "multi" / "summaries" / "train").iterdir())
  assert len(events) == 1
  ref_losses, multi_losses = h.train_losses(ref), h.train_losses(multi)
  assert sorted(multi_losses) == list(range(1, 7))
  got = np.asarray([multi_losses[s] for s in range(1, 7)])
  want = np.asarray([ref_losses[s] for s in range(1, 7)])
  print("slurm-env 2-process losses", got.tolist(), "1-process", want.tolist(),
        "max rel diff", float(np.max(np.abs(got / want - 1))))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # The 2-process checkpoint at step 6 resumes in one process with 8 devices.
  r = h.run(h.main_cmd("lm.TinyLm", multi, *STEPS, "task.train.num_train_steps=8"))
  assert r.returncode == 0, r.stderr[-3000:]
  resumed = h.train_losses(multi)
  np.testing.assert_allclose([resumed[7], resumed[8]], [ref_losses[7], ref_losses[8]], rtol=1e-5)


@pytest.mark.slow
def test_eval_and_decode_on_two_processes_match_one(ref):
  """On the reference job's last checkpoint (step 8): 2 processes joined by flags evaluate
  (--mode=eval) with the metrics of 1 process (the reference's own eval at step 8) and
  decode (--mode=decode) the tokens of 1 process."""
  job = ref
  outputs = []
  for launch in (lambda *a: h.run(h.main_cmd("lm.TinyLm", job, *STEPS, flags=a)),
                 lambda *a: _launch(job, *a)):
    for mode in ("eval", "decode") if outputs else ("decode",):
      result = launch(f"--mode={mode}")
      assert getattr(result, "returncode", 0) == 0, result.stderr[-3000:]
    with open(os.path.join(job, "eval_metrics.jsonl")) as f:
      metrics = json.loads(f.read().splitlines()[-1])
    with open(os.path.join(job, "decoder_out", "prompts_step8.jsonl")) as f:
      outputs.append((metrics, [json.loads(l) for l in f]))
  (one_metrics, one_tokens), (two_metrics, two_tokens) = outputs
  assert one_metrics["step"] == two_metrics["step"] == 8
  assert two_metrics["weight"] == one_metrics["weight"] > 0
  np.testing.assert_allclose(two_metrics["loss"], one_metrics["loss"], rtol=1e-6)
  assert two_tokens == one_tokens and len(one_tokens) > 0
