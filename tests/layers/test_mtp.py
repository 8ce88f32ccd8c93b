"""layers/mtp.py: the MTP loss of a tiny DeepSeek-V3 (MLA + MoE blocks, two depths) on
packed rows with a loss mask equals a hand computation from the formula (shifts, segment
and row ends, norms, concat, projection, shared head and cross entropy in numpy; the
transformer block the model's own); the forward (what decode runs) needs no MTP params;
a bad depth or weight, or MTP with layers it does not support, is a config error."""
import jax
from flax.core import meta
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.layers.moe import MoeBlock, STATS
from tests import util

ONE = "task.ici_mesh_shape=(1, 1, 1, 1)"
DEPTH, WEIGHT = 2, 0.3
B, T = 2, 16


def _batch(vocab: int) -> dict[str, np.ndarray]:
  """Row 0: two packed documents (9 + 7 tokens); row 1: one of 12 (its first 3 targets
  masked: a prompt) and 4 padding tokens."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
  seg = np.array([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4], np.int32)
  pos = np.array([list(range(9)) + list(range(7)), list(range(12)) + [0] * 4], np.int32)
  weights = (seg > 0).astype(np.float32)
  weights[0, 8] = weights[0, 15] = weights[1, 11] = 0.0  # a document's last token: no target
  weights[1, :3] = 0.0
  return {"inputs": tokens[:, :T], "targets": tokens[:, 1:], "weights": weights,
          "segment_ids": seg, "positions": pos}


def _norm(x, scale, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale)


def _xent(logits, labels):
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.sum(np.exp(logits - top), -1)) + top[..., 0]
  return lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]


def test_mtp_loss_equals_a_hand_computation_and_the_forward_ignores_it():
  run = util.build_run("TinyDeepSeekV3", [ONE, f"task.model.mtp_depth={DEPTH}",
                                          f"task.model.mtp_loss_weight={WEIGHT}"])
  model = run.task.model
  batch = _batch(model.vocab_size)
  seg = batch["segment_ids"]

  def run(b):  # one program: params, the loss, the main model's final-norm features
    params = meta.unbox(model.init(jax.random.key(0), b, method=model.loss))
    # Without the MTP layers' params: the forward (what decode runs) does not read them.
    without = {"params": {k: v for k, v in params["params"].items() if k != "mtp"}}
    return (params["params"], model.apply(params, b, method=model.loss),
            model.apply(without, b["inputs"], b["positions"], segment_ids=b["segment_ids"],
                        head=False)[0])
  p, (loss, metrics), h = jax.jit(run)(batch)
  main_logits = np.asarray(h, np.float64) @ np.asarray(p["unembed"], np.float64)
  metric = {k: float(v.sum / v.weight) for k, v in metrics.items()}
  block = jax.jit(lambda p, x: MoeBlock(**model.block_kwargs(), moe=model.moe).apply(
      {"params": p}, (x, jnp.zeros((B, len(STATS)))), batch["positions"], seg)[0][0])
  mtp, eps = p["mtp"], model.norm_eps
  total = 0.0
  for k in range(1, DEPTH + 1):
    i = np.arange(T)
    ahead = np.minimum(i + k, T - 1)  # position i + k (clipped; masked below where past T)
    valid = (i + k < T)[None] & (seg[:, ahead] == seg)
    weights = np.where(valid, batch["weights"][:, ahead], 0.0)
    emb = np.asarray(p["embedding"])[batch["inputs"][:, ahead]]
    layer = jax.tree.map(lambda a, k=k: a[k - 1], mtp)
    both = np.concatenate([_norm(emb, layer["enorm"]["scale"], eps),
                           _norm(h, layer["hnorm"]["scale"], eps)], -1)
    h = block(layer["block"], jnp.asarray(both @ np.asarray(layer["eh_proj"], np.float64),
                                          jnp.float32))
    logits = _norm(h, layer["head_norm"]["scale"], eps) @ np.asarray(p["unembed"], np.float64)
    total += np.sum(_xent(logits, batch["targets"][:, ahead]) * weights)
  want = total / DEPTH / batch["weights"].sum()
  np.testing.assert_allclose(metric["mtp_loss"], want, rtol=1e-5)
  main = np.sum(_xent(main_logits, batch["targets"]) * batch["weights"]) / batch["weights"].sum()
  np.testing.assert_allclose(metric["main_loss"], main, rtol=1e-5)
  router = model.moe.aux_loss_coef * metric["moe_aux_loss"] + \
      model.moe.z_loss_coef * metric["moe_z_loss"]
  np.testing.assert_allclose(float(loss), main + router + WEIGHT * want, rtol=1e-5)


@pytest.mark.parametrize("overrides,named", [
    (["task.model.mtp_depth=-1"], "task.model.mtp_depth=-1"),
    (["task.model.mtp_depth=1", "task.model.mtp_loss_weight=-0.1"],
     "task.model.mtp_loss_weight=-0.1"),
    (["task.model.mtp_depth=1", "task.model.dropout_rate=0.1"], "task.model.dropout_rate"),
    (["task.model.mtp_depth=1", "task.model.attention_pattern=('local', 'global')",
      "task.model.sliding_window=8"], "task.model.attention_pattern"),
])
def test_a_bad_depth_or_weight_or_unsupported_layers_are_config_errors(overrides, named):
  exp = "TinyDeepSeekV3" if "sliding" not in overrides[-1] else "TinyLm"
  run = util.build_run(exp, overrides)
  with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
    program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def test_work_counts_the_mtp_layers_and_the_heads_reuse():
  """6·(N + D·vocab·d)·T + 6·(L + D)·width·T·(T + 1) (causal attention: 12·width per pair,
  T(T + 1)/2 pairs), N the active params with the MTP layers'."""
  model = util.build_run("TinyDeepSeekV3", [f"task.model.mtp_depth={DEPTH}"]).task.model
  row = {k: jax.ShapeDtypeStruct((T,), v.dtype) for k, v in _batch(8).items()
         if k in ("inputs", "targets", "weights")}
  work = model.work_per_example(row)
  n, width = work.active_params, model.num_heads * model.head_dim
  assert n > model.clone(mtp_depth=0).work_per_example(row).active_params
  head = DEPTH * model.vocab_size * model.d_model
  assert work.train_flops == 6.0 * (n + head) * T + 6.0 * (model.num_layers + DEPTH) * width * T * (T + 1)
