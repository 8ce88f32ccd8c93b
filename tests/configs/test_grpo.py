"""configs/grpo.py's LlamaGrpoImport end to end: examples/tiny_chat's model imported, its
prompts prepared (tools/prepare_prompt_data.py), GRPO from the import with a reward from a
user's file (--reward=FILE:FN:WEIGHT); each step's reward metrics are the weighted values
the user's function returned, and the first step's loss is what they imply."""
import json
import os

import jax
import numpy as np
import pytest

from spmdtask import main
from spmdtask.errors import ConfigError
from spmdtask.run import loop, rollout
from tests.subproc import REPO
from tools import convert_hf, prepare_prompt_data

EXAMPLE = os.path.join(REPO, "examples", "tiny_chat")
# The user's reward; it also logs what it returned (its own business), for the test to read.
REWARD = '''\
import json, os

def digits(prompts, completions, answers):
  values = [sum(ch.isdigit() for ch in c) / (1 + len(c)) + (a == 3) for c, a in
            zip(completions, answers)]
  with open(os.path.join(os.path.dirname(__file__), "seen.jsonl"), "a") as f:
    f.write(json.dumps(values) + "\\n")
  return values
'''
WEIGHT = 0.5


class _Metrics(loop.Hook):
  def __init__(self):
    self.steps = []

  def wants_metrics(self, step, last):
    return True

  def on_metrics(self, fetched, last):
    self.steps += fetched.metrics


@pytest.mark.slow
def test_grpo_on_an_import_with_a_reward_from_a_user_file(tmp_path):
  base, data, job = (str(tmp_path / d) for d in ("base", "prompts", "grpo"))
  lines = convert_hf.from_hf(os.path.join(EXAMPLE, "model"), base)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": a + b}) + "\n"
                             for a, b in ((1, 2), (3, 4), (2, 1), (5, 1))))
  meta = prepare_prompt_data.prepare(str(prompts), base, data)
  assert meta["stop_ids"] == [6]  # <|eot_id|>: the template's end of turn and the eos
  (tmp_path / "my_rewards.py").write_text(REWARD)
  cfg = main.resolved_config(
      "grpo.LlamaGrpoImport",
      lines + [f"task.train.init_checkpoint_dir='{base}'", "task.train.num_train_steps=2",
               "datasets['train'].batch_size=2", "task.objective.max_new_tokens=6",
               "task.objective.loss_type='grpo'", "task.train.learning_rate=1e-3"],
      data, reward=[f"{tmp_path}/my_rewards.py:digits:{WEIGHT}"])
  run = main.build(cfg)
  metrics = _Metrics()
  _, _, losses = loop.train(run, job, hooks=[metrics], devices=jax.devices()[:1])
  seen = [np.asarray(json.loads(l)) for l in (tmp_path / "seen.jsonl").read_text().splitlines()]
  assert len(seen) == 2 and all(len(v) == 8 for v in seen)  # 2 prompts x 4 samples a step
  for m, values in zip(metrics.steps, seen):
    assert np.isfinite(m["loss"])
    assert abs(m["reward"] - WEIGHT * values.mean()) < 1e-6
    assert abs(m["reward_std"] - WEIGHT * values.std()) < 1e-6
    assert 1 <= m["completion_len"] <= 6
  # Step 1 samples the policy it trains (ratio 1) from the reference (KL 0): with 'grpo' the
  # loss is minus the mean advantage, 0 as group-normalized advantages sum to 0 per group.
  assert abs(losses[0]) < 1e-6 and metrics.steps[0]["kl"] < 1e-9
  assert np.isfinite(losses[1]) and metrics.steps[1]["kl"] > 0  # the policy moved
  fingerprints = json.loads(open(os.path.join(job, rollout.REWARD_FILES)).read())
  assert list(fingerprints) == [f"{tmp_path}/my_rewards.py:digits"]
  assert run.task.objective.reward_weights == (WEIGHT,)


def test_grpo_on_an_import_needs_a_prompts_data_dir():
  with pytest.raises(ConfigError, match=r"datasets\['train'\].data_dir is empty: GRPO samples "
                     r"completions of your prompts. Pass --data_dir=DIR, a dir written by "
                     r"tools/prepare_prompt_data.py"):
    main.build(main.resolved_config("grpo.LlamaGrpoImport", []))
