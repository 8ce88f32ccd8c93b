"""GRPO's rewards: plain Python functions registered by name, chosen by a config field.

A reward function takes the batch's prompts, completions (decoded text) and reference
answers, one entry per sample, and returns one float per sample:

    from spmdtask.objectives import rewards

    @rewards.register("ends_politely")
    def ends_politely(prompts, completions, answers):
      return [1.0 if c.rstrip().endswith("please") else 0.0 for c in completions]

A module that registers rewards must be imported before the task is built (e.g. by the
experiment's module); or name a function of your own file as `PATH.py:FN`
(`user_rewards`: no registration, no import). `combine(names, weights)` is what the loop
calls: the weighted sum of the named functions, each call checked (`user_rewards.call`).
"""
import re
from typing import Any, Callable, Sequence

from spmdtask.errors import ConfigError
from spmdtask.objectives import user_rewards

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[Any]], list[float]]

_REGISTRY: dict[str, RewardFn] = {}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def register(name: str) -> Callable[[RewardFn], RewardFn]:
  """Decorator: registers `fn` under `name` (a second function under a taken name is a bug)."""
  def add(fn: RewardFn) -> RewardFn:
    if name in _REGISTRY and _REGISTRY[name] is not fn:
      raise ValueError(f"reward {name!r} is already registered ({_REGISTRY[name].__qualname__})")
    _REGISTRY[name] = fn
    return fn
  return add


def registered() -> list[str]:
  return sorted(_REGISTRY)


def lookup(names: Sequence[str], field: str = "task.objective.rewards") -> list[RewardFn]:
  """The functions of `names`; ConfigError naming the field and every registered name."""
  if not names:
    raise ConfigError(f"{field}=() names no reward. Name at least one of: "
                      f"{', '.join(registered())}.")
  missing = [n for n in names if n not in _REGISTRY and not user_rewards.is_file_spec(n)]
  if missing:
    raise ConfigError(
        f"{field} names {', '.join(map(repr, missing))}, which is not a registered reward. "
        f"Registered: {', '.join(registered())}. Or name a function (prompts, completions, "
        "answers) -> list[float] of your own file: PATH.py:FN (--reward=PATH.py:FN[:WEIGHT]).")
  return [user_rewards.load(n, field) if user_rewards.is_file_spec(n) else _REGISTRY[n]
          for n in names]


def check_weights(names: Sequence[str], weights: Sequence[float] | None,
                  field: str = "task.objective.reward_weights") -> None:
  if weights is not None and len(weights) != len(names):
    raise ConfigError(f"{field} has {len(weights)} weights for {len(names)} rewards "
                      f"({', '.join(names)}). Give one weight per reward, or None for all 1.")


def combine(names: Sequence[str], weights: Sequence[float] | None, prompts: Sequence[str],
            completions: Sequence[str], answers: Sequence[Any]) -> tuple[list[float], dict]:
  """(the weighted sum per sample, each reward's mean by name) of the named rewards."""
  weights = weights or [1.0] * len(names)
  total = [0.0] * len(completions)
  means = {}
  for name, fn, w in zip(names, lookup(names), weights):
    values = user_rewards.call(name, fn, prompts, completions, answers)
    total = [t + w * v for t, v in zip(total, values)]
    means[user_rewards.display_name(name)] = sum(values) / max(len(values), 1)
  return total, means


def _as_number(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None


@register("final_answer")
def final_answer(prompts, completions, answers) -> list[float]:
  """1.0 when the completion's last number equals the reference answer (as numbers), else 0."""
  out = []
  for completion, answer in zip(completions, answers):
    found = _NUMBER.findall(completion)
    want = _as_number(str(answer).strip())
    out.append(1.0 if found and want is not None and float(found[-1]) == want else 0.0)
  return out


@register("number_format")
def number_format(prompts, completions, answers) -> list[float]:
  """1.0 when the completion is one number and nothing else (surrounding space allowed)."""
  return [1.0 if _NUMBER.fullmatch(c.strip()) else 0.0 for c in completions]
