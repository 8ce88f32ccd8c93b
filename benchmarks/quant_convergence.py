"""Convergence of quantized training: TextLm (TinyLm's model) on a prepared text corpus, the
same steps in bf16, int8 and fp8 (`task.model.quantization`), final eval losses side by side.

    python benchmarks/quant_convergence.py [--data_dir=/tmp/pylib_sp] [--steps=300]
        [--batch_size=16 --seq_len=256]

Prepares the README's corpus (Python's own sources, SentencePiece vocab 2048) into
`--data_dir` where it is missing, then trains each run with `spmdtask.main` on one CPU
device (seed, data and schedule shared) and prints each final eval loss and its ratio to
bf16's. Takes tens of minutes on a 2-core CPU.
"""
import argparse
import json
import os
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"bf16": None, "int8": "'int8'", "fp8": "'fp8'"}


def prepare(data_dir: str) -> None:
  if os.path.exists(os.path.join(data_dir, "meta.json")):
    return
  pylib = sysconfig.get_paths()["stdlib"]
  subprocess.run([sys.executable, "tools/prepare_text_data.py", f"--input={pylib}/*.py",
                  f"--output_dir={data_dir}", "--tokenizer=sentencepiece",
                  "--vocab_size=2048"], cwd=ROOT, check=True)


def final_eval_loss(job_dir: str) -> float:
  with open(os.path.join(job_dir, "eval_metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  last = rows[-1]
  return float(next(v for k, v in last.items() if k.endswith("loss")))


def train(name: str, quantization: str | None, args) -> float:
  job_dir = os.path.join(args.job_root, name)
  overrides = [f"task.model.vocab_size=2048", f"task.train.num_train_steps={args.steps}",
               f"task.train.eval_interval_steps={args.steps}",
               f"task.train.save_interval_steps={args.steps}",
               "task.model.fprop_dtype='bfloat16'"]
  overrides += [f"datasets['{split}'].{field}={value}" for split in ("train", "eval")
                for field, value in (("batch_size", args.batch_size), ("seq_len", args.seq_len))]
  if quantization:
    overrides.append(f"task.model.quantization={quantization}")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  subprocess.run([sys.executable, "-m", "spmdtask.main", "--exp=lm.TextLm",
                  f"--job_log_dir={job_dir}", f"--data_dir={args.data_dir}",
                  "--fdl_set=task.ici_mesh_shape=(1, 1, 1)"]
                 + [f"--fdl_set={o}" for o in overrides], cwd=ROOT, env=env, check=True)
  return final_eval_loss(job_dir)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default="/tmp/pylib_sp")
  parser.add_argument("--job_root", default="/tmp/quant_convergence")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--runs", default=",".join(RUNS))
  parser.add_argument("--batch_size", type=int, default=16)  # TextLm's
  parser.add_argument("--seq_len", type=int, default=256)
  args = parser.parse_args()
  prepare(args.data_dir)
  losses = {name: train(name, RUNS[name], args) for name in args.runs.split(",")}
  base = losses.get("bf16")
  print(f"TextLm, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens, final eval "
        "loss:")
  for name, loss in losses.items():
    ratio = f"{loss / base:.4f}" if base else "-"
    print(f"  {name:5s} {loss:.4f}  (/ bf16: {ratio})")


if __name__ == "__main__":
  main()
