"""TensorBoard summaries: read back with tensorboard's own EventAccumulator."""
import os

import jax
import pytest

from tests import subproc as h
from spmdtask.run import summaries

TAGS = ("loss", "learning_rate", "grad_norm", "param_norm", "steps_per_sec", "tokens_per_sec",
        "mfu")


def test_train_writes_each_scalar_at_the_summary_steps(tmp_path):
  job = str(tmp_path / "job")
  r = h.run(h.main_cmd("TinyLm", job, "task.train.num_train_steps=7",
                       "task.train.summary_interval_steps=3", "task.train.save_interval_steps=100",
                       "task.train.peak_flops_per_device=1e9"))
  assert r.returncode == 0, r.stderr[-3000:]
  got = h.scalars(os.path.join(job, "summaries", "train"))
  for tag in TAGS:
    assert sorted(got[tag]) == [3, 6, 7], tag  # every 3 steps, and the last one
  assert all(0 < v < 1e6 for v in got["mfu"].values())
  assert all(v > 0 for t in ("steps_per_sec", "tokens_per_sec", "grad_norm", "param_norm")
             for v in got[t].values())
  # The TinyLm schedule warms up linearly over 5 steps to 3e-3: lr(step 2) = 1.2e-3.
  assert got["learning_rate"][3] == pytest.approx(1.2e-3, rel=1e-5)


def test_writer_is_a_noop_off_process_zero(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  w = summaries.SummaryWriter(str(tmp_path / "train"))
  w.scalars(1, {"loss": 1.0})
  w.flush()
  w.close()
  assert not w.active and not os.path.exists(tmp_path / "train")
  none = summaries.SummaryWriter(None)
  none.scalars(1, {"loss": 1.0})
  assert not none.active
