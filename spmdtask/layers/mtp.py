"""Multi-token prediction (DeepSeek-V3): `TransformerLm.mtp_depth` = D heads, head k
predicting the token k + 1 ahead, trained beside the next-token loss; decode ignores them.

Depth k = 1..D at position i (DeepSeek-V3 report, section 2.2; the order of the concat and
the norms as the hub checkpoint's layer `num_hidden_layers + k - 1` holds them):
  h'_i = [enorm(Emb(t_{i+k})) ; hnorm(h_i^{k-1})] @ eh_proj        eh_proj [2·d, d]
  h^k = Block_k(h')          causal over the row, the same positions and segments
  p_i^k = softmax(head(head_norm(h_i^k)))                          predicts t_{i+k+1}
h^0 is the main model's final-norm output (what its head reads, and what inference engines
feed DeepSeek-V3's MTP layer); Block_k is the kind of the main stack's last layer (with
`moe`: an MoE layer, whose router stats join the main layers'). Emb and head are the main
model's own weights, shared (no copies); each depth has its own norms, eh_proj and block,
stacked [D, ...] under the param `mtp`.

Loss. Target t_{i+k+1} is the main target at position i + k; it counts with that target's
weight where i + k lies in the row and in i's segment (packed rows), else not at all.
  mtp_loss = (1 / D) Σ_k Σ_i w_{i,k} CE(p_i^k, t_{i+k+1}) / N
N the main loss's target count (the report's 1 / T: a per-token sum, so microbatches,
devices and layouts give the same value); the model's loss is the main loss (with an
MoE's router losses) + mtp_loss_weight · mtp_loss. Metrics: `mtp_loss` and `main_loss`
(the next-token cross entropy alone), besides `loss`.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from spmdtask.core import remat
from spmdtask.core.model import Metrics, Weighted
from spmdtask.core.sharding import entry_axes
from spmdtask.errors import ConfigError
from spmdtask.layers import moe as moe_lib
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, dense_init, project, weight
from spmdtask.layers.block import Block

NAME = "mtp"  # the param scope of the stacked MTP layers
METRICS = ("mtp_loss", "main_loss")


class MtpLayer(nn.Module):
  """One depth (module doc): `((h, stats), emb, positions, segment_ids) -> ((h^k, stats),
  head_norm(h^k))`; stats (an MoE block's carry) None for a dense block."""
  block_cls: type
  block_kwargs: dict
  proj_split: SplitDims

  @nn.compact
  def __call__(self, carry, emb, positions, segment_ids):
    h, stats = carry
    kw = self.block_kwargs
    d, embed = kw["d_model"], kw["asplit"].embed
    norm = lambda name: RmsNorm(d, kw["norm_eps"], kw["wsplit"].norm, offset=kw["norm_offset"],
                                name=name)
    both = jnp.concatenate([norm("enorm")(emb), norm("hnorm")(h)], axis=-1)
    w = weight(self, "eh_proj", (2 * d, d), self.proj_split, dense_init(0, 1))
    x = constrain(project("btc,cd->btd", both, w, self.proj_split, embed, kw["dtype"]), embed)
    block = self.block_cls(**kw, name="block")
    if stats is None:
      x, _ = block(x, positions, segment_ids)
    else:
      (x, stats), _ = block((x, stats), positions, segment_ids)
    return (x, stats), norm("head_norm")(x)


def features(model, x: jax.Array, emb: jax.Array, positions, segment_ids, stats,
             moe_layers: int):
  """(x [b, t, d] with the D heads' features appended along the sequence, [b, (D+1)·t,
  d]; `stats` (per-row MoE stats, the mean over `moe_layers` layers, or None) as the mean
  over those and the MTP blocks). `emb` [D, b, t, d]: the embedded tokens t_{i+k}; called
  inside `model`'s compact `__call__` (the layers are its submodule `mtp`)."""
  kwargs = model.block_kwargs()
  block_cls = Block if model.moe is None else moe_lib.MoeBlock
  if model.moe is not None:
    kwargs["moe"] = model.moe
  layer = MtpLayer
  if model.remat_policy:  # each depth's input kept for the backward, like the stack's
    layer = nn.remat(MtpLayer, policy=remat.policy(model.remat_policy), prevent_cse=False)
  scan = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                 in_axes=(0, nn.broadcast, nn.broadcast), length=model.mtp_depth,
                 metadata_params={nn.PARTITION_NAME: None})
  zeros = None if stats is None else jnp.zeros_like(stats)
  (_, mtp_stats), feats = scan(block_cls, kwargs, model.weight_split_dims_mapping.mtp_proj,
                               name=NAME)((x, zeros), emb, positions, segment_ids)
  if stats is not None:
    stats = (stats * moe_layers + mtp_stats) / (moe_layers + model.mtp_depth)
  return jnp.concatenate([x, *feats], axis=1), stats


