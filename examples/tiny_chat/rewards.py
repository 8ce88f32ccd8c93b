"""Rewards for GRPO on examples/tiny_chat's arithmetic prompts: a user's own file, named on
the command line as --reward=examples/tiny_chat/rewards.py:FN[:WEIGHT] (docs/grpo.md).

Each function gets the batch's prompts and completions (text) and the prompts file's answers
(any JSON value), one per sample, and returns one float per sample."""
import re


def says_the_sum(prompts, completions, answers):
  """1 when the reply's last number is the answer."""
  out = []
  for completion, answer in zip(completions, answers):
    numbers = re.findall(r"-?\d+", completion)
    out.append(1.0 if numbers and int(numbers[-1]) == answer else 0.0)
  return out


def short(prompts, completions, answers):
  """1 for a reply of at most one short sentence (40 characters), falling to 0 at 80."""
  return [min(1.0, max(0.0, (80 - len(c)) / 40)) for c in completions]
