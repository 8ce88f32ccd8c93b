"""DeepSeek routing (layers.moe_router) against a numpy transcription of HF's
DeepseekV3TopkRouter / DeepseekV2TopkRouter: sigmoid scores, the balancing bias in the
choice only, group-limited top-k (top-2 sums or the best expert per group), normalized
gates times routed_scaling_factor; the group fields' bad values are ConfigErrors."""
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.layers.moe_router import MoeConfig, route, update_bias

E, K = 16, 3


def reference(logits, bias, cfg: MoeConfig):
  """HF's routers in numpy, token by token: (gates, experts sorted by expert id)."""
  gates, experts = [], []
  for row in logits.reshape(-1, E):
    scores = (1 / (1 + np.exp(-row)) if cfg.score == "sigmoid"
              else np.exp(row - row.max()) / np.exp(row - row.max()).sum())
    choice = scores + bias
    groups = choice.reshape(cfg.n_group, -1)
    group = (np.sort(groups, -1)[:, -2:].sum(-1) if cfg.group_score == "top2_sum"
             else groups.max(-1))
    keep = np.zeros(cfg.n_group, bool)
    keep[np.argsort(-group)[:cfg.topk_group]] = True
    choice = np.where(np.repeat(keep, E // cfg.n_group), choice, -np.inf)
    top = np.sort(np.argsort(-choice)[:cfg.top_k])
    w = scores[top]
    if cfg.renormalize:
      w = w / (w.sum() + 1e-20)
    gates.append(w * cfg.routed_scaling_factor)
    experts.append(top)
  return np.stack(gates), np.stack(experts)


V3 = MoeConfig(num_experts=E, top_k=K, d_ff=8, score="sigmoid", renormalize=True,
               routed_scaling_factor=2.5, n_group=4, topk_group=2, score_bias=True)
V2_GROUPS = MoeConfig(num_experts=E, top_k=K, d_ff=8, score="softmax", renormalize=False,
                      routed_scaling_factor=1.5, n_group=4, topk_group=2, group_score="max")


@pytest.mark.parametrize("cfg", [V3, V2_GROUPS], ids=["v3", "v2_group_limited"])
def test_group_limited_routing_equals_hf(cfg):
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (2, 32, E)).astype(np.float32)
  bias = (rng.normal(0, 0.3, E) if cfg.score_bias else np.zeros(E)).astype(np.float32)
  gates, experts, _ = route(jnp.asarray(logits), cfg,
                            jnp.asarray(bias) if cfg.score_bias else None)
  order = np.argsort(np.asarray(experts), -1)
  got_e = np.take_along_axis(np.asarray(experts), order, -1).reshape(-1, K)
  got_g = np.take_along_axis(np.asarray(gates), order, -1).reshape(-1, K)
  want_g, want_e = reference(logits, bias, cfg)
  np.testing.assert_array_equal(got_e, want_e)
  np.testing.assert_allclose(got_g, want_g, rtol=1e-6)
  # Only the topk_group best groups supply experts.
  assert len({g for g in (got_e[0] // (E // cfg.n_group))}) <= cfg.topk_group


def test_the_bias_moves_the_choice_not_the_gates():
  logits = jnp.zeros((1, 1, E), jnp.float32).at[..., 0].set(3.0)
  bias = jnp.zeros(E).at[5].set(10.0)
  cfg = MoeConfig(num_experts=E, top_k=2, d_ff=8, score="sigmoid", renormalize=False,
                  score_bias=True)
  gates, experts, _ = route(logits, cfg, bias)
  assert sorted(np.asarray(experts).ravel().tolist()) == [0, 5]
  np.testing.assert_allclose(sorted(np.asarray(gates).ravel()), [0.5, 1 / (1 + np.exp(-3.0))],
                             rtol=1e-6)  # sigmoid(0), sigmoid(3): no bias in either


def test_update_bias_moves_each_expert_towards_the_mean_load():
  load = jnp.asarray([[4.0, 0.0, 2.0, 2.0]])
  np.testing.assert_array_equal(update_bias(jnp.zeros((1, 4)), load, 0.5),
                                [[-0.5, 0.5, 0.0, 0.0]])


@pytest.mark.parametrize("fields,match", [
    (dict(n_group=3), "n_group=3"), (dict(n_group=0), "n_group=0"),
    (dict(n_group=4, topk_group=5), "topk_group=5"),
    (dict(n_group=4, topk_group=0), "topk_group=0"),
    (dict(n_group=4, topk_group=1, top_k=5), "top_k=5"),
    (dict(bias_update_rate=0.1), "bias_update_rate")])
def test_group_fields_that_do_not_fit_are_config_errors(fields, match):
  cfg = MoeConfig(**{**dict(num_experts=E, top_k=2, d_ff=8), **fields})
  with pytest.raises(ConfigError, match=match):
    cfg.validate(num_layers=2, expert_shards=1)