def shifted(batch: dict[str, jax.Array], depth: int):
  """(tokens t_{i+k} [D, b, t], targets t_{i+k+1} [b, D·t], their weights [b, D·t]) of
  depths k = 1..D, depth-major along the sequence: the main target i + k's weight where
  i + k is in the row and in i's segment, else 0 (module doc)."""
  seg = batch.get("segment_ids")
  shift = lambda x, k: jnp.pad(x[:, k:], ((0, 0), (0, min(k, x.shape[1]))))
  tokens, targets, weights = [], [], []
  for k in range(1, depth + 1):
    w = shift(batch["weights"].astype(jnp.float32), k)
    weights.append(w if seg is None else jnp.where(shift(seg, k) == seg, w, 0.0))
    tokens.append(shift(batch["inputs"], k))
    targets.append(shift(batch["targets"], k))
  return jnp.stack(tokens), jnp.concatenate(targets, 1), jnp.concatenate(weights, 1)


def split_loss(model, token_xent: jax.Array, batch: dict[str, jax.Array]
               ) -> tuple[jax.Array, jax.Array | None, Metrics]:
  """(the main tokens' cross entropy [b, t], the MTP loss's sum (its `Weighted` sum: times
  N it is mtp_loss) or None without MTP, the MTP metrics) of the loss's per-token cross
  entropy [b, (D+1)·t] (main tokens first)."""
  if not model.mtp_depth:
    return token_xent, None, {}
  t = batch["inputs"].shape[1]
  main, extra = token_xent[:, :t], token_xent[:, t:]
  weights = batch["weights"].astype(jnp.float32)
  mtp_sum = jnp.sum(extra * shifted(batch, model.mtp_depth)[2]) / model.mtp_depth
  num_tokens = jnp.sum(weights)
  return main, mtp_sum, {"mtp_loss": Weighted(mtp_sum, num_tokens),
                         "main_loss": Weighted(jnp.sum(main * weights), num_tokens)}


def validate(model, mesh_shape: dict[str, int]) -> None:
  """ConfigError naming the field: a depth < 0, a weight < 0, or MTP on a model whose
  layers it does not support (LoRA, dropout, mixed local / global layers, a split
  sequence)."""
  depth, weight_ = model.mtp_depth, model.mtp_loss_weight
  if not isinstance(depth, int) or depth < 0:
    raise ConfigError(f"task.model.mtp_depth={depth!r}: the number of multi-token-prediction "
                      "heads, an int >= 0 (0: none; DeepSeek-V3: 1).")
  if not weight_ >= 0:
    raise ConfigError(f"task.model.mtp_loss_weight={weight_!r}: the weight of the MTP loss "
                      "added to the main loss must be >= 0 (DeepSeek-V3: 0.3, then 0.1).")
  if not depth:
    return
  heads = model.activation_split_dims_mapping.heads
  unsupported = {
      "task.model.lora": model.lora is not None,
      "task.model.dropout_rate": model.dropout_rate > 0,
      "task.model.attention_pattern": len(set(model.attention_pattern)) > 1,
      "task.model.activation_split_dims_mapping (a split sequence)":
          any(mesh_shape.get(a, 1) > 1 for a in entry_axes(heads[1])),
  }
  bad = [k for k, v in unsupported.items() if v]
  if bad:
    raise ConfigError(f"task.model.mtp_depth={depth} with {', '.join(bad)}: multi-token "
                      "prediction does not support LoRA adapters, dropout, mixed local and "
                      "global layers or a sequence split over mesh axes yet. Set "
                      "task.model.mtp_depth=0, or drop those settings.")
