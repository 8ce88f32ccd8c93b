"""layers.base: FSDP by hand (`project`, `gather`) on 8 CPU devices."""
import math

import fiddle as fdl
import jax
import numpy as np
import optax

from spmdtask.core import memory
from spmdtask.core import program as program_lib
from spmdtask.plan import hlo, roofline
from tests import util

F32 = 4  # XLA:CPU moves the shards in float32 (base.moved_dtype)
FSDP_4X2 = "task.ici_mesh_shape=(1, 4, 2, 1)"


def _received(ops) -> float:
  return sum(op.runs * roofline.received_bytes(op.kind, op.bytes, op.group_size) for op in ops)


def test_fsdp_gathers_each_weight_twice_per_layer_and_the_head_once_receiving_one_gathers_bytes():
  """TinyLm, FSDP over fsdp 4 x fsdp_b 2 (no tensor axis), full remat, the loss over 2 vocab
  tiles. In the layer loops each of a layer's 7 weights is gathered in the forward and once
  more in the backward's recompute, one axis at a time: a device receives 1/2 of the 1/4
  it gathers over fsdp_b, then 3/4 of the whole over fsdp, the 7/8 of the weight it lacks,
  what one gather over all 8 devices brings (the results count 1 + 1/4 of the weight).
  Each gradient is reduce-scattered one axis at a time; the only all-reduce left is the
  two norm scales'. The head is gathered once per step (the forward keeps its tiles for
  the backward), its gradient reduce-scattered, never all-reduced."""
  run = util.build_run("lm.TinyLmFsdp2", [FSDP_4X2, "task.model.loss_vocab_tiles=2"])
  batch = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, batch)
  ops = hlo.collective_ops(program.lowerings(batch)[0].lower().compile().as_text())
  model = run.task.model
  rows = {r.path: r for r in memory.state_rows(program.layout, dict(program.mesh.shape))
          if r.kind == "params"}
  layer_weights = [r for path, r in rows.items() if "layers" in path and r.shards > 1]
  assert len(layer_weights) == 7, sorted(rows)
  layer_bytes = sum(math.prod(r.logical_shape[1:]) * F32 for r in layer_weights)
  received = _received

  in_layers = [op for op in ops if op.runs == model.num_layers]
  gathers = [op for op in in_layers if op.kind == "all-gather"]
  assert {op.group_size for op in gathers} == {2, 4}, gathers
  assert sum(op.bytes for op in gathers) == 2 * layer_bytes * 5 // 4, gathers  # per layer
  assert received(gathers) == model.num_layers * 2 * layer_bytes * 7 / 8, gathers
  scatters = [op for op in in_layers if op.kind == "reduce-scatter"]
  assert {op.group_size for op in scatters} == {2, 4}, scatters
  # over fsdp to a quarter of the gradient, then over fsdp_b to the device's eighth
  assert sum(op.bytes for op in scatters if op.group_size == 4) == layer_bytes // 4, scatters
  assert sum(op.bytes for op in scatters if op.group_size == 2) == layer_bytes // 8, scatters
  reduced = [op.bytes for op in in_layers if op.kind == "all-reduce"]
  assert sum(reduced) <= 2 * model.d_model * F32, reduced  # two f32 [d_model] norm scales

  in_tiles = [op for op in ops if op.runs == 2]
  head_bytes = math.prod(rows["params/unembed"].padded_shape) * F32
  assert received([op for op in in_tiles if op.kind == "all-gather"]) == head_bytes * 7 / 8
  assert {op.kind for op in in_tiles} == {"all-gather", "reduce-scatter"}, in_tiles


def _keep_grads(cfg):
  """SGD whose state is the step's gradients (a momentum trace that decays fully)."""
  cfg.task.train.optimizer = fdl.Partial(lambda learning_rate: optax.chain(
      optax.trace(decay=0.0), optax.scale_by_learning_rate(learning_rate)))
  cfg.task.train.clip_grad_norm = None


def _first_step(overrides, devices):
  """(the compiled step's collectives, first step's loss, its canonical gradients)."""
  run = util.build_run("lm.TinyLmFsdp2", overrides, edit=_keep_grads)
  batch = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, batch, devices=devices)
  ops = hlo.collective_ops(program.lowerings(batch)[0].lower().compile().as_text())
  state, metrics = program.train(program.init(), program.global_batch(batch))
  grads = jax.device_get(program.to_canonical(state).opt_state[0].trace)
  return ops, float(metrics["loss"]), grads, run.task.model


def test_kept_qkv_weights_and_mlp_gathered_at_once_move_fewer_bytes_with_the_same_grads():
  """FSDP over fsdp 4 x fsdp_b 2, remat 'save_qkv_weights', the MLP weights gathered at once.
  The forward's gathered q/k/v weights (named by `project`) are kept for the backward,
  which gathers only o and the MLP's again: the layer loops receive q/k/v's 7/8 once per
  layer, not twice. Each MLP weight is one all-gather over all 8 devices (its result the
  weight once, not 1 + 1/4 of it), its gradient still reduce-scattered one axis at a time.
  Loss and gradients are the 1-device run's, up to float32 summation order."""
  # 2 vocab tiles: the head's loop runs 2 trips, the layers' 4
  ops, loss, grads, model = _first_step(
      [FSDP_4X2, "task.model.loss_vocab_tiles=2", "task.model.remat_policy='save_qkv_weights'",
       "task.model.weight_split_dims_mapping.gather_at_once=('mlp_in', 'mlp_out')"],
      jax.devices())
  d, hd = model.d_model, model.head_dim
  qkv_bytes = d * (model.num_heads + 2 * model.num_kv_heads) * hd * F32
  o_bytes, mlp_bytes = model.num_heads * hd * d * F32, 3 * d * model.d_ff * F32
  in_layers = [op for op in ops if op.runs == model.num_layers]
  gathers = [op for op in in_layers if op.kind == "all-gather"]
  assert _received(gathers) == model.num_layers * (
      qkv_bytes + 2 * (o_bytes + mlp_bytes)) * 7 / 8, gathers
  assert sum(op.bytes for op in gathers if op.group_size == 8) == 2 * mlp_bytes, gathers
  assert sum(op.bytes for op in gathers if op.group_size != 8) == (
      qkv_bytes + 2 * o_bytes) * 5 // 4, gathers
  scatters = [op for op in in_layers if op.kind == "reduce-scatter"]
  assert {op.group_size for op in scatters} == {2, 4}, scatters
  assert sum(op.bytes for op in scatters if op.group_size == 4) == (
      qkv_bytes + o_bytes + mlp_bytes) // 4, scatters

  _, want_loss, want_grads, _ = _first_step(["task.ici_mesh_shape=(1, 1, 1, 1)",
                                             "task.model.loss_vocab_tiles=2",
                                             "task.model.remat_policy=None"], jax.devices()[:1])
  # a mean of TINY_LM_TOKENS (1024) f32 terms: eps32 * sqrt(1024) = 3.8e-6 of rounding order
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  util.assert_trees_close(grads, want_grads, terms=util.TINY_LM_TOKENS)
