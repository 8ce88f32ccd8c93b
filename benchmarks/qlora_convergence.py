"""QLoRA against LoRA: TextLm (TinyLm's model) pretrained on a prepared text corpus, then
LoRA adapters (rank 8, every attention and MLP weight) trained the same steps over its base
in float32 and over it stored in nf4 (and int4, int8: `task.model.lora.base_quantization`),
final eval losses side by side.

    python benchmarks/qlora_convergence.py [--data_dir=/tmp/pylib_sp] [--base_steps=200]
        [--steps=100] [--runs=float,nf4]

Prepares the corpus as benchmarks/quant_convergence.py does (Python's own sources,
SentencePiece vocab 2048) where it is missing; each run is the production loop on one CPU
device (seed, data and schedule shared), warm-started from the pretrained base's job dir.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import fiddle as fdl  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position

# pylint: disable-next=wrong-import-position
from benchmarks.quant_convergence import final_eval_loss, prepare
from spmdtask import main as main_lib  # pylint: disable=wrong-import-position
from spmdtask.layers.lora import LoraConfig  # pylint: disable=wrong-import-position
from spmdtask.run import loop  # pylint: disable=wrong-import-position

RUNS = {"float": None, "nf4": "nf4", "int4": "int4", "int8": "int8"}


def _run(args, steps: int, base_dir: str | None = None, kind: str | None = None):
  lines = [f"task.model.vocab_size=2048", f"task.train.num_train_steps={steps}",
           f"task.train.eval_interval_steps={steps}", f"task.train.save_interval_steps={steps}",
           "task.ici_mesh_shape=(1, 1, 1)"]
  lines += [f"datasets['{s}'].data_dir={args.data_dir!r}" for s in ("train", "eval")]
  lines.append(f"decode_datasets['prompts'].data_dir={args.data_dir!r}")
  if base_dir:
    lines += [f"task.train.init_checkpoint_dir={base_dir!r}",
              "task.train.learning_rate.peak_value=1e-3"]
  cfg = main_lib.resolved_config("lm.TextLm", lines)
  if base_dir:
    cfg.task.model.lora = fdl.Config(LoraConfig, rank=8, alpha=16.0,
                                     targets=("q", "k", "v", "o", "wi", "wg", "wo"),
                                     base_quantization=kind, group_size=32)
  return fdl.build(cfg)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default="/tmp/pylib_sp")
  parser.add_argument("--job_root", default="/tmp/qlora_convergence")
  parser.add_argument("--base_steps", type=int, default=200)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--runs", default="float,nf4")
  args = parser.parse_args()
  prepare(args.data_dir)
  devices = jax.devices()[:1]
  base = os.path.join(args.job_root, "base")
  loop.train(_run(args, args.base_steps), job_log_dir=base, devices=devices)
  losses = {}
  for name in args.runs.split(","):
    job = os.path.join(args.job_root, name)
    loop.train(_run(args, args.steps, base, RUNS[name]), job_log_dir=job, devices=devices)
    losses[name] = final_eval_loss(job)
  ref = losses.get("float")
  print(f"TextLm pretrained {args.base_steps} steps; LoRA rank 8, {args.steps} steps; final "
        f"eval loss (base {final_eval_loss(base):.4f}):")
  for name, loss in losses.items():
    print(f"  {name:5s} {loss:.4f}  (/ float base: {loss / ref:.4f})" if ref else
          f"  {name:5s} {loss:.4f}")


if __name__ == "__main__":
  main()
