"""Eval: same metrics on 1 and 8 devices, partial last batch counted once, modes and errors."""
import dataclasses
import json
import os

import fiddle as fdl
import numpy as np
import pytest

from configs import lm
from spmdtask.run import checkpoints, evaluation, loop
from spmdtask import experiment
from spmdtask.errors import ConfigError
from spmdtask.inputs.synthetic import SyntheticLmInput
from tests import util

SEQ = 64


def eval_input(num_examples=20, batch_size=8, **kw):
  return SyntheticLmInput(batch_size=batch_size, seq_len=SEQ, vocab_size=256, seed=2,
                          num_examples=num_examples, **kw)


@dataclasses.dataclass
class OneBatch:
  """A finite input of exactly one given batch."""
  rows: dict
  num_batches: int = 1

  def batch_at(self, i):
    assert i == 0
    return self.rows


program_and_state = util.program_and_state


def test_metrics_equal_on_1_and_8_devices_and_partial_batch_counted_once():
  one = evaluation.evaluate(*program_and_state("TinyLm", 1), eval_input())
  eight = evaluation.evaluate(*program_and_state("TinyLmFsdpTp", 8), eval_input())
  # 20 examples in batches of 8: 8 + 8 + 4 real rows (4 padded rows weigh 0).
  assert one["num_batches"] == eight["num_batches"] == 3
  assert one["weight"] == eight["weight"] == 20 * SEQ
  assert eight["loss"] == pytest.approx(one["loss"], rel=1e-6)
  # The same 20 rows as one unpadded batch: the same token-weighted mean.
  parts = [eval_input().batch_at(i) for i in range(3)]
  rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  whole = evaluation.evaluate(*program_and_state("TinyLm", 1), OneBatch(rows))
  assert whole["num_batches"] == 1 and whole["weight"] == 20 * SEQ
  assert one["loss"] == pytest.approx(whole["loss"], rel=1e-6)
  # A second pass starts from the beginning again.
  assert evaluation.evaluate(*program_and_state("TinyLm", 1), eval_input()) == one


def test_eval_steps_and_endless_dataset():
  program, state = program_and_state("TinyLm", 1)
  two = evaluation.evaluate(program, state, eval_input(), eval_steps=2)
  assert two["num_batches"] == 2 and two["weight"] == 16 * SEQ
  endless = eval_input(num_examples=None)
  assert evaluation.evaluate(program, state, endless, eval_steps=1)["weight"] == 8 * SEQ
  with pytest.raises(ConfigError, match="task.train.eval_steps"):
    evaluation.evaluate(program, state, endless, eval_steps=None, name="holdout")


def _run(num_train_steps=4, **train_overrides):
  rc = experiment.run_config(lm.TinyLm())
  rc.task.ici_mesh_shape = (8, 1, 1)
  rc.task.train.num_train_steps = num_train_steps
  for k, v in train_overrides.items():
    setattr(rc.task.train, k, v)
  rc.datasets["eval"].num_examples = 20
  return fdl.build(rc)


def test_train_evaluates_every_interval_then_eval_and_continuous_modes(tmp_path):
  run = _run(eval_interval_steps=2, save_interval_steps=2, log_interval_steps=2)
  d = str(tmp_path)
  _, program, _ = loop.train(run, job_log_dir=d)
  lines = [json.loads(l) for l in open(os.path.join(d, evaluation.EVAL_METRICS_FILE))]
  assert [(l["dataset"], l["step"], l["weight"]) for l in lines] == [
      ("eval", 2, 20 * SEQ), ("eval", 4, 20 * SEQ)]
  assert os.listdir(os.path.join(d, "summaries", "eval_eval"))  # a TensorBoard event file

  def restore(step):
    return checkpoints.restore_state(d, program, step)
  # --mode=eval --restore_step=2 gives the metrics train logged at step 2.
  got = evaluation.run_eval(run, program, restore, d, restore_step=2)
  assert got[2]["eval"]["loss"] == pytest.approx(lines[0]["loss"], rel=1e-6)
  # Continuous: checkpoints appear over time; each is evaluated once, oldest first.
  seen = iter([[], [2], [2], [2, 4]])
  calls = []
  def restore_logged(step):
    calls.append(step)
    return restore(step)
  cont = evaluation.run_eval(run, program, restore_logged, d, continuous=True,
                             available=lambda: next(seen), poll_s=0.0)
  assert calls == [2, 4] and sorted(cont) == [2, 4]
  assert cont[4]["eval"]["loss"] == pytest.approx(lines[1]["loss"], rel=1e-6)


def test_eval_mode_errors(tmp_path):
  run = _run()
  program, _ = program_and_state("TinyLm", 8)
  def restore(step):
    return checkpoints.restore_state(str(tmp_path), program, step)
  with pytest.raises(ConfigError, match="no complete checkpoint"):
    evaluation.run_eval(run, program, restore, str(tmp_path))
  no_eval = dataclasses.replace(run, datasets={"train": run.datasets["train"]})
  with pytest.raises(ConfigError, match="no eval dataset"):
    evaluation.run_eval(no_eval, program, restore, str(tmp_path))


def test_eval_reports_the_masked_loss_over_target_tokens():
  """Masked rows (TinyLmSft's eval data): the loss is the mean over target tokens only, all
  batches together (the partial last one's padding weighs 0), not a mean of row means."""
  data = eval_input(num_examples=12, target_mask=True)
  program, state = program_and_state("TinyLmSft", 1)
  got = evaluation.evaluate(program, state, data)
  parts = [data.batch_at(i) for i in range(2)]  # 8 + 4 rows
  rows = [{k: p[k][r:r + 1] for k in p} for p in parts for r in range(len(p["weights"]))]
  each = [evaluation.evaluate(program, state, OneBatch(row)) for row in rows]
  targets = sum(float(p["weights"].sum()) for p in parts)
  assert got["weight"] == targets == sum(e["weight"] for e in each) < 12 * SEQ
  want = sum(e["loss"] * e["weight"] for e in each) / targets
  assert got["loss"] == pytest.approx(want, rel=1e-6)
  assert abs(np.mean([e["loss"] for e in each]) - got["loss"]) > 1e-4  # not per row
