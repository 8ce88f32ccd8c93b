"""Context parallelism (spmdtask.layers.attention.context): the sequence split over a
'context' mesh axis trains like one device, with both attentions, alone and with fsdp and
tp, packed rows, every remat preset, the SPMD pipeline and MPMD; and its config errors."""
import functools
import itertools

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import lm
from spmdtask.errors import ConfigError
from spmdtask.layers.attention import context as context_attention, mha as attention
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from tests import util

# Three updates after the first step's (TinyLm's warmup starts at learning rate 0), each
# from Adam's moments of the earlier gradients: more steps repeat the same programs.
STEPS = 4
# float32, 4 Adam steps: one step's loss and gradients differ from one device's by the
# order of sums only (~eps · sqrt(n) ≈ 1e-7 · 30 relative). Gradients: an element near
# zero gets util.f32_atol's floor over a batch's 1024 tokens (~3e-5 of the largest).
# Adam divides each update by its gradient's own scale, so a parameter whose gradient is
# near zero moves by ~lr whatever the rounding: params get an absolute floor at 1e-6 of
# their O(1) size.
RTOL, PARAMS_ATOL, GRAD_TERMS = 1e-5, 1e-6, 16 * 64


def grads_then_adamw(learning_rate):
  """TinyLm's AdamW behind a trace of decay 0: the state's first entry is the step's
  gradients (so a test can compare them), the updates are AdamW's."""
  return optax.chain(optax.trace(decay=0.0),
                     optax.adamw(learning_rate, b2=0.95, weight_decay=0.01))


def keep_grads(cfg):
  cfg.task.train.optimizer = fdl.Partial(grads_then_adamw)


def _context(mesh, method, remat_policy):
  def edit(cfg):
    keep_grads(cfg)
    lm.with_context(cfg.task, mesh, method)
    cfg.task.model.remat_policy = remat_policy
  return edit


def _spmd_pipeline(method, remat_policy):
  def edit(cfg):
    keep_grads(cfg)
    lm.with_context(cfg.task, None, method)
    cfg.task.mesh_axis_names = ("stage",) + lm.CONTEXT_AXES
    cfg.task.ici_mesh_shape = (2, 1, 1, 2, 2)
    cfg.task.pipeline = fdl.Config(PipelineConfig, num_stages=2, num_microbatches=4,
                                   remat_policy=remat_policy)
  return edit


def _mpmd(method, remat_policy):
  def edit(cfg):
    keep_grads(cfg)
    lm.with_context(cfg.task, (2, 1, 4, 1), method)
    cfg.task.model.remat_policy = remat_policy
    cfg.task.pipeline = fdl.Config(MpmdConfig, layer_cuts=(1,),
                                   submesh_shapes=((1, 1, 2, 2), (2, 1, 2, 1)),
                                   num_microbatches=4)
  return edit


def run_steps(exp, steps, overrides=(), edit=None, devices=None):
  losses, params, program, state = util.train_steps(exp, steps, devices, overrides, edit)
  opt_state = program.to_canonical(state).opt_state  # (clipping's, (the trace's, adamw's))
  grads = jax.device_get(opt_state[1][0].trace)
  return losses, params, grads


def _worst(got, want) -> str:
  """Largest relative difference of losses, grads and params (for the test log)."""
  rel = lambda a, b: max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)) /
                                      (np.abs(np.asarray(y)) + 1e-30)))
                         for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  big = lambda a, b: max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                         for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  return (f"loss rel {rel(got[0], want[0]):.1e}; grads abs {big(got[2], want[2]):.1e}; "
          f"params abs {big(got[1], want[1]):.1e}")


@functools.lru_cache(maxsize=None)
def one_device(exp, overrides=()):
  axes = util.build_run(exp, overrides).task.mesh_axis_names
  ones = ("task.ici_mesh_shape=" + str((1,) * len(axes)),)
  return run_steps(exp, STEPS, ones + overrides, keep_grads, jax.devices()[:1])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  out = util.packed_text_corpus(tmp_path_factory)
  return ("task.model.vocab_size=257", f"decode_datasets['prompts'].data_dir='{out}'",
          "decode_datasets['prompts'].num_examples=4",
          "decode_datasets['prompts'].batch_size=4") + tuple(
      f"datasets['{s}'].{k}" for s in ("train", "eval")
      for k in (f"data_dir='{out}'", "batch_size=16", "seq_len=64"))


