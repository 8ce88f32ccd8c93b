"""Loop hooks: the profiler's trace, the progress line's numbers, the non-finite guard's order."""
import glob
import os

import pytest

from spmdtask.run import loop
from spmdtask.errors import TrainingError
from tests import util


def test_profile_steps_write_a_trace(tmp_path):
  run = util.build_run("lm.TinyLm", ["task.train.num_train_steps=3",
                                     "task.train.profile_steps=(2, 1)"])
  loop.train(run, job_log_dir=str(tmp_path))
  traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
  assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*perfetto*"))


class Recorder(loop.Hook):
  def __init__(self):
    self.saved_steps = []

  def after_step(self, step, state, last):
    self.saved_steps.append(step)


def test_guard_stops_before_any_later_hook_sees_the_step():
  run = util.build_run("lm.TinyLm", ["task.train.num_train_steps=6",
                                     "task.train.learning_rate=1e30",
                                     "task.train.log_interval_steps=100"])
  later = Recorder()
  with pytest.raises(TrainingError) as err:
    loop.train(run, hooks=[later])
  step = int(str(err.value).split("Training stopped at step ")[1].split(":")[0])
  # Metrics are fetched only at the last step here, yet the guard names the first bad one.
  assert 2 <= step <= 6 and "task.train.learning_rate=1e+30" in str(err.value)
  assert 6 not in later.saved_steps
