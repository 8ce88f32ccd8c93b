"""What a person reads: the default run's console, a finished job's rerun, a diverged run."""
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from spmdtask import checkpoints
from tests import subproc


def test_default_run_console_rerun_and_nan_stop(tmp_path):
  job = str(tmp_path)
  out = subproc.run(subproc.main_cmd("lm.TinyLm", job), timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = (out.stdout + out.stderr).splitlines()
  assert len(lines) <= 25, "\n".join(lines)
  assert lines[0].startswith("lm.TinyLm: 1.05M params on mesh data=8 fsdp=1 model=1")
  assert "per device" in lines[0] and job in lines[1]
  progress = [l for l in lines if l.startswith("step ")]
  assert [l.split()[1] for l in progress] == ["5/20", "10/20", "15/20", "20/20"]
  for l in progress:
    assert "tokens/s" in l and "MFU" in l and "peak 1.3e+11" in l and "ETA" in l
    assert math.isfinite(float(l.split("loss ")[1].split()[0]))
  assert not any("orbax" in l or "checkpoint_manager" in l for l in lines)
  assert "Saving checkpoint" in open(os.path.join(job, "logs", "spmdtask.INFO")).read()

  again = subproc.run(subproc.main_cmd("lm.TinyLm", job), timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  finished = [l for l in again.stdout.splitlines() if "Nothing to do" in l]
  assert len(finished) == 1 and "step 20" in finished[0] and "num_train_steps=20" in finished[0]

  # Resumed at 20 with an absurd learning rate: stops at the first non-finite step, exit 3,
  # nothing non-finite saved although every step would be.
  diverged = subproc.run(subproc.main_cmd(
      "lm.TinyLm", job, "task.train.learning_rate=1e30", "task.train.num_train_steps=30",
      "task.train.save_interval_steps=1"), timeout=300)
  assert diverged.returncode == 3, diverged.stderr[-3000:]
  assert "Resuming from the checkpoint at step 20" in diverged.stdout
  assert "Traceback" not in diverged.stderr
  (msg,) = [l for l in diverged.stderr.splitlines() if l.startswith("spmdtask: training stopped")]
  step = int(msg.split("Training stopped at step ")[1].split(":")[0])
  assert 21 <= step <= 30 and "task.train.learning_rate=1e+30" in msg
  assert "task.train.clip_grad_norm" in msg
  steps = checkpoints.complete_steps(checkpoints.checkpoint_dir(job))
  assert max(steps) == step - 1
  with ocp.StandardCheckpointer() as reader:
    saved = reader.restore(os.path.join(checkpoints.checkpoint_dir(job), str(max(steps)),
                                        "params"))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved))
