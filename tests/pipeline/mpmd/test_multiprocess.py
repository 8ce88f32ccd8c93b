"""Multi-process MPMD: 2 processes x 4 CPU devices run lm.TinyLmMpmd as 3 stages of 2, 2 and
4 devices (process 0 owns stages 0 and 1, process 1 stage 2), so activations and gradients
cross processes between submeshes of 2 and 4 devices (mpmd.transfers: a sum over their
union). They train with the losses of one device and evaluate with the numbers of one
process driving all three stages, each process reading and placing only its stages' leaves
of the global batch (no host gather), and their checkpoint resumes in one process as the
SPMD lm.TinyLm on the same loss curve."""
import json
import os
import re

import jax
import numpy as np
import pytest

from tests import subproc as h
from tests import util
from tools import launch_local

STEPS = ("task.train.summary_interval_steps=1", "task.train.save_interval_steps=4",
         "task.train.log_interval_steps=2")
# Stage 0: TP 2; stage 1: DP 2 (both process 0's); stage 2: DP 2 x TP 2 (process 1's).
STAGES = ("task.pipeline.layer_cuts=(1,2)",
          "task.pipeline.submesh_shapes=((1,1,2),(2,1,1),(2,1,2))")
FEED = re.compile(r"MPMD feed: process (\d) of 2 \(stages \[([\d, ]+)\]\) reads (\d+) rows x "
                  r"(\d+) leaves of each global batch of 16 rows and places (\d+) rows x (\d+) "
                  r"leaves \(([a-z, ]*)\)")


def feeds(results) -> list[tuple]:
  """Per process: (stages, rows read, leaves read, rows placed, leaves placed, names)."""
  out = []
  for i, res in enumerate(results):
    m = FEED.findall(res.stderr)
    assert len(m) == 1 and int(m[0][0]) == i, res.stderr[-3000:]
    out.append((m[0][1], *map(int, m[0][2:6]), m[0][6]))
  return out


def launch_two(multi, *args, flags=()):
  python, env = h.python(4)
  results = launch_local.launch(2, 4, h.main_cmd("lm.TinyLmMpmd", multi, *STEPS, *STAGES, *args,
                                                 flags=["--verbosity=0", *flags])[3:],
                                timeout=400, env=env, python=python)
  for i, res in enumerate(results):
    assert res.returncode == 0, f"process {i}: {res.stderr[-3000:]}"
  return results


@pytest.mark.slow
def test_two_processes_stages_of_2_2_and_4_devices_match_one_device_and_resume(tmp_path):
  multi = str(tmp_path / "multi")
  # The reference: lm.TinyLm on one device, in this process (the model lm.TinyLmMpmd splits).
  ref_losses = dict(enumerate(util.train_steps("lm.TinyLm", 6, jax.devices()[:1], (
      "task.ici_mesh_shape=(1, 1, 1)",))[0].tolist(), start=1))
  results = launch_two(multi, "task.train.num_train_steps=4")
  # Each process reads all 16 rows (its input makes whole rows: 3 leaves) and places only
  # its stages' leaves: stage 0 the inputs, the last stage the targets and loss weights.
  assert feeds(results) == [("0, 1", 16, 3, 16, 1, "inputs"),
                            ("2", 16, 3, 16, 2, "targets, weights")]
  # Eval of the step-4 checkpoint: 2 processes, then 1 (the metrics file keeps both lines).
  launch_two(multi, flags=["--mode=eval"])
  res = h.run(h.main_cmd("lm.TinyLmMpmd", multi, *STEPS, *STAGES, flags=["--mode=eval"]))
  assert res.returncode == 0, f"eval in one process: {res.stderr[-3000:]}"
  with open(os.path.join(multi, "eval_metrics.jsonl")) as f:
    two, one = [json.loads(line) for line in f.read().splitlines()[-2:]]
  assert two["step"] == one["step"] == 4 and two["weight"] == one["weight"] > 0
  np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
  multi_losses = h.train_losses(multi)
  assert sorted(multi_losses) == [1, 2, 3, 4]
  print("2 processes, stages of 2, 2 | 4 devices: losses",
        [multi_losses[s] for s in range(1, 5)], "1 device", [ref_losses[s] for s in range(1, 5)])
  np.testing.assert_allclose([multi_losses[s] for s in range(1, 5)],
                             [ref_losses[s] for s in range(1, 5)], rtol=1e-4)
  assert ref_losses[4] < ref_losses[1]  # it trains
  # The 2-process checkpoint (step 4) resumes as the SPMD lm.TinyLm in one process.
  r = h.run(h.main_cmd("lm.TinyLm", multi, *STEPS, "task.train.num_train_steps=6"))
  assert r.returncode == 0, r.stderr[-3000:]
  resumed = h.train_losses(multi)
  np.testing.assert_allclose([resumed[5], resumed[6]], [ref_losses[5], ref_losses[6]], rtol=1e-4)
