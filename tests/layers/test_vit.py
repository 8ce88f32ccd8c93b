"""The second model family: a ViT on 1 device equals its data x model split on 8; it learns,
reports accuracy and resumes."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from spmdtask.run import loop
from tests import subproc, util


def test_tiny_vit_on_one_device_equals_tiny_vit_tp_on_eight():
  one = util.train_steps("vit.TinyVit", 4, jax.devices()[:1])
  eight = util.train_steps("vit.TinyVitTp", 4)
  assert dict(eight[2].mesh.shape) == {"data": 4, "fsdp": 1, "model": 2}
  np.testing.assert_allclose(eight[0], one[0], rtol=1e-5)
  # Adam divides by sqrt(v): an element with a tiny second moment amplifies reduction-order
  # differences, so params get an absolute tolerance of 5e-5 (1 element in 65536 needs more
  # than 2e-5: 2.3e-5 at LLVM -O0).
  util.assert_trees_close(eight[1], one[1], rtol=1e-5, atol=5e-5)


@pytest.mark.slow
def test_vit_trains_evaluates_accuracy_and_resumes(tmp_path):
  job = str(tmp_path / "job")
  run = util.build_run("vit.TinyVitTp", ["task.train.num_train_steps=30",
                                         "task.train.save_interval_steps=20"])
  _, _, losses = loop.train(run, job_log_dir=job)
  lines = [json.loads(l) for l in open(os.path.join(job, "eval_metrics.jsonl"))]
  assert [(l["dataset"], l["step"], l["weight"]) for l in lines] == [("eval", 30, 96.0)]
  assert lines[0]["accuracy"] > 0.2 > 0.1  # chance is 0.1 (10 classes)
  assert losses[-1] < losses[0]
  scalars = subproc.scalars(os.path.join(job, "summaries", "eval_eval"))
  assert scalars["accuracy"][30] == lines[0]["accuracy"]
  # The job as it was at its step-20 checkpoint, resumed to 30: the uninterrupted run's
  # losses.
  shutil.copytree(job, tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "30")
  resumed = loop.train(run, job_log_dir=str(tmp_path / "resumed"))[2]
  np.testing.assert_allclose(resumed, losses[20:], rtol=1e-5)
