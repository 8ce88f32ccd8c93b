"""GRPO's sampling phase beside Tunix's sampler: the same model, weights and batch, one device.

    python benchmarks/grpo_sampling_tunix.py --tunix_python=/path/to/venv/bin/python \
        [--prompts=8] [--generations=8] [--new_tokens=128] [--slots=8,16] [--repeats=3]

One CPU device for both (XLA_FLAGS=--xla_force_host_platform_device_count=1, set here and
for the side process). spmdtask's samplers are benchmarks/grpo_sampling.py's (`today`, the
per-token TokenLoopSampler; `device`, one slot a sample; `pool S`), timed in this process;
Tunix's (google-tunix's `tunix.generate.sampler.Sampler` on its own Llama3 module) runs in a
venv of its own (`--tunix_python`: it pins other jax / flax versions) as
benchmarks/grpo_sampling_tunix_side.py, on TinyLmGrpo's params written to an .npz (the same
weights: the module's shapes are TinyLm's, d 128, 4 layers, 4 heads of 32, 2 KV heads,
SwiGLU 512, byte vocabulary 264). Both sample at temperature 1 with their tokens' log-probs.

Modes (benchmarks/grpo_sampling.py's): `full`, every sample to --new_tokens (Tunix: no stop
id); `long_tail`, spmdtask's seeded stops (geometric lengths, mean new_tokens / 8), and
Tunix's samples forced to stop at the same lengths, sample by sample (the side's model
wrapper), so both produce the same number of tokens. Printed: tokens/s (completion tokens /
the median call's seconds, of 3 timed calls after one that compiles), each spmdtask
sampler's ratio to Tunix's. Without --tunix_python (or when it fails) Tunix's rows say
skipped and spmdtask's are printed alone.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ONE_DEVICE = "--xla_force_host_platform_device_count=1"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if "xla_force_host_platform_device_count" not in f] + [ONE_DEVICE])

import common  # pylint: disable=unused-import,wrong-import-position  (repo on sys.path)
import grpo_sampling  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from spmdtask.core import sharding  # pylint: disable=wrong-import-position

SIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_sampling_tunix_side.py")


def flat(tree, prefix=""):
  """{'layers/block/attn/q': array, ...}: the params as the side reads them."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flat(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = np.asarray(v)
  return out


class Tunix:
  """Tunix's side process (benchmarks/grpo_sampling_tunix_side.py), started on the params."""

  def __init__(self, python: str, run, params, workdir: str):
    model, obj, inputs = run.task.model, run.task.objective, run.datasets["train"]
    local = inputs.batch_at(0)
    weights = os.path.join(workdir, "weights.npz")
    np.savez(weights, **flat(params))
    spec = {"weights": weights, "vocab_size": model.vocab_size, "d_model": model.d_model,
            "num_layers": model.num_layers, "num_heads": model.num_heads,
            "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
            "d_ff": model.d_ff, "rope_theta": model.rope_theta, "norm_eps": model.norm_eps,
            "end": grpo_sampling.END, "prompt_len": int(inputs.prompt_len),
            "prompts": [list(map(int, p[:n])) for p, n in zip(local["prompts"],
                                                              local["prompt_lens"])],
            "group": obj.num_generations, "max_new": obj.max_new_tokens,
            "temperature": obj.temperature, "seed": obj.seed}
    with open(os.path.join(workdir, "spec.json"), "w", encoding="utf-8") as f:
      json.dump(spec, f)
    env = dict(os.environ, XLA_FLAGS=ONE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH="")
    # both live until close(): the side answers one request at a time
    # pylint: disable-next=consider-using-with
    self.log = open(os.path.join(workdir, "side.log"), "w+", encoding="utf-8")
    # pylint: disable-next=consider-using-with
    self.proc = subprocess.Popen([python, SIDE, os.path.join(workdir, "spec.json")], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self.log, text=True)
    self.info, self.checks = self.ask(None), {}

  def ask(self, request) -> dict:
    """Sends a request (None: none) and reads the side's answer line."""
    if request is not None:
      self.proc.stdin.write(json.dumps(request) + "\n")
      self.proc.stdin.flush()
    for line in self.proc.stdout:
      if line.startswith("@@ "):
        return json.loads(line[3:])
    self.log.seek(0)
    last = (self.log.read().strip().splitlines() or ["(nothing on stderr)"])[-1]
    raise RuntimeError(f"Tunix's side process ended: {last}")

  def calls(self, mode: str):
    """grpo_sampling.bench's `others` for `mode`: lengths -> {'Tunix': one timed call}."""
    def prepare(lengths):
      self.ask({"setup": mode, "lengths": lengths if mode == "long_tail" else None})

      def call():
        out = self.ask({"time": mode})
        self.checks[mode] = self.checks.get(mode, True) and (
            out["lengths_match"] and out["tokens"] == sum(lengths))
        return out["seconds"]
      return {"Tunix": call}
    return prepare

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()
    self.log.close()


def main():
  parser = grpo_sampling.arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
  parser.add_argument("--tunix_python", default="",
                      help="the python of a venv with google-tunix (empty: Tunix skipped)")
  args = parser.parse_args()
  run, program, params, slots = grpo_sampling.setup(args)
  modes = args.modes.split(",")
  with tempfile.TemporaryDirectory() as workdir:
    side, skipped = None, "no --tunix_python"
    if args.tunix_python:
      try:
        side = Tunix(args.tunix_python, run, jax.device_get(sharding.unpad(
            params, program.layout.logical.params)), workdir)
      except (OSError, RuntimeError) as e:
        skipped = f"its side process failed: {e}"
    ours = {m: grpo_sampling.bench(run, program, params, m, slots, args.repeats,
                                   side.calls(m) if side else None) for m in modes}
    if side:
      side.close()
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; {args.prompts} prompts x "
        f"{args.generations} samples, up to {args.new_tokens} new tokens; medians of "
        f"{args.repeats}, every sampler timed in turn")
  print(f"Tunix: side process on {side.info['devices']}, jax {side.info['jax']}" if side
        else f"Tunix: skipped ({skipped})")
  for m in modes:
    r = ours[m]
    print(f"\n{m}: {r['tokens']} completion tokens in {r['samples']} samples "
          f"(mean {r['tokens'] / r['samples']:.1f})")
    base = r["others"].get("Tunix")
    print(f"  {'sampler':<10} {'tok/s':>9} {'vs Tunix':>9} {'vs today':>9} {'slot util':>9}")
    for name, row in r["rows"].items():
      vs = f"{row['tok_s'] / base:8.2f}x" if base else f"{'-':>9}"
      print(f"  {name:<10} {row['tok_s']:9.1f} {vs} {row['ratio']:8.2f}x {row['util']:9.2f}")
    if base:
      same = "" if side.checks[m] else "  (its lengths differ from ours!)"
      print(f"  {'Tunix':<10} {base:9.1f} {1:8.2f}x {base / r['rows']['today']['tok_s']:8.2f}x"
            f"{'':>10}{same}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
