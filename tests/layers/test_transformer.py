"""The LM: causal, GQA, options; its pipelined stack equal to the scanned one; a prefill's
logits at given positions."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmdtask.core import layouts, program as program_lib, sharding, steps
from spmdtask.core.train_state import TrainState
from spmdtask.errors import ConfigError
from tests import util

# Three updates after the first step's (TinyLm's warmup starts at learning rate 0), each
# from Adam's moments of the earlier gradients; more steps repeat the same programs.
STEPS = 4
ONE_DEVICE = ["task.mesh_axis_names=('data', 'fsdp', 'model')", "task.ici_mesh_shape=(1, 1, 1)",
              "task.pipeline=None"]


def _program(exp, overrides=(), devices=None):
  run = util.build_run(exp, overrides)
  inputs = run.datasets["train"]
  return run, inputs, program_lib.setup(run.task, inputs.batch_at(0), devices=devices)


def test_tiny_lm_size_and_causality():
  run, inputs, program = _program("lm.TinyLm")
  n = sum(x.size for x in jax.tree.leaves(program.layout.logical.params))
  assert 1e6 <= n <= 5e6
  state = program.init()
  params = sharding.unpad(state.params, program.layout.logical.params)
  tokens = jnp.asarray(inputs.batch_at(0)["inputs"][:2])
  logits = run.task.model.apply({"params": params}, tokens)
  changed = tokens.at[:, 40:].set((tokens[:, 40:] + 1) % 256)
  logits2 = run.task.model.apply({"params": params}, changed)
  np.testing.assert_array_equal(logits[:, :40], logits2[:, :40])  # no peeking at the future
  assert float(jnp.abs(logits[:, 40:] - logits2[:, 40:]).max()) > 1e-3
  # Grouped-query attention: 4 query heads share 2 KV heads.
  assert params["layers"]["block"]["attn"]["k"].shape == (4, 128, 2, 32)
  assert params["layers"]["block"]["attn"]["q"].shape == (4, 128, 4, 32)
  # The model's work: 6·N·T + causal attention, 12·L·d per visible pair, T(T + 1)/2 pairs.
  t, attention = 64, 6.0 * 4 * 128 * 64 * 65
  assert program.work == (6.0 * n * t + attention, t, None, attention)  # every param active


@pytest.mark.parametrize("overrides,absent,present", [
    (["task.model.tie_embeddings=True", "task.model.mlp_activation='gelu'"],
     ["unembed", "wg"], ["embedding", "wi", "wo"]),
    ([], [], ["unembed", "wg"]),
])
def test_model_options_change_the_weights(overrides, absent, present):
  _, _, program = _program("lm.TinyLm", overrides + ["task.model.num_layers=1"])
  names = {sharding.path_str(p).split("/")[-1]
           for p, _ in jax.tree_util.tree_flatten_with_path(program.layout.logical.params)[0]}
  assert not names & set(absent) and set(present) <= names


def _to_unpipelined(program, params_tree):
  """A params-shaped tree of `program`'s live layout in the canonical (scanned) one."""
  return layouts.apply_layout_maps(params_tree, program.model.layout_maps(), True)


def _loss_and_grads(run, program, params, batch):
  model = program.model
  def loss(p):
    return model.apply({"params": p}, batch, method=model.loss)[0]
  with jax.set_mesh(program.mesh):
    return jax.jit(jax.value_and_grad(loss))(params)


# (lm.TinyLmPipeline: test_pipeline_trains_like_one_device below)
@pytest.mark.parametrize("exp", ["lm.TinyLmCircular"])
def test_pipelined_loss_and_grads_match_scanned(exp):
  run, inputs, program = _program(exp)
  params = sharding.unpad(program.init().params, program.layout.logical.params)
  batch = program.global_batch(inputs.batch_at(0))
  loss, grads = _loss_and_grads(run, program, params, batch)
  ref_run, _, ref_program = _program(exp, ONE_DEVICE, devices=jax.devices()[:1])
  ref_params = jax.device_get(_to_unpipelined(program, jax.device_get(params)))
  ref_loss, ref_grads = _loss_and_grads(ref_run, ref_program, ref_params,
                                        jax.device_get(batch))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  util.assert_trees_close(_to_unpipelined(program, jax.device_get(grads)), ref_grads,
                          terms=util.TINY_LM_TOKENS)


