"""Loop hooks: the profiler's trace, the progress line's numbers, the non-finite guard's order."""
import glob
import os

import pytest

from spmdtask.core import host_input
from spmdtask.plan import chips
from spmdtask.run import loop
from spmdtask.errors import TrainingError
from tests import subproc as h
from tests import util


def test_profile_steps_write_a_trace(tmp_path):
  # Step 2 traced as the last step (steps cost ~1 s of CPU each: none after it).
  run = util.build_run("lm.TinyLm", ["task.train.num_train_steps=2",
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
  # 3 steps: step 1's loss is finite (the initial params), step 2's is not; fetched at 3.
  run = util.build_run("lm.TinyLm", ["task.train.num_train_steps=3",
                                     "task.train.learning_rate=1e30",
                                     "task.train.log_interval_steps=100"])
  later = Recorder()
  with pytest.raises(TrainingError) as err:
    loop.train(run, hooks=[later])
  step = int(str(err.value).split("Training stopped at step ")[1].split(":")[0])
  # Metrics are fetched only at the last step here, yet the guard names the first bad one.
  assert 2 <= step <= 3 and "task.train.learning_rate=1e+30" in str(err.value)
  assert 3 not in later.saved_steps


def test_masked_data_reports_target_tokens_per_second(tmp_path, caplog):
  """TinyLmSft (target masks): the progress line gives target tokens/s beside tokens/s, and
  TensorBoard each step's global target count (its batch's summed weights) and the rate."""
  run = util.build_run("lm.TinyLmSft", ["task.train.num_train_steps=2",
                                        "task.train.log_interval_steps=1",
                                        "task.train.summary_interval_steps=1"])
  with caplog.at_level("INFO", logger="absl"):  # whatever verbosity an earlier test left
    loop.train(run, job_log_dir=str(tmp_path))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert len(lines) == 2 and all(" target)  MFU " in l for l in lines), lines
  got = h.scalars(os.path.join(tmp_path, "summaries", "train"))
  inputs = util.build_run("lm.TinyLmSft").datasets["train"]
  for step in (1, 2):  # step s trained on batch s - 1
    assert got["target_tokens"][step] == inputs.batch_at(step - 1)["weights"].sum()
    assert 0 < got["target_tokens_per_sec"][step] < got["tokens_per_sec"][step]
  # Unmasked data (decided once, from the input): the line has no target rate.
  assert not host_input.target_masked(util.build_run("lm.TinyLm").datasets["train"])
  caplog.clear()
  fetched = loop.Fetched(2, [{"loss": 1.0, "target_tokens": 9.0}],
                         {"steps_per_sec": 1.0, "tokens_per_sec": 10.0, "mfu": 0.1})
  with caplog.at_level("INFO", logger="absl"):  # whatever verbosity an earlier test left
    loop.ProgressLog(1, 4, chips.mfu_peak("cpu", 1e9)).on_metrics(fetched, last=False)
  line, = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert "10 tokens/s  MFU" in line and "target" not in line