# Each case a layout, an attention and a remat preset: every preset appears once, every
# layout with the attention it is likeliest to break.
CASES = {
    "TinyLmContext": ("lm.TinyLmContext", False, None, "minimal"),
    "TinyLmContextRing": ("lm.TinyLmContextRing", False, None, "save_qkv_proj"),
    # (context 8 alone, ring and all_gather, and the packed ring over context2-fsdp2-tp2 also
    # equal one device, measured once: out of the suite for its time.)
    "context2-fsdp2-tp2-packed-all_gather": (
        "lm.TextLm", True, _context((1, 2, 2, 2), "all_gather", "minimal_offloaded"), None),
    "spmd-pipeline-context2-ring": (
        "lm.TinyLm", False, _spmd_pipeline("ring", "save_qkv_proj_offloaded"), None),
    "mpmd-context2-all_gather": (
        "lm.TinyLm", False, _mpmd("all_gather", "save_dot_except_mlp_offloaded"), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_training_equals_one_device(case, corpus):
  exp, packed, edit, policy = CASES[case]
  data = corpus if packed else ()
  want = one_device("lm.TextLm" if packed else "lm.TinyLm", data)
  overrides = data + ((f"task.model.remat_policy={policy!r}",) if policy else ())
  named_edit = edit or keep_grads
  got = run_steps(exp, STEPS, overrides, named_edit)
  print(case, _worst(got, want))
  np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
  util.assert_trees_close(got[2], want[2], rtol=RTOL, terms=GRAD_TERMS)
  util.assert_trees_close(got[1], want[1], rtol=RTOL, atol=PARAMS_ATOL)


def test_zigzag_gives_shard_i_chunks_i_and_its_mirror():
  order = context_attention.zigzag(16, 2)  # 4 chunks of 4; shard 0: 0 and 3, shard 1: 1 and 2
  np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  # Every shard sees the same number of causal (query, key) pairs.
  cp, t = 4, 64
  shard_of = np.empty(t, int)
  shard_of[context_attention.zigzag(t, cp)] = np.arange(t) // (t // cp)
  pairs = [sum(i + 1 for i in range(t) if shard_of[i] == s) for s in range(cp)]
  assert len(set(pairs)) == 1


def test_bad_context_inputs_are_config_errors():
  # Rows that do not cut into 2·cp chunks: 60 tokens over context 4 (8 chunks).
  with pytest.raises(ConfigError, match="do not cut into 2 x 4 equal chunks.*seq_len"):
    util.train_steps("lm.TinyLmContext", 1, overrides=["datasets['train'].seq_len=60"])
  # A kernel that cannot attend K/V blocks: cuDNN (no log-sum-exp).
  split = lm.CONTEXT_ACTIVATIONS["heads"]
  shape = {"data": 2, "fsdp": 1, "context": 4, "model": 1}
  with pytest.raises(ConfigError, match="attention_impl='cudnn' cannot attend.*log-sum-exp"):
    context_attention.check("ring", "cudnn", split, shape)
  run = util.build_run("lm.TinyLmContextRing", ["task.model.attention_impl='splash'"])
  mesh = jax.make_mesh((2, 1, 4, 1), lm.CONTEXT_AXES)
  run.task.model.clone(context_attention="all_gather").validate(mesh, 16)  # both take splash
  run.task.model.validate(mesh, 16)
  # The kernel in a shard: auto is splash on TPU where a shard's tokens allow.
  choose = lambda impl, backend, local, heads=32: context_attention.choose(
      "ring", impl, backend, local, heads, split, shape)
  assert [choose("auto", "tpu", 8192), choose("auto", "tpu", 128), choose("auto", "cpu", 8192),
          choose("splash", "cpu", 256), choose("xla", "tpu", 8192)] == [
              "splash", "xla", "xla", "splash", "xla"]
  gathered = lambda impl, backend, local: context_attention.choose(
      "all_gather", impl, backend, local, 32, split, shape)
  assert [gathered("auto", "tpu", 8192), gathered("auto", "tpu", 384),
          gathered("auto", "tpu", 200), gathered("auto", "cpu", 8192)] == [
              "splash", "splash", "xla", "xla"]
  with pytest.raises(ConfigError, match="each shard holds 384 tokens.*multiple of 256"):
    choose("splash", "tpu", 384)
  with pytest.raises(ConfigError, match="context_attention='all_gather'.*multiple of 128"):
    gathered("splash", "tpu", 200)
  with pytest.raises(ConfigError, match="num_heads=3 does not divide"):
    context_attention.choose("ring", "splash", "tpu", 256, 3, split, {**shape, "model": 2})
  with pytest.raises(ConfigError, match="context_attention='rings' is not"):
    run.task.model.clone(attention_impl="auto", context_attention="rings").validate(mesh, 16)
  # A context split on the decode cache.
  with pytest.raises(ConfigError, match="needs no context split"):
    run.task.model.cache_split_dims(dict(mesh.shape))


def test_both_attentions_equal_one_device_attention_on_shuffled_packed_tokens():
  """Tokens in any order over 8 shards, masks from true positions and segments."""
  b, t, kvh, g, hd = 2, 32, 2, 2, 8
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, kvh * g, hd))
  k, v = (jax.random.normal(x, (b, t, kvh, hd)) for x in keys[1:])
  seg = np.repeat(np.array([[1, 2, 3, 4], [1, 1, 2, 3]]), t // 4, axis=1)
  pos = np.stack([np.concatenate([np.arange(n) for n in np.unique(r, return_counts=True)[1]])
                  for r in seg])
  order = context_attention.zigzag(t, 4)
  w = jax.random.normal(jax.random.key(1), q.shape)  # a loss that weighs every output
  with_grads = lambda f: jax.jit(jax.value_and_grad(
      lambda q, k, v, p, s: jnp.sum(f(q, k, v, p, s) * w[:, order]), argnums=(0, 1, 2)))
  shuffled = [x[:, order] for x in (q, k, v, pos, seg)]
  want = with_grads(lambda q, k, v, p, s: attention.attend(q, k, v, p, p, True, s, s))(
      *shuffled)
  split = (None, "context", None, None)
  mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  # The default score block holds each shard's 8 queries whole; 16 (query, key) pairs cut
  # them into chunks of 1 (all_gather: 32 keys) or of 2 and 4 (the ring's 8- and 4-key
  # blocks; half that in its backward).
  for method, score_block in itertools.product(context_attention.METHODS,
                                                (context_attention.SCORE_BLOCK, 16)):
    with jax.set_mesh(mesh):
      got = with_grads(lambda q, k, v, p, s: context_attention.attend(
          method, q, k, v, p, s, True, split, score_block))(*shuffled)
    # float32 sums over 32 keys and 8 head dims: ~eps · sqrt(n) relative.
    util.assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
