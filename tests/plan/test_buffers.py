"""plan.buffers and plan.oom on what XLA gives: the arrays a compiled program makes (the
whole float32 logits of optax's loss, none with the vocab-tiled loss), and XLA:TPU's
out-of-memory message for Llama31_70B on v5e-256 (a real one, trimmed) read into the
exit-4 paragraph. Pure: nothing is compiled for a TPU here."""
import re

import jax
import jax.numpy as jnp
import optax
import pytest

from spmdtask.errors import PlanExceeded
from spmdtask.layers import xent
from spmdtask.plan import buffers, chips, planner
from tests import util

T, D, V = 256, 64, 1000


def _arrays(loss):
  args = (jax.ShapeDtypeStruct((T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
          jax.ShapeDtypeStruct((T,), jnp.int32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
  return buffers.hlo_arrays(text, top=None)


def test_hlo_arrays_name_the_whole_logits_only_where_the_loss_makes_them():
  whole = _arrays(lambda x, w, l: jnp.sum(
      optax.softmax_cross_entropy_with_integer_labels(x @ w, l)))
  logits = [b for b in whole if b.shape == f"f32[{T},{V}]"]
  assert logits and all(b.bytes == T * V * 4 for b in logits)
  assert any("dot_general" in b.what for b in logits)
  assert whole == sorted(whole, key=lambda b: -b.bytes)
  tiled = _arrays(lambda x, w, l: jnp.sum(xent.tiled_cross_entropy(
      x[None], xent.head_tiles(w, 4), l[None], V)))
  assert not [b for b in tiled if b.dims[-1:] == (V,) and b.bytes >= T * V * 4]
  assert [b for b in tiled if b.dims[-2:] == (T, V // 4)]  # one tile's logits, and no more


# XLA:TPU's refusal of Llama31_70B's step on v5e:16x16 (jax 0.10.2's libtpu): the whole
# message, as the plan keeps it in logs/plan_xla.log (it lists no arrays), and the largest
# arrays of the optimized program XLA wrote out before refusing it (`planner.compile_lowering`
# with keep_program; from that plan's plan.json).
LLAMA31_70B_V5E_256 = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                       "required for HLO temporaries (19.58G) exceeds available HBM (15.75G).")
LLAMA31_70B_ARRAYS = [buffers.Buffer(*a) for a in (
    ("bf16[80,1,8192,8192]", 10737418240,
     "body/jit(dynamic_update_index_in_dim)/dynamic_update_slice", "fusion"),
    ("bf16[80,1,8192,8192]", 10737418240, "layers/layers.scan_layers/broadcast_in_dim",
     "custom-call"),
    ("bf16[1,8192,28672]", 469762048, "mlp/shard_map/all_gather", "all-gather"),
    ("bf16[8192,28672]", 469762048, "shard_map/btd,df->btf/dot_general", "fusion"),
    ("bf16[1,28672,8192]", 469762048, "mlp/shard_map/all_gather", "all-gather"),
    ("bf16[8192,28672]", 469762048, "shard_map/btf,fd->btd/dot_general", "fusion"),
    ("bf16[28672,8192]", 469762048, "shard_map/btf,fd->btd/dot_general", "fusion"),
    ("bf16[8192,28672]", 469762048, "all-reduce.72", "all-reduce"))]


def _refused_70b_plan(arrays):
  """Llama31_70B's plan on v5e:16x16 as the planner leaves it when XLA refuses the step."""
  n = 70_553_706_496
  plan = {"state_bytes_per_device": 12 * n / 256, "params_bytes_per_device": 4 * n / 256,
          "opt_state_bytes_per_device": 8 * n / 256, "batch_shape": [512, 8192],
          "batch_shards": 256, "num_microbatches": 2,
          "arrays": [{"path": "params/layers/block/mlp/wi", "logical_shape": [80, 8192, 28672],
                      "bytes_per_device": 4 * 80 * 8192 * 28672 / 256}],
          "target": {"chip": chips.CHIPS["v5e"].as_json()}}
  return {**plan, **planner.out_of_memory_report(LLAMA31_70B_V5E_256, arrays)}


def _paragraph(arrays):
  task = util.build_run("llama.Llama31_70B").task
  with pytest.raises(PlanExceeded) as e:
    planner.check_fits(_refused_70b_plan(arrays), 0.0, task=task)
  return str(e.value)


def test_the_70b_refusal_names_the_temporaries_and_their_largest_arrays_once_in_gib():
  assert buffers.compiler_need(LLAMA31_70B_V5E_256) == (19.58 * 2**30, 15.75 * 2**30)
  text = _paragraph(LLAMA31_70B_ARRAYS)
  assert text.count("exceeds available HBM (15.75G)") == 1  # the compiler's line once
  parts = re.split(r"[.;:] ", text)
  assert len(parts) == len(set(parts))  # no phrase twice
  assert "temporaries (activations kept for the backward, gradients, gathered weights, " \
         "scratch) 19.6 GiB and the train state 3.1 GiB per device" in text
  assert "the temporaries alone over the 15.75 GiB XLA lets a program use of the v5e's " \
         "16.0 GiB" in text
  # Each of XLA's largest named by the model's own account (core.model.SizesActivations) or
  # the params: 80 layers x 1 row x 8192 tokens x d_model 8192 in bfloat16 (once, though
  # two ops write it); an all-gather's [d_model, d_ff] is one layer's wi; an MLP activation
  # [1 row, 8192 tokens, d_ff]; a weight the plan's arrays do not hold, by its op.
  assert "XLA's largest arrays per device: bf16[80,1,8192,8192] 10.0 GiB, the layers' inputs, " \
         "kept for the backward; bf16[1,8192,28672] 448.0 MiB, one layer's " \
         "params/layers/block/mlp/wi whole (gathered, or its gradient); bf16[8192,28672] " \
         "448.0 MiB, one layer's MLP activation while it runs; bf16[1,28672,8192] 448.0 MiB, " \
         "made by mlp/shard_map/all_gather." in text
  # One row per chip already, full remat, vocab tiles: fewer tokens at once or more HBM.
  assert "num_microbatches" not in text and "remat_policy" not in text
  assert "loss_vocab_tiles" not in text and "more devices" not in text
  assert "datasets['train'].seq_len=4096: rows of half the tokens" in text
  assert "a chip with more than 22.7 GiB of HBM: v4 (32.0 GiB), v5p (95.0 GiB), v6e (32.0 " \
         "GiB)" in text
  assert not re.findall(r"\d (?:GB|MB|G|M)\b", text.replace("(19.58G)", "").replace("(15.75G)", ""))


def test_without_xlas_arrays_the_model_accounts_for_the_temporaries():
  text = _paragraph(())
  assert "Of the temporaries, by the model's own account (XLA names none of its arrays): the " \
         "layers' inputs, kept for the backward, bfloat16[80, 1, 8192, 8192] 10.0 GiB; " in text
  assert "the other 8.4 GiB: gradients, gathered weights" in text


def test_hlo_arrays_tell_the_host_memory_from_the_device_and_skip_on_chip_scratch():
  """A layout's memory space: S(5) is the host's (offloaded activations), S(1) VMEM."""
  text = """HloModule m

ENTRY %main (p: bf16[4,8]) -> bf16[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  %off = bf16[32,4,8]{2,1,0:T(8,128)(2,1)S(5)} custom-call(%p), custom_call_target="x"
  %vmem = bf16[16,4,8]{2,1,0:T(8,128)(2,1)S(1)} copy(%p)
  ROOT %sum = bf16[4,8]{1,0:T(8,128)(2,1)} add(%p, %p)
}
"""
  assert [b.shape for b in buffers.hlo_arrays(text, None)] == ["bf16[4,8]"]
  assert [(b.shape, b.bytes) for b in buffers.hlo_arrays(text, None, on_host=True)] == [
      ("bf16[32,4,8]", 32 * 4 * 8 * 2)]
  section = buffers.plan_section(text, 8)
  assert [a["shape"] for a in section["largest_host_arrays"]] == ["bf16[32,4,8]"]
  assert "largest_host_arrays" not in buffers.plan_section(text.replace("S(5)", "S(1)"), 8)


def test_a_mixture_of_experts_dispatch_arrays_are_named_apart():
  """Arrays made under a `moe` name scope (layers.moe.MoeFfn) are the plan's MoE arrays."""
  text = """HloModule m

ENTRY %main (p: bf16[4,8]) -> bf16[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  %sorted = bf16[64,8]{1,0} gather(%p, %p), metadata={op_name="jit(step)/layers/while/body/""" \
      """block/moe/shard_map/gather"}
  %hidden = bf16[64,16]{1,0} multiply(%p, %p), metadata={op_name="jit(step)/layers/while/""" \
      """body/block/moe/shard_map/mul"}
  ROOT %mlp = bf16[4,8]{1,0} add(%p, %p), metadata={op_name="jit(step)/mlp/add"}
}
"""
  moe = buffers.plan_section(text, 8)["largest_moe_arrays"]
  assert [(a["shape"], a["what"]) for a in moe] == [("bf16[64,16]", "moe/shard_map/mul"),
                                                    ("bf16[64,8]", "moe/shard_map/gather")]
  assert "largest_moe_arrays" not in buffers.plan_section(text.replace("/moe/", "/mlp/"), 8)
