"""Rewards from the user's own file: --reward's syntax, the weighted sum and the advantages it
gives (against a hand computation), and each way a user's reward can fail: exit 2 (a
ConfigError) naming the reward and FILE:LINE."""
import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask import main
from spmdtask.errors import ConfigError
from spmdtask.objectives import rewards, user_rewards
from spmdtask.objectives.grpo import Grpo

REWARDS = '''\
def short(prompts, completions, answers):
  return [1.0 if len(c) <= 3 else 0.0 for c in completions]


def matches(prompts, completions, answers):
  return [float(c.strip() == str(a["sum"])) for c, a in zip(completions, answers)]


def crashes(prompts, completions, answers):
  values = []
  for c in completions:
    values.append(1 / len(c))  # line 12: an empty completion divides by zero
  return values


def too_few(prompts, completions, answers):
  return [0.0]


def text(prompts, completions, answers):
  return "1.0"


def not_finite(prompts, completions, answers):
  return [float("nan")] * len(completions)
'''


@pytest.fixture
def file(tmp_path):
  p = tmp_path / "my_rewards.py"
  p.write_text(REWARDS)
  return str(p)


def test_the_flag_syntax():
  assert user_rewards.parse_flag("final_answer") == ("final_answer", 1.0)
  assert user_rewards.parse_flag("final_answer:0.5") == ("final_answer", 0.5)
  assert user_rewards.parse_flag("r/my.py:fn") == ("r/my.py:fn", 1.0)
  assert user_rewards.parse_flag("r/my.py:fn:-2") == ("r/my.py:fn", -2.0)
  for bad in ("a:b:c", ":0.5", "my.py:fn:inf"):
    with pytest.raises(ConfigError, match=re.escape(f"--reward={bad!r}")):
      user_rewards.parse_flag(bad)


def test_a_user_file_weighted_gives_the_hand_computed_advantages(file):
  obj = Grpo(rewards=(f"{file}:short", f"{file}:matches", "number_format"),
             reward_weights=(0.5, 2.0, 1.0), num_generations=4)
  completions = ["5", "five", "5 ", "x", "12", "12!", "1", "twelve"]
  answers = [{"sum": 5}] * 4 + [{"sum": 12}] * 4
  total, means = obj.score(["p"] * 8, completions, answers)
  short = [1, 0, 1, 1, 1, 1, 1, 0]
  match = [1, 0, 1, 0, 1, 0, 0, 0]
  number = [1, 0, 1, 0, 1, 0, 1, 0]
  want = [0.5 * s + 2 * m + n for s, m, n in zip(short, match, number)]
  assert total == want  # [3.5, 0, 3.5, 0.5, 3.5, 0.5, 1.5, 0]
  assert means == {"short": 0.75, "matches": 0.375, "number_format": 0.5}
  adv = np.asarray(obj.advantages(jnp.asarray(total)))
  hand = []
  for g in (want[:4], want[4:]):
    mean = sum(g) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 3)  # Bessel-corrected, as TRL
    hand += [(x - mean) / (std + 1e-4) for x in g]
  np.testing.assert_allclose(adv, hand, rtol=1e-6)  # float32 vs Python floats


@pytest.mark.parametrize("fn,match", [
    ("crashes", r"reward '.*:crashes' raised ZeroDivisionError: division by zero \(at "
                r".*my_rewards.py:12\) scoring 2 completions"),
    ("too_few", r"reward '.*:too_few' \(.*my_rewards.py:16\) returned 1 values for 2 "
                r"completions; a reward returns a list of 2 finite floats"),
    ("text", r"reward '.*:text' \(.*my_rewards.py:20\) returned a str"),
    ("not_finite", r"reward '.*:not_finite' \(.*my_rewards.py:24\) returned nan for "
                   r"completion 0 \(2 such\)"),
])
def test_a_failing_reward_is_a_config_error_naming_it_and_its_line(file, fn, match):
  with pytest.raises(ConfigError, match=match) as e:
    rewards.combine((f"{file}:{fn}",), None, ["p", "p"], ["", "1"], [None, None])
  assert "\n" not in str(e.value)


def test_a_missing_file_function_or_broken_file_names_it(file, tmp_path):
  missing = str(tmp_path / "nope.py")
  with pytest.raises(ConfigError, match=rf"task.objective.rewards names '{missing}:f', but "
                     rf"{missing} is not a file"):
    Grpo(rewards=(f"{missing}:f",)).validate(None)
  with pytest.raises(ConfigError, match=r"defines no function 'shrot' \(it defines crashes, "
                     r"matches, not_finite, short, text, too_few\)"):
    rewards.lookup((f"{file}:shrot",))
  broken = tmp_path / "broken.py"
  broken.write_text("import os\n\ndef f(prompts, completions, answers)\n  return []\n")
  with pytest.raises(ConfigError, match=rf"importing {broken} .* failed at {broken}:3: "
                     "SyntaxError"):
    rewards.lookup((f"{broken}:f",))
  raising = tmp_path / "raising.py"
  raising.write_text("import os\nTABLE = {}['x']\n")
  with pytest.raises(ConfigError, match=rf"failed at {raising}:2: KeyError"):
    rewards.lookup((f"{raising}:f",))


def test_the_reward_flag_sets_the_objectives_fields(file, monkeypatch, tmp_path):
  monkeypatch.chdir(os.path.dirname(file))
  cfg = main.resolved_config("TinyLmGrpo", [], reward=["my_rewards.py:short:0.5",
                                                      "final_answer"])
  assert cfg.task.objective.rewards == (f"{file}:short", "final_answer")  # made absolute
  assert cfg.task.objective.reward_weights == (0.5, 1.0)
  main.build(cfg)  # the file imports and the function is there
  with pytest.raises(ConfigError, match=r"--reward: --exp=lm.TinyLm trains no objective with "
                     "rewards"):
    main.resolved_config("lm.TinyLm", [], reward=["final_answer"])