def test_pipeline_trains_like_one_device_and_holds_only_its_stage():
  run, inputs, program = _program("lm.TinyLmPipeline")
  state = program.init()
  # Each device holds one stage of the [S=2, R=1, Lps=2, ...] weights.
  wi = state.params["layers"]["block"]["mlp"]["wi"]
  assert wi.shape == (2, 1, 2, 128, 512)
  assert {s.data.shape for s in wi.addressable_shards} == {(1, 1, 2, 128, 256)}
  init_params = jax.device_get(state.params)
  losses = []
  for _ in range(STEPS):
    state, m = program.train(state, program.global_batch(next(inputs)))
    losses.append(float(m["loss"]))

  ref_run, ref_inputs, ref = _program("lm.TinyLmPipeline", ONE_DEVICE, devices=jax.devices()[:1])
  params = _to_unpipelined(program, init_params)
  ref_state = TrainState(jnp.zeros((), jnp.int32), params, ref.tx.init(params))
  ref_state = jax.device_put(ref_state, steps.named_shardings(ref.mesh, ref.layout.split))
  ref_losses = []
  for _ in range(STEPS):
    ref_state, m = ref.train(ref_state, ref.global_batch(next(ref_inputs)))
    ref_losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert losses[-1] < losses[0] - 0.3  # it learns (6.02 to 5.56 over these 4 steps)
  util.assert_trees_close(_to_unpipelined(program, jax.device_get(state.params)),
                          jax.device_get(ref_state.params), terms=util.TINY_LM_TOKENS)


def test_rows_longer_than_max_seq_len_are_a_config_error_at_setup():
  with pytest.raises(ConfigError, match=r"rows hold 512 tokens .*task.model.max_seq_len=256.*"
                     r"datasets\[\.\.\.\]\.seq_len to at most 256"):
    _program("lm.TinyLm", ["datasets['train'].seq_len=512"])
  _program("lm.TinyLm", ["datasets['train'].seq_len=256"])  # up to max_seq_len is fine


def test_an_unknown_gather_at_once_weight_is_a_config_error():
  with pytest.raises(ConfigError, match=r"weight_split_dims_mapping.gather_at_once=\('mlp',\).*"
                                        r"a tuple of q, kv, o, mlp_in, mlp_out"):
    _program("lm.TinyLm", ["task.model.weight_split_dims_mapping.gather_at_once=('mlp',)"])


def test_a_prefill_with_logits_at_gives_the_full_forwards_rows_without_the_whole_head():
  """A forward with a cache (a prefill) on 8 devices under FSDP and `logits_at` each row's
  last position: the full forward's logits at those positions, at float32 noise (sums of
  d_model terms); its program never gathers the head's weight whole (`transformer._head`
  splits it over the vocab), where the full forward's does."""
  program, state = util.program_and_state("TinyLmFsdp", 8)
  model, logical = program.model, program.layout.logical.params
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16)), jnp.int32)
  last = jnp.arange(8, dtype=jnp.int32) * 2 + 1
  positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)

  def full(padded, tokens):
    return model.apply({"params": sharding.unpad(padded, logical)}, tokens)

  def prefill(padded, tokens, last):
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), model.cache_shape(8, 16))
    return model.apply({"params": sharding.unpad(padded, logical)}, tokens, positions, cache,
                       logits_at=last)[0]

  rows = P(program.task.batch_axes())
  jitted = [steps.partition(fn, program.mesh, (program.layout.split.params, rows, rows)[:n],
                            P()) for fn, n in ((full, 2), (prefill, 3))]
  want, got = jitted[0](state.params, tokens), jitted[1](state.params, tokens, last)
  assert got.shape == (8, 1, 256)
  util.assert_close_f32(got[:, 0], want[np.arange(8), np.asarray(last)], terms=128)
  whole_head = re.compile(r"\[128,256\]\{[^}]*\} all-gather\(")
  assert whole_head.search(jitted[0].lower(state.params, tokens).compile().as_text())
  assert not whole_head.search(
      jitted[1].lower(state.params, tokens, last).compile().as_text())
