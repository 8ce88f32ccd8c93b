"""Llama-3.2-1B train steps on whatever accelerator is present, measured side by side.

One run prints, per row: step time, tokens/s and MFU (model FLOPs / the chip's peak
from its device kind, `plan.chips`) of
  framework       `program.train` of llama.Llama32_1B: bf16 compute, a remat preset,
                  attention_impl 'auto' (cuDNN on GPUs, splash on TPUs, xla on CPUs);
  hand-written    a `jax.jit` + optax step of the same model with the same shardings
                  (benchmarks/step.py), and its ratio to the framework's;
  framework xla   the same with attention_impl 'xla' (einsum + softmax), when auto chose
                  a fused kernel;
then the SPMD pipeline (GPipe) against MPMD 1F1B on two stages of the devices present
(needs >= 2 devices), with MPMD's host dispatch per schedule action.

On a GPU: `python benchmarks/gpu.py` (1 × 8192 tokens per device; flags change it).
On the CPU: `python benchmarks/gpu.py --small` (a 2-layer model of the same shape
family on 8 emulated devices; CPU numbers, not a GPU's).
"""
import argparse
import statistics
import time

import common  # pylint: disable=unused-import  (8 emulated CPU devices; before jax)
import fiddle as fdl
import jax

from spmdtask import main as main_lib
from spmdtask.core import program as program_lib
from spmdtask.layers.attention import fused as fused_attention
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from spmdtask.plan import chips
from step import hand_written

# A 2-layer model of Llama 3.2 1B's family (GQA 4/2, SwiGLU, tied embeddings), for CPUs.
SMALL = ("task.model.d_model=256", "task.model.num_layers=2", "task.model.num_heads=4",
         "task.model.num_kv_heads=2", "task.model.head_dim=64", "task.model.d_ff=512",
         "task.model.vocab_size=1024", "datasets['train'].vocab_size=1024")


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true", help="the CPU-sized model (seq 256)")
  p.add_argument("--seq_len", type=int, help="tokens per row (default 8192; --small 256)")
  p.add_argument("--rows_per_device", type=int, default=1)
  p.add_argument("--remat", default="full", help="task.model.remat_policy preset")
  p.add_argument("--steps", type=int, default=5, help="timed steps per round")
  p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
  p.add_argument("--no_pipeline", action="store_true", help="skip SPMD vs MPMD")
  return p.parse_args()


def _overrides(args, attention="auto", layers=None) -> list[str]:
  seq = args.seq_len or (256 if args.small else 8192)
  rows = args.rows_per_device * len(jax.devices())
  out = list(SMALL if args.small else ()) + [
      f"datasets['train'].seq_len={seq}", f"datasets['train'].batch_size={rows}",
      f"task.model.remat_policy='{args.remat}'", f"task.model.attention_impl='{attention}'"]
  return out + ([f"task.model.num_layers={layers}"] if layers else [])


def _timed(fn, carry, steps):
  """(carry after `steps` calls of fn, seconds per call, host seconds per call)."""
  c0, t0 = time.thread_time(), time.perf_counter()
  for _ in range(steps):
    carry, out = fn(carry)
  c1 = time.thread_time()
  jax.block_until_ready(out)
  return carry, (time.perf_counter() - t0) / steps, (c1 - c0) / steps


def _framework(overrides, pipeline=None, devices=None):
  """(run, program, global batch, step fn) of Llama32_1B with `overrides` (--fdl_set form)
  and `pipeline(task config)` applied."""
  cfg = main_lib.resolved_config("llama.Llama32_1B", overrides)
  if pipeline is not None:
    pipeline(cfg.task)
  run = fdl.build(cfg)
  inputs = run.datasets["train"]
  program = program_lib.setup(run.task, inputs.batch_at(0), devices=devices)
  batch = program.global_batch(inputs.batch_at(0))
  return run, program, batch, lambda state: program.train(state, batch)


def _row(label, secs, program, rows, peak, extra=""):
  """One printed line: step time, tokens/s and MFU of `rows` examples per step."""
  devices = program.mesh.devices.size
  mfu = program.work.train_flops * rows / secs / (peak * devices)
  print(f"{label:26s} {secs * 1e3:10.2f} ms  {program.work.tokens * rows / secs:12,.0f} "
        f"tokens/s  MFU {100 * mfu:6.2f}%{extra}")


