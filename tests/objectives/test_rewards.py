"""Rewards registered by name: the two shipped ones, a user's, and an unknown name."""
import pytest

from spmdtask.errors import ConfigError
from spmdtask.objectives import rewards


def test_shipped_rewards():
  comps = ["12", "the sum is 7 so 12", " 12.0 ", "13", "", "x12"]
  assert rewards.final_answer(None, comps, ["12"] * 6) == [1, 1, 1, 0, 0, 1]
  assert rewards.number_format(None, comps, ["12"] * 6) == [1, 0, 1, 1, 0, 0]


def test_combine_weighs_and_reports_means():
  total, means = rewards.combine(("final_answer", "number_format"), (1.0, 0.5), ["p"] * 2,
                                 ["3", "so 3"], ["3", "3"])
  assert total == [1.5, 1.0] and means == {"final_answer": 1.0, "number_format": 0.5}


def test_user_reward_registers():
  @rewards.register("test_len")
  def by_length(prompts, completions, answers):
    return [float(len(c)) for c in completions]
  assert rewards.combine(("test_len",), None, ["p"], ["abc"], ["a"])[0] == [3.0]


def test_unknown_name_lists_the_registered():
  with pytest.raises(ConfigError) as e:
    rewards.lookup(("final_anwser",))
  text = str(e.value)
  assert "'final_anwser'" in text and "final_answer, number_format" in text
  assert "\n" not in text
