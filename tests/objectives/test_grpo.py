"""The Grpo objective in the train step: 1 vs 8 devices on fixed samples, and its bad inputs."""
import jax
import numpy as np
import pytest

from configs import grpo as grpo_configs  # pylint: disable=unused-import  (registers)
from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.run import reference, rollout
from tests import util

# 2 prompts x 4 samples of 8 tokens; beta > 0 (the reference runs in the step) and μ = 2
# (the batch carries the sampling policy's log-probs).
SMALL = ["datasets['train'].batch_size=2", "task.objective.num_generations=4",
         "task.objective.beta=0.04", "task.objective.num_iterations=2",
         "task.objective.loss_type='grpo'", "task.objective.epsilon_high=0.28",
         "task.objective.temperature=0.7"]


def _fixed_batch(example: dict) -> dict:
  """Samples that do not depend on a model: random completions, advantages, old log-probs."""
  g = np.random.default_rng(0)
  n, t = example["inputs"].shape
  tokens = g.integers(0, 256, (n, t + 1)).astype(np.int32)
  lens = g.integers(1, 5, n)
  weights = (np.arange(t)[None, :] >= 3) & (np.arange(t)[None, :] < 3 + lens[:, None])
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "weights": weights.astype(np.float32),
          "advantages": g.normal(size=n).astype(np.float32),
          "old_logp": (-g.uniform(4.0, 7.0, (n, t))).astype(np.float32)}


def _train(num_devices: int, mesh: str, steps: int = 5):
  run = util.build_run("TinyLmGrpo", SMALL + [f"task.ici_mesh_shape={mesh}"])
  example = rollout.example(run)
  program = program_lib.setup(run.task, example, devices=jax.devices()[:num_devices])
  program = reference.attach(run.task, program)
  assert program.needs_reference
  state, batch = program.init(), program.global_batch(_fixed_batch(example))
  metrics = []
  for _ in range(steps):
    state, m = program.train(state, batch)
    metrics.append({k: float(v) for k, v in m.items()})
  return metrics


def test_one_and_eight_devices_equal_over_5_steps():
  """Losses, KL, clip ratio, gradient and param norms (the params each step starts from)."""
  one, eight = _train(1, "(1, 1, 1)"), _train(8, "(2, 2, 2)")
  for k in ("loss", "kl", "clip_ratio", "grad_norm", "param_norm"):
    util.assert_close_f32([m[k] for m in eight], [m[k] for m in one], terms=64, err_msg=k)
  assert one[-1]["kl"] > 0 and one[-1]["clip_ratio"] > 0  # the KL and the clip took part
  assert len({round(m["loss"], 6) for m in one}) == 5  # the params move step by step


@pytest.mark.parametrize("override,words", [
    ("task.objective.rewards=('final_answr',)", ["'final_answr'", "final_answer",
                                                 "number_format", "register"]),
    ("task.objective.num_generations=1", ["num_generations=1", "at least 2"]),
    ("task.objective.importance_sampling_level='seq'", ["importance_sampling_level='seq'",
                                                        "'token'", "'sequence'", "GSPO"]),
    ("task.objective.use_bias_correction_kl='no'", ["use_bias_correction_kl='no'", "not a bool",
                                                    "True", "False"]),
    ("task.objective.overlap_sampling=1", ["overlap_sampling=1", "not a bool", "off-policy"]),
])
def test_bad_objective_fields_are_one_paragraph(override, words):
  run = util.build_run("TinyLmGrpo", [override])
  with pytest.raises(ConfigError) as e:
    run.task.validate()
  assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


def test_a_prompt_with_no_room_for_the_completion():
  run = util.build_run("TinyLmGrpo", ["task.model.max_seq_len=6"])
  with pytest.raises(ConfigError) as e:
    rollout.example(run)
  text = str(e.value)
  assert "max_new_tokens=4" in text and "max_seq_len=6" in text and "at most 2" in text
