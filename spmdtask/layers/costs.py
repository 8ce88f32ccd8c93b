"""What a decoder LM costs to train: the params a token uses (a mixture of experts' active
params), per-layer train costs, measured from its own compiled code (what
`TransformerLm.layer_costs`, the `spmdtask.core.model.LayerCosts` protocol, returns), and
its largest activations with the config changes that shrink them
(`TransformerLm.activation_memory`, `SizesActivations`)."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from spmdtask.core import remat, sharding, train_state
from spmdtask.core.model import ActivationMemory, Held, MemoryFix, Work
from spmdtask.layers import moe as moe_lib
from spmdtask.layers.attention import window as window_lib
from spmdtask.layers.block import Block, attention_flops, param_shapes

VOCAB_TILES = 8  # the vocab tiles a fix suggests where the loss holds the whole logits
ROUTED = ("wi", "wg", "wo")  # a block's routed experts' weights, under its `moe`: [E, ...]


def active_params(params, top_k: int, num_experts: int, adapters_only: bool = False) -> int:
  """The params one token uses, counted from `params` (shapes suffice, boxed or not): all
  of them but the routed experts' weights (`.../moe/{wi,wg,wo}`, each holding all
  `num_experts` experts) and their LoRA adapters (`.../moe/wi_lora_a` etc., per expert
  too), of which a token uses `top_k`. The router and the shared experts (`moe/shared`)
  count whole, as do attention, norms, embedding and head. `adapters_only`: count only the
  LoRA adapters (`core.train_state.is_adapter_name`)."""
  total = 0
  # Unboxed by hand: flax's unbox would constrain each shape to its sharding in a mesh.
  plain = jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) else x, params,
                       is_leaf=lambda x: isinstance(x, nn.Partitioned))
  for path, x in jax.tree_util.tree_flatten_with_path(plain)[0]:
    keys = sharding.path_keys(path)
    adapter = train_state.is_adapter_name(keys[-1])
    if adapters_only and not adapter:
      continue
    weight = keys[-1].removesuffix(train_state.ADAPTER_SUFFIXES[0]).removesuffix(
        train_state.ADAPTER_SUFFIXES[1])
    routed = "moe" in keys[:-1] and weight in ROUTED and "shared" not in keys
    total += x.size * top_k // num_experts if routed else x.size
  return total


def lm_work(model, example) -> Work:
  """A TransformerLm's work per example (`work_per_example`): 6·N·T + 12·(heads·head_dim)
  per (query, key) pair the causal mask leaves, T·(T+1)/2 per layer (about half of
  12·L·w·T²), a local layer's within its window (`block.attended_pairs`), for T tokens;
  N the params a token uses: with `model.moe`, the router, top_k of the routed experts and
  the shared experts of each MoE layer (`active_params`), not all of them; then
  `Work.active_params` says N, and `Work.attention_flops` the attention term. With `lora`,
  the frozen params cost 4·N·T (forward and input gradient; no weight gradient). With
  `mtp_depth` D (layers.mtp): N holds the MTP layers' params, the shared head counts D
  more times (vocab·d_model each) and attention D more layers."""
  t = int(example["inputs"].shape[-1])
  if model.lora is not None and model.lora.base_quantization is not None:
    # A QLoRA base's stored codes are not its weights: count the float model's (layers.qlora).
    model = model.clone(lora=dataclasses.replace(model.lora, base_quantization=None))
  shapes = param_shapes(model, example)
  if model.moe is None:
    n, active = sum(x.size for x in jax.tree.leaves(shapes)), None
  else:
    n = active = active_params(shapes, model.moe.top_k, model.moe.num_experts)
  width, layers = model.num_heads * model.head_dim, model.num_layers + model.mtp_depth
  head = model.mtp_depth * model.vocab_size * model.d_model  # the head's reuse by MTP
  # Local layers attend within their window: min(i + 1, window) keys at position i (the MTP
  # layers are global: layers.mtp refuses a mixed pattern).
  local = sum(window_lib.layer_flags(model.attention_pattern, model.num_layers))
  window = model.sliding_window if local else None
  attention = attention_flops(layers, width, t, True, window, local)
  flops = 6.0 * (n + head) * t + attention
  if model.lora is not None:  # frozen weights (layers.lora): no weight gradient, 4·N not 6·N
    # The adapters a token uses: with `moe`, top_k of each routed expert's (layers.lora).
    adapters = (active_params(shapes, model.moe.top_k, model.moe.num_experts, True)
                if model.moe else active_params(shapes, 1, 1, True))
    flops -= 2.0 * (n - adapters) * t
  return Work(flops, t, active_params=active,
              attention_flops=attention)


def lm_layer_costs(model, batch_size: int, seq_len: int) -> list[float]:
  """Train-step FLOPs of [embedding, block x num_layers, head with the loss] of a TransformerLm.

  Compiled (`cost_analysis`) FLOPs of forward + backward on one batch of shape
  [batch_size, seq_len]: the embedding lookup's vjp; one `Block`'s vjp (grads of its weights
  and of its input), with `moe` one `MoeBlock`'s for the MoE layers (and one `Block`'s for
  the dense ones before `moe.first_moe_layer`); the head (final norm, unembedding, cross
  entropy; with `mtp_depth` the MTP layers too, which run after the stack) as the one-block
  model's loss-and-grad minus those two, so that it follows the model's own head code.
  Remat, vocab tiling (a loop that cost analysis counts once) and pipelining are turned
  off: they do not change what a layer costs to train.
  """
  num_layers, moe = model.num_layers, model.moe
  dense_layers = moe.first_moe_layer if moe else num_layers
  model = dataclasses.replace(model, num_layers=1, remat_policy=None, execution=None,
                              dropout_rate=0.0, loss_vocab_tiles=1,
                              moe=moe and dataclasses.replace(moe, first_moe_layer=0))
  dt = jnp.dtype(model.fprop_dtype)
  tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
  x = jax.ShapeDtypeStruct((batch_size, seq_len, model.d_model), dt)
  positions = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)

  def flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))

  def vjp(fn, *args, cotangent):
    out, pullback = jax.vjp(fn, *args)
    return out, pullback(cotangent)

  def layer(block, carry) -> float:  # carry: x, or an MoeBlock's (x, stats)
    params = jax.eval_shape(block.init, jax.random.key(0), carry, positions)["params"]
    return flops(lambda p, c, pos: vjp(lambda p, c: block.apply({"params": p}, c, pos)[0], p,
                                       c, cotangent=c), params, carry, positions)

  emb = jax.ShapeDtypeStruct((model.vocab_size, model.d_model), jnp.float32)
  embed = flops(lambda e, t, ct: vjp(lambda e: jnp.take(e, t, axis=0).astype(dt), e,
                                     cotangent=ct), emb, tokens, x)
  layers = [layer(Block(**model.block_kwargs()), x)] * dense_layers if dense_layers else []
  if moe:
    stats = jax.ShapeDtypeStruct((batch_size, len(moe_lib.STATS)), jnp.float32)
    layers += [layer(moe_lib.MoeBlock(**model.block_kwargs(), moe=model.moe), (x, stats))
               ] * (num_layers - dense_layers)
  batch = {"inputs": tokens, "targets": tokens,
           "weights": jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)}
  params = jax.eval_shape(lambda b: model.init(jax.random.key(0), b, method=model.loss),
                          batch)["params"]  # the loss's params (with MTP's)
  whole = flops(jax.value_and_grad(
      lambda p, b: model.apply({"params": p}, b, method=model.loss)[0]), params, batch)
  return [embed] + layers + [whole - embed - layers[-1]]  # the one-layer model's: the last


def lm_activation_memory(model, rows: float, seq_len: int) -> ActivationMemory:
  """What `TransformerLm.activation_memory` gives (`core.model.SizesActivations`), per
  device at `rows` rows of `seq_len` tokens at once: every layer's input, which the
  rematerialized scan keeps for the backward (all it keeps under remat 'full'; on the host
  under an offloaded preset); what a
  remat preset keeps on the device besides; the loss's float32 logits (one vocab tile of
  them with loss_vocab_tiles > 1). The fixes of its own config that lower those: vocab
  tiles, a remat preset that keeps less or offloads it, shorter rows."""
  r, t, L, dt = rows, seq_len, model.num_layers + model.mtp_depth, model.fprop_dtype
  q, kv, d, ff = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, \
      model.d_model, model.d_ff
  running = ff  # the MLP's hidden width per token while one layer runs
  if model.moe is not None:  # per token: its top_k experts' hidden rows, and the shared ones
    ff = model.moe.top_k * model.moe.d_ff + model.moe.shared_ff
    running = model.moe.top_k * model.moe.d_ff // model.moe.ff_chunks + model.moe.shared_ff
  width = {remat.Q_PROJ: q, remat.K_PROJ: kv, remat.V_PROJ: kv, remat.ATTN_CONTEXT: q,
           remat.ATTN_OUT: d, remat.MLP_UP: ff, remat.MLP_GATE: ff, remat.MLP_HIDDEN: ff,
           remat.MLP_OUT: d}
  policy, kept = model.remat_policy, []
  inputs = Held("the layers' inputs, kept for the backward", (L, r, t, d), dt)
  arrays = [] if remat.offloads(policy) else [inputs]  # an offloaded preset keeps them on the host
  names = remat.SAVED.get(policy, ())  # an offloaded preset keeps its names on the host
  acts = [n for n in names if n in width]
  if acts:
    kept.append(Held(f"what remat_policy={policy!r} keeps besides ({', '.join(acts)})",
                     (L, r, t, sum(width[n] for n in acts)), dt))
  arrays += kept
  tiles, vocab = model.loss_vocab_tiles, model.vocab_size
  logits = Held("the loss's float32 logits" if tiles == 1 else
                f"one of the loss's {tiles} float32 logits tiles",
                (r, t, -(-vocab // tiles)), "float32")
  arrays.append(logits)
  arrays.append(Held("one layer's MLP activation while it runs" if model.moe is None else
                     "one MoE layer's expert activations (top_k per token, one ff slice) "
                     "while it runs",
                     (r, t, running), dt))
  per_token = sum(a.bytes for a in arrays)  # what scales with the tokens at once
  weights = [n for n in names if n in remat.WEIGHTS]
  if weights:  # whole weights on every device, whatever the tokens
    gathered = {remat.Q_WEIGHT: q, remat.K_WEIGHT: kv, remat.V_WEIGHT: kv}
    kept.append(Held(f"the FSDP-gathered weights remat_policy={policy!r} keeps "
                     f"({', '.join(weights)})", (L, d, sum(gathered[n] for n in weights)), dt))
    arrays.append(kept[-1])
  if tiles > 1:  # layers.xent gathers one tile where it is used, reduce-scatters its gradient
    arrays.append(Held("one vocab tile of the head weight gathered while it runs, or its "
                       "gradient before its reduce-scatter", (d, -(-vocab // tiles)), dt))
  fixes = []
  if tiles == 1:
    fixes.append(MemoryFix(f"task.model.loss_vocab_tiles={VOCAB_TILES}", "the loss over vocab "
                           "tiles, never the whole float32 logits",
                           logits.bytes * (1 - 1 / VOCAB_TILES)))
  if policy in remat.OFFLOADABLE:
    fixes.append(MemoryFix(f"task.model.remat_policy='{policy}{remat.OFFLOADED}'",
                           "what it keeps, the layers' inputs included, moves to host memory",
                           inputs.bytes + sum(a.bytes for a in kept)))
  if policy not in ("full", "nothing_saveable"):
    fixes.append(MemoryFix("task.model.remat_policy='full'", "each layer keeps only its input "
                           "(one more forward per layer)", sum(a.bytes for a in kept) or None))
  if t % 2 == 0:
    fixes.append(MemoryFix(f"datasets['train'].seq_len={t // 2}", "rows of half the tokens "
                           "(a step of half the tokens): the layers' inputs, the logits and "
                           "the MLP activations halve",
                           per_token / 2))
  return ActivationMemory(tuple(sorted(arrays, key=lambda a: -a.bytes)), tuple(fixes))