def steps_side_by_side(args):
  """Framework (auto attention), hand-written, framework with xla attention: interleaved."""
  run, program, batch, fw = _framework(_overrides(args))
  kind = program.mesh.devices.flat[0].device_kind
  peak = chips.mfu_peak(kind, None)
  m, (rows_per_step, seq) = run.task.model, batch["inputs"].shape
  platform = program.mesh.devices.flat[0].platform
  impl = fused_attention.choose(
      "auto", platform, seq, m.num_heads, m.head_dim, m.fprop_dtype, False, None, None,
      fused_attention.gpu_compute_capability() if platform == "gpu" else (0, 0))
  init_batch = jax.tree.map(lambda x: x[:1], run.datasets["train"].batch_at(0))
  hand, params, opt_state = hand_written(program, m, program.tx, init_batch, run.task.train.seed)

  def hand_step(carry):
    with jax.set_mesh(program.mesh):
      p, o, loss = hand(*carry, batch)
    return (p, o), loss

  rows = {"framework (" + impl + ")": [fw, program.init(), []],
          "hand-written jit+optax": [hand_step, (params, opt_state), []]}
  if impl != "xla":
    _, xla_program, _, xla_fw = _framework(_overrides(args, "xla"))
    rows["framework (xla attention)"] = [xla_fw, xla_program.init(), []]
  for r in rows.values():  # compile and warm up
    r[1], _, _ = _timed(r[0], r[1], 1)
  for _ in range(args.rounds):
    for r in rows.values():
      r[1], secs, _ = _timed(r[0], r[1], args.steps)
      r[2].append(secs)
  n = sum(x.size for x in jax.tree.leaves(program.layout.logical.params))
  print(f"{n / 1e6:.1f}M params, {dict(program.mesh.shape)} on {program.mesh.devices.size} × "
        f"{kind}; {rows_per_step} × {seq} tokens/step; "
        f"remat {args.remat}; MFU against {peak.describe()}")
  times = {label: statistics.median(r[2]) for label, r in rows.items()}
  base = times["hand-written jit+optax"]
  for label, secs in times.items():
    _row(label, secs, program, rows_per_step, peak.flops_per_s,
         f"  {secs / base:.3f}× hand-written's time")


def pipelines(args):
  """SPMD GPipe vs MPMD 1F1B: two stages of the devices present, 4 microbatches."""
  n = len(jax.devices())
  if n < 2:
    print("SPMD vs MPMD pipeline: skipped (needs 2 or more devices; found 1)")
    return
  half = n // 2
  rows_per_step = 4 * half * args.rows_per_device  # 4 microbatches over `half` data shards
  over = [o for o in _overrides(args, layers=4 if args.small else None) if "batch_size" not in o]
  over.append(f"datasets['train'].batch_size={rows_per_step}")
  if jax.devices()[0].platform == "cpu":
    # XLA:CPU (jax 0.10.2) aborts compiling the bf16 SPMD pipeline ("Invalid binary
    # instruction opcode copy" in AllReducePromotion): compare the two in float32 there.
    over.append("task.model.fprop_dtype='float32'")

  def spmd(task):
    task.mesh_axis_names = ("stage", "data", "fsdp", "model")
    task.ici_mesh_shape = (2, half, 1, 1)  # stage x data (with fsdp, XLA:CPU 0.10.2 aborts)
    task.pipeline = fdl.Config(PipelineConfig, num_stages=2, num_microbatches=4)

  def mpmd(task):
    task.pipeline = fdl.Config(MpmdConfig, layer_cuts="auto", schedule="1f1b",
                               submesh_shapes=((half, 1, 1), (half, 1, 1)), num_microbatches=4)

  rows = {}
  for label, pipeline in (("SPMD GPipe", spmd), ("MPMD 1F1B", mpmd)):
    _, program, _, fn = _framework(over, pipeline, jax.devices()[:2 * half])
    state, _, _ = _timed(fn, program.init(), 1)
    rows[label] = [fn, state, [], [], program]
  for _ in range(args.rounds):
    for r in rows.values():
      r[1], secs, host = _timed(r[0], r[1], args.steps)
      r[2].append(secs)
      r[3].append(host)
  print(f"\npipelines: 2 stages × {half} devices (data), {rows_per_step} rows in 4 "
        f"microbatches, {over[-1] if 'float32' in over[-1] else 'bf16'} (medians of "
        f"{args.rounds} rounds)")
  peak = chips.mfu_peak(jax.devices()[0].device_kind, None).flops_per_s
  for label, (_, _, secs, host, program) in rows.items():
    secs, host = statistics.median(secs), statistics.median(host)
    extra = f"  host {host * 1e3:.2f} ms/step"
    if label.startswith("MPMD"):
      actions = sum(len(a) for a in program.pipeline.schedule.actions)
      extra += f" = {host / actions * 1e3:.3f} ms per action ({actions} actions)"
    _row(label, secs, program, rows_per_step, peak, extra)


def main():
  args = _args()
  steps_side_by_side(args)
  if not args.no_pipeline:
    pipelines(args)


if __name__ == "__main__":
  main()
