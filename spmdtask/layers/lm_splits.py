"""The split-dims mappings of `TransformerLm`'s weights and activations (its
`weight_split_dims_mapping` and `activation_split_dims_mapping` fields): which mesh axes
split each dim, in the order shown."""
import dataclasses

from spmdtask.core.sharding import entry_axes, shards
from spmdtask.layers.base import SplitDims

BATCH = ("data", "fsdp")  # the default data axes of an activation's batch dim


@dataclasses.dataclass(frozen=True)
class WeightSplit:
  """Split-dims mapping of every LM weight (per weight dim, in the order shown)."""
  embedding: SplitDims = ("model", "fsdp")        # [vocab, d_model]
  unembed: SplitDims = ("fsdp", "model")          # [d_model, vocab]
  q: SplitDims = ("fsdp", "model", None)          # [d_model, heads, head_dim]
  kv: SplitDims = ("fsdp", "model", None)         # [d_model, kv_heads, head_dim]
  o: SplitDims = ("model", None, "fsdp")          # [heads, head_dim, d_model]
  mlp_in: SplitDims = ("fsdp", "model")           # [d_model, d_ff]
  mlp_out: SplitDims = ("model", "fsdp")          # [d_ff, d_model]
  norm: SplitDims = (None,)                       # [d_model]
  # Mixture of Experts (layers.moe): no `expert` axis by default (dense meshes have none);
  # expert parallelism sets e.g. expert_in=("expert", "fsdp", "model").
  router: SplitDims = (None, None)                # [d_model, experts]
  expert_in: SplitDims = (None, "fsdp", "model")  # [experts, d_model, expert d_ff]
  expert_out: SplitDims = (None, "model", "fsdp") # [experts, expert d_ff, d_model]
  # Multi-head latent attention (layers.attention.mla; `q` maps its direct query
  # [d_model, heads, qk_head_dim] and `o` its output [heads, v_head_dim, d_model]).
  mla_q_down: SplitDims = ("fsdp", None)          # [d_model, q_lora_rank]
  mla_q_up: SplitDims = (None, "model", None)     # [q_lora_rank, heads, qk_head_dim]
  mla_kv_down: SplitDims = ("fsdp", None)         # [d_model, kv_lora_rank + rope dim]
  mla_kv_up: SplitDims = (None, "model", None)    # [kv_lora_rank, heads, nope + v dims]
  mtp_proj: SplitDims = ("fsdp", None)            # [2 · d_model, d_model] (layers.mtp)
  # Of block.GATHER_AT_ONCE: weights FSDP gathers by one all-gather over all the axes that
  # split a dim, not one at a time (layers.base.gather_at_once); gradients still per axis.
  gather_at_once: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ActivationSplit:
  """Split-dims mapping of the main activations.

  The seq dim (dim 1) is whole by default; naming a mesh axis there (e.g. 'context', in
  every field alike) splits the sequence over it: context parallelism. Attention then runs
  across the shards as `TransformerLm.context_attention` says (layers.attention.context),
  and the loss reorders each row's tokens zig-zag (with their targets, weights, positions
  and segment ids) so that every shard does the same causal work.
  """
  embed: SplitDims = (BATCH, None, None)          # [batch, seq, d_model]
  heads: SplitDims = (BATCH, None, "model", None) # [batch, seq, heads, head_dim]
  ff: SplitDims = (BATCH, None, "model")          # [batch, seq, d_ff]
  logits: SplitDims = (BATCH, None, "model")      # [batch, seq, vocab]



def whole_rows(a: ActivationSplit, axes: tuple[str, ...], kv_heads: int,
               mesh_shape) -> ActivationSplit:
  """`a` with no axis of `axes` splitting any activation's rows (dim 0): for a decode
  step's few rows under weights split over `axes` (FSDP's). Each device then multiplies its
  own shard of every weight by all the rows and the partial sums are reduced: a few rows
  cross the links, no weight is gathered and no layer is held whole. Where the `kv_heads`
  divide the heads' axes and `axes` (0: a cache without heads, MLA's) attention and its KV
  cache are split over the heads by `axes` too; else they keep their rows split as in `a`."""
  drop = lambda e: tuple(x for x in entry_axes(e) if x not in axes) or None
  rows_whole = lambda s: (drop(s[0]), *s[1:])
  heads, by_heads = a.heads, (*entry_axes(a.heads[2]), *axes)
  if kv_heads and kv_heads % shards(by_heads, mesh_shape) == 0:
    heads = (drop(heads[0]), heads[1], by_heads, *heads[3:])
  return dataclasses.replace(a, embed=rows_whole(a.embed), heads=heads, ff=rows_whole(a.ff),
                             logits=rows_whole(a.logits))
