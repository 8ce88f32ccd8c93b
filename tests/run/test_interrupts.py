"""Ctrl-C: the binary saves the step it was at, exits 130 with one line, and the rerun of
the same command resumes there on the uninterrupted run's losses."""
import pytest
import os
import signal

import numpy as np

from spmdtask.run import checkpoints
from tests import subproc, util

# The signal comes after step 2 (the warmup's first step, at lr 0, leaves the params as
# initialized): the steps after it leave room for a loaded machine (each step costs ~1 s of
# CPU, in the interrupted run, its rerun and the reference alike).
STEPS = 7
OVERRIDES = (f"task.train.num_train_steps={STEPS}", "task.train.log_interval_steps=1",
             "task.train.summary_interval_steps=1", "task.train.save_interval_steps=1000")


@pytest.mark.slow
def test_ctrl_c_saves_the_current_step_and_the_rerun_resumes_on_the_same_losses(tmp_path):
  job = str(tmp_path / "job")
  cmd = subproc.main_cmd("lm.TinyLm", job, *OVERRIDES)
  out_path = tmp_path / "out.txt"
  code = subproc.signal_once_printed(cmd, out_path, "step 2/", signal.SIGINT)
  text = out_path.read_text()
  # A stop that takes over 10 s (a loaded machine) is acknowledged; where it lands varies.
  lines = [l for l in text.splitlines() if not l.startswith("Ctrl-C: saving at the end")]
  assert code == 130, text[-3000:]
  assert "Traceback" not in text
  step = int(lines[-1].split("Interrupted at step ")[1].split(":")[0])
  assert lines[-1] == f"Interrupted at step {step}: saved; rerun the same command to resume."
  assert 2 <= step < STEPS, text
  assert lines[-2].startswith("Goodput ")  # the run's goodput line (run.goodput)
  assert lines[-3].startswith(f"step {step}/{STEPS} ")  # nothing else printed in between
  assert checkpoints.complete_steps(checkpoints.checkpoint_dir(job)) == [step]

  rerun = subproc.run(cmd)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"Resuming from the checkpoint at step {step}; training to step {STEPS}." in rerun.stdout
  got = subproc.train_losses(job)  # both runs' summaries: steps 1..STEPS
  assert sorted(got) == list(range(1, STEPS + 1))

  want, _, _, _ = util.train_steps("lm.TinyLm", STEPS, overrides=OVERRIDES)  # uninterrupted
  np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], want, rtol=1e-5)
  print(f"interrupted at step {step}, exit {code}; resumed losses (steps {step + 1}-{STEPS}) "
        f"{[round(got[s], 6) for s in range(step + 1, STEPS + 1)]}; uninterrupted "
        f"{[round(float(x), 6) for x in want[step:]]}")
