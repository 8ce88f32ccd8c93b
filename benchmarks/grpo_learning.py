"""GRPO learns: TinyLmGrpo's mean reward from its warm start to the end of training.

    python benchmarks/grpo_learning.py [--sft_steps=30] [--grpo_steps=40] [--overlap] \
        [--target=0.75] [--out=/tmp/grpo_bench]

Trains TinyLmSumSft `--sft_steps` steps (the warm start: a tiny LM that half knows a+b), then
TinyLmGrpo `--grpo_steps` steps from it (16 prompts x 8 samples a step, reward 1 for the
exact sum), on one CPU device, in-process with the production loop. Prints the mean reward
of every step, the mean of the first and last 5 steps, and the first step whose 5-step mean
reaches `--target`; TensorBoard curves in OUT/grpo/summaries. `--overlap` trains a second
TinyLmGrpo from the same start with task.objective.overlap_sampling=True (one step
off-policy) and prints its curve beside the on-policy one.
"""
import argparse
import shutil
import time

import common  # pylint: disable=unused-import  (the repository on sys.path)
import jax
import numpy as np

from spmdtask.run import loop


class Rewards(loop.Hook):
  def __init__(self):
    self.by_step = {}

  def wants_metrics(self, step, last):
    return True

  def on_metrics(self, fetched, last):
    first = fetched.step - len(fetched.metrics) + 1
    for i, m in enumerate(fetched.metrics):
      self.by_step[first + i] = m["reward"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sft_steps", type=int, default=30)
  parser.add_argument("--grpo_steps", type=int, default=40)
  parser.add_argument("--overlap", action="store_true")
  parser.add_argument("--target", type=float, default=0.75)
  parser.add_argument("--out", default="/tmp/grpo_bench")
  args = parser.parse_args()
  shutil.rmtree(args.out, ignore_errors=True)
  one = jax.devices()[:1]
  sft = common.build("TinyLmSumSft", [f"task.train.num_train_steps={args.sft_steps}",
                                      f"task.train.save_interval_steps={args.sft_steps}"])
  loop.train(sft, job_log_dir=f"{args.out}/sft", devices=one, name="TinyLmSumSft")
  modes = {"on-policy": []}
  if args.overlap:
    modes["overlapped"] = ["task.objective.overlap_sampling=True"]
  curves = {}
  for name, extra in modes.items():
    grpo = common.build("TinyLmGrpo", [f"task.train.num_train_steps={args.grpo_steps}",
                                       f"task.train.init_checkpoint_dir='{args.out}/sft'"]
                        + extra)
    rewards = Rewards()
    start = time.perf_counter()
    loop.train(grpo, job_log_dir=f"{args.out}/grpo" + ("" if not extra else "_" + name),
               hooks=[rewards], devices=one, name="TinyLmGrpo")
    curves[name] = (np.array([rewards.by_step[s] for s in sorted(rewards.by_step)]),
                    time.perf_counter() - start)
  for name, (r, seconds) in curves.items():
    mean5 = np.convolve(r, np.ones(5) / 5, mode="valid")
    reached = next((i + 5 for i, m in enumerate(mean5) if m >= args.target), None)
    print(f"{name}: reward per step: " + " ".join(f"{x:.2f}" for x in r))
    print(f"{name}: mean reward: steps 1-5 {r[:5].mean():.3f}, steps {len(r) - 4}-{len(r)} "
          f"{r[-5:].mean():.3f}; 5-step mean first >= {args.target} at step {reached}; "
          f"{seconds:.1f} s of training")


if __name__ == "__main__":
  main()
