"""The MoE config and its router: scores, top-k (within groups, with a balancing bias),
gates, and each row's routing statistics. `layers.moe` runs the experts.

The balancing bias (DeepSeek-V3's auxiliary-loss-free balancing, `MoeConfig.score_bias`)
is a buffer (`core.model.Buffered`): no optimizer trains it. The router's backward puts
the step's expert loads into its gradient slot (`_load_tap`), so they are summed over
microbatches, pipeline stages and devices exactly as gradients are, and the train step
then sets bias += bias_update_rate · sign(mean load - load) (`update_bias`). Counts are
exact in float32, so the bias is the same on any mesh.
"""
import dataclasses

import jax
import jax.numpy as jnp

from spmdtask.errors import ConfigError

SCORES = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")  # DeepSeek-V3's group score; V2's group_limited_greedy
BIAS = "score_bias_buffer"  # the balancing bias: a buffer (core.train_state.BUFFER_SUFFIX)
DISPATCHES = ("dropless", "capacity")
STATS = ("moe_aux_loss", "moe_z_loss", "moe_imbalance", "moe_dropped")
FIELD = "task.model.moe"


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """The MoE fields of a TransformerLm (`moe`; None = dense). See /README for each."""
  num_experts: int
  top_k: int
  d_ff: int
  num_shared_experts: int = 0
  shared_d_ff: int | None = None
  first_moe_layer: int = 0
  score: str = "softmax"
  renormalize: bool = True
  dispatch: str = "dropless"
  capacity_factor: float = 1.25
  aux_loss_coef: float = 0.01
  z_loss_coef: float = 0.001
  ff_chunks: int = 1
  # DeepSeek routing: gates times routed_scaling_factor; experts in n_group groups, a
  # token's experts from its topk_group best groups (scored by group_score); with
  # score_bias a per-expert bias (a buffer, `BIAS`) added to the scores for the choice
  # only, moved by bias_update_rate · sign(mean load - load) after each step.
  routed_scaling_factor: float = 1.0
  n_group: int = 1
  topk_group: int = 1
  group_score: str = "top2_sum"
  score_bias: bool = False
  bias_update_rate: float = 0.0

  @property
  def shared_ff(self) -> int:
    """The fused shared experts' hidden size (0: none)."""
    return self.num_shared_experts * (self.shared_d_ff or self.d_ff)

  def weight_shapes(self, d_model: int) -> dict[str, tuple[int, ...]]:
    """WeightSplit field -> the shape of the weights it maps."""
    e, f = self.num_experts, self.d_ff
    return dict(router=(d_model, e), expert_in=(e, d_model, f), expert_out=(e, f, d_model))

  def validate(self, num_layers: int, expert_shards: int) -> None:
    """ConfigError naming the field; `expert_shards`: how many ways expert_in[0] splits E."""
    if self.num_experts < 1 or self.d_ff < 1 or self.num_shared_experts < 0:
      raise ConfigError(f"{FIELD}: num_experts={self.num_experts}, d_ff={self.d_ff} must be "
                        f"positive and num_shared_experts={self.num_shared_experts} >= 0.")
    if not 1 <= self.top_k <= self.num_experts:
      raise ConfigError(f"{FIELD}.top_k={self.top_k}: each token picks top_k of the "
                        f"num_experts={self.num_experts} experts, so 1 <= top_k <= "
                        f"{self.num_experts}. Set top_k in that range.")
    if self.score not in SCORES:
      raise ConfigError(f"{FIELD}.score={self.score!r}: use one of {', '.join(SCORES)}.")
    if self.dispatch not in DISPATCHES:
      raise ConfigError(f"{FIELD}.dispatch={self.dispatch!r}: use 'dropless' (grouped "
                        "matmul, no token dropped) or 'capacity' (GShard capacity factor).")
    if not self.capacity_factor > 0:
      raise ConfigError(f"{FIELD}.capacity_factor={self.capacity_factor}: each expert takes "
                        "ceil(capacity_factor * tokens * top_k / num_experts) tokens per row, "
                        "so it must be > 0 (1.0 = an even share; 1.25 is usual).")
    if self.ff_chunks < 1 or self.d_ff % self.ff_chunks:
      raise ConfigError(f"{FIELD}.ff_chunks={self.ff_chunks}: the routed experts' ff dim "
                        f"(d_ff={self.d_ff}) runs in ff_chunks equal slices, so it must be a "
                        f"positive divisor of {self.d_ff} (1: all at once).")
    if not 0 <= self.first_moe_layer < num_layers:
      raise ConfigError(f"{FIELD}.first_moe_layer={self.first_moe_layer}: layers [0, "
                        f"first_moe_layer) are dense, so it must lie in [0, task.model."
                        f"num_layers={num_layers}).")
    if self.n_group < 1 or self.num_experts % self.n_group:
      raise ConfigError(f"{FIELD}.n_group={self.n_group}: the num_experts={self.num_experts} "
                        "experts form n_group equal groups, so n_group must be a positive "
                        f"divisor of {self.num_experts} (1: no groups).")
    if not 1 <= self.topk_group <= self.n_group:
      raise ConfigError(f"{FIELD}.topk_group={self.topk_group}: a token picks its experts "
                        f"from its topk_group best of n_group={self.n_group} groups, so 1 <= "
                        f"topk_group <= {self.n_group}.")
    if self.top_k > self.topk_group * (self.num_experts // self.n_group):
      raise ConfigError(f"{FIELD}.top_k={self.top_k} exceeds the experts of topk_group="
                        f"{self.topk_group} groups of {self.num_experts // self.n_group}: "
                        "raise topk_group or lower top_k.")
    if self.group_score not in GROUP_SCORES:
      raise ConfigError(f"{FIELD}.group_score={self.group_score!r}: use one of "
                        f"{', '.join(GROUP_SCORES)}.")
    if self.group_score == "top2_sum" and self.n_group > 1 and self.num_experts // self.n_group < 2:
      raise ConfigError(f"{FIELD}: group_score 'top2_sum' needs groups of >= 2 experts; "
                        f"n_group={self.n_group} leaves {self.num_experts // self.n_group}.")
    if self.bias_update_rate < 0 or self.bias_update_rate and not self.score_bias:
      raise ConfigError(f"{FIELD}.bias_update_rate={self.bias_update_rate}: the balancing "
                        "bias moves by this much per step, so it must be >= 0, and needs "
                        "score_bias=True (the bias it moves).")
    if self.num_experts % expert_shards:
      raise ConfigError(
          f"{FIELD}.num_experts={self.num_experts} does not divide over the {expert_shards} "
          "shards of the expert dim (task.model.weight_split_dims_mapping.expert_in[0] / "
          "expert_out[0], the `expert` mesh axis): each device must hold whole experts. "
          "Make num_experts a multiple of the expert axis size, or shrink that axis.")


def route(logits: jax.Array, cfg: MoeConfig, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """float32 router logits [..., E] -> (gates [..., k], experts [..., k] int32, scores).

  The experts are the top k of scores + `bias` [E] (None: none) within the token's
  `topk_group` best groups; the gates are their scores without the bias, renormalized
  where `renormalize`, times routed_scaling_factor."""
  scores = (jax.nn.softmax(logits) if cfg.score == "softmax" else jax.nn.sigmoid(logits))
  if bias is None and cfg.n_group == 1:
    gates, experts = jax.lax.top_k(scores, cfg.top_k)
  else:
    choice = scores if bias is None else scores + bias
    if cfg.n_group > 1:
      grouped = choice.reshape(choice.shape[:-1] + (cfg.n_group, -1))
      group = (jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1) if cfg.group_score == "top2_sum"
               else jnp.max(grouped, axis=-1))
      kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(group, cfg.topk_group)[1], cfg.n_group,
                                    dtype=jnp.int32), axis=-2) > 0
      choice = jnp.where(jnp.repeat(kept, cfg.num_experts // cfg.n_group, axis=-1), choice,
                         -jnp.inf)
    experts = jax.lax.top_k(choice, cfg.top_k)[1]
    gates = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  if cfg.routed_scaling_factor != 1.0:
    gates = gates * cfg.routed_scaling_factor
  return gates, experts.astype(jnp.int32), scores


@jax.custom_vjp
def _load_tap(bias: jax.Array, load: jax.Array) -> jax.Array:
  """0.0; its backward gives `bias` the gradient `load` (whatever flows in): how a step's
  expert loads reach the train step, summed over microbatches and devices like any
  gradient, for `update_bias`."""
  del bias, load
  return jnp.zeros((), jnp.float32)


def _load_tap_fwd(bias, load):
  del bias
  return jnp.zeros((), jnp.float32), load


def _load_tap_bwd(load, _):
  return load, jnp.zeros_like(load)


_load_tap.defvjp(_load_tap_fwd, _load_tap_bwd)


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """The balancing bias after a step: bias + rate · sign(mean load - load), per layer (the
  last dim the experts); `load` the step's assignments per expert (any positive scale)."""
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def row_stats(logits, scores, experts, dropped, cfg: MoeConfig) -> jax.Array:
  """[g, len(STATS)] per row: Switch aux loss E·Σ_e f_e·P_e (f_e: share of the row's
  assignments to e, P_e: e's mean normalized score), z-loss mean_t logsumexp², imbalance
  max_e/mean_e of assignments, dropped share of assignments."""
  t, e, k = logits.shape[1], cfg.num_experts, cfg.top_k
  load = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=(1, 2))  # [g, E]
  prob = jnp.mean(scores / jnp.sum(scores, -1, keepdims=True), axis=1)
  aux = e * jnp.sum(load / (t * k) * prob, axis=-1)
  z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2, axis=-1)
  imbalance = jnp.max(load, axis=-1) / (t * k / e)
  return jnp.stack([aux, z, imbalance, dropped / (t * k)], axis=-1)


def update_buffers(cfg: MoeConfig, params, grads):
  """`params` with every MoE layer's balancing bias (`BIAS`) moved by `update_bias` at
  cfg.bias_update_rate, the loads read from its slot in `grads` (`_load_tap`)."""
  if not cfg.bias_update_rate:
    return params
  return jax.tree_util.tree_map_with_path(
      lambda path, p, g: update_bias(p, g, cfg.bias_update_rate)
      if str(getattr(path[-1], "key", path[-1])) == BIAS else p, params, grads)
