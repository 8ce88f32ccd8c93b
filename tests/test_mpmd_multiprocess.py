"""Multi-process MPMD: 2 processes x 4 CPU devices, each owning one stage of lm.TinyLmMpmd
(stage 0 on process 0's devices, stage 1 on process 1's), train and evaluate with the
numbers of one process driving both stages on 8 devices, and their checkpoint resumes in
one process on the same loss curve."""
import json
import os

import numpy as np

from tests import subproc as h
from tools import launch_local

STEPS = ("task.train.summary_interval_steps=1", "task.train.save_interval_steps=4",
         "task.train.log_interval_steps=2")


def test_two_processes_one_stage_each_match_one_process_and_resume(tmp_path):
  ref, multi = str(tmp_path / "ref"), str(tmp_path / "multi")
  r = h.run(h.main_cmd("lm.TinyLmMpmd", ref, *STEPS, "task.train.num_train_steps=6"))
  assert r.returncode == 0, r.stderr[-3000:]
  results = launch_local.launch(
      2, 4, h.main_cmd("lm.TinyLmMpmd", multi, *STEPS, "task.train.num_train_steps=4")[3:],
      timeout=400, env=h.env(4))
  for i, res in enumerate(results):
    assert res.returncode == 0, f"process {i}: {res.stderr[-3000:]}"
  # Eval of the step-4 checkpoint: 2 processes, then 1 (the metrics file keeps both lines).
  for launch in (lambda *f: launch_local.launch(2, 4, h.main_cmd("lm.TinyLmMpmd", multi, *STEPS,
                                                                 flags=f)[3:],
                                                timeout=400, env=h.env(4)),
                 lambda *f: [h.run(h.main_cmd("lm.TinyLmMpmd", multi, *STEPS, flags=f))]):
    for i, res in enumerate(launch("--mode=eval")):
      assert res.returncode == 0, f"eval process {i}: {res.stderr[-3000:]}"
  with open(os.path.join(multi, "eval_metrics.jsonl")) as f:
    two, one = [json.loads(line) for line in f.read().splitlines()[-2:]]
  assert two["step"] == one["step"] == 4 and two["weight"] == one["weight"] > 0
  np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
  ref_losses, multi_losses = h.train_losses(ref), h.train_losses(multi)
  assert sorted(multi_losses) == [1, 2, 3, 4]
  np.testing.assert_allclose([multi_losses[s] for s in range(1, 5)],
                             [ref_losses[s] for s in range(1, 5)], rtol=1e-5)
  assert ref_losses[4] < ref_losses[1]  # it trains
  # The 2-process checkpoint (step 4) resumes as the SPMD lm.TinyLm in one process.
  r = h.run(h.main_cmd("lm.TinyLm", multi, *STEPS, "task.train.num_train_steps=6"))
  assert r.returncode == 0, r.stderr[-3000:]
  resumed = h.train_losses(multi)
  np.testing.assert_allclose([resumed[5], resumed[6]], [ref_losses[5], ref_losses[6]], rtol=1e-5)
