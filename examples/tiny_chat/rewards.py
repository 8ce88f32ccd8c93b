"""A reward of your own for GRPO (`--reward=examples/tiny_chat/rewards.py:sum_found`): 1 for a
completion that holds the answer's digits, else 0."""


def sum_found(prompts, completions, answers):
  return [float(str(a) in c) for c, a in zip(completions, answers)]
