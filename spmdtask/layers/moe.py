"""Mixture-of-Experts feed-forward: a float32 router, top-k, routed SwiGLU experts, shared experts.

`MoeFfn(x [b, t, d]) -> (y [b, t, d], stats [b, len(STATS)])`. Routing groups are rows: the
Switch load-balancing loss, the z-loss, the load imbalance (max over mean assignments per
expert) and the dropped fraction are computed per row, so they, the capacity and the drops
do not depend on how the batch is split over devices or microbatches (GShard's groups, one
per sequence). The stack sums `stats` over its MoE layers; the LM adds
`aux_loss_coef · aux + z_loss_coef · z` (means over MoE layers) to each row's token losses.

Expert parallelism: where the batch dim is split over mesh axes (an `expert` axis among
them, as MaxText and Praxis lay it out) the experts run under a `jax.shard_map` manual over
those axes: expert weights keep their shard of the expert dim (axes of `expert_in[0]`),
their other dims are all-gathered over manual (FSDP) axes like `layers.base.project`, and
tokens travel by all-to-all (`layers.moe_dispatch`). A `model` axis on the ff dim stays
automatic (GSPMD).

Quantization (`layers.quant_experts`, the model's `quantization`): the routed experts'
matmuls run int8 / fp8 as `jax.lax.ragged_dot` (capacity's buffers as uniform groups; not
megablox, whose gmm takes bfloat16 / float32 only), each weight's shard quantized before its
gather; with `ff_chunks` > 1 each slice has its own scales.

LoRA (`layers.lora`, target `experts`): each routed weight's per-expert adapters run beside
it on the same rows (`ExpertLora`), gathered and split as it is; the router and the experts
are frozen.
"""
import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from spmdtask.core import remat
from spmdtask.core.model import Weighted
from spmdtask.core.sharding import entry_axes, shards
from spmdtask.errors import ConfigError
from spmdtask.layers import base, lora as lora_lib, moe_dispatch, quant as quant_lib
from spmdtask.layers import quant_experts
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, platform, project
from spmdtask.layers.block import Block, Mlp
# The config and router live in moe_router; re-exported: configs and layers name them here.
from spmdtask.layers.moe_router import (  # pylint: disable=unused-import
    BIAS, DISPATCHES, FIELD, SCORES, STATS, MoeConfig, _load_tap, route, row_stats,
    update_bias, update_buffers)

MEGABLOX_TILE = 128  # megablox gmm's default (tm, tk, tn): every dim a multiple of it


@functools.cache
def _warn_once(message: str) -> None:
  logging.warning("%s", message)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, kernel: str = "auto"
                   ) -> jax.Array:
  """lhs [m, k] rows grouped by `sizes` [G] times rhs [G, k, n] -> [m, n] (rows past the
  groups undefined). kernel: auto (megablox on TPU where every dim is a multiple of its
  tile, else `jax.lax.ragged_dot`), ragged_dot, megablox, megablox_interpret (CPU tests)."""
  if kernel == "auto":
    fits = all(s % MEGABLOX_TILE == 0 for s in (lhs.shape[0], *rhs.shape[1:]))
    kernel = "megablox" if platform() == "tpu" and fits else "ragged_dot"
    if platform() == "tpu" and not fits:
      _warn_once(f"MoE grouped matmul runs as jax.lax.ragged_dot, not megablox gmm: its dims "
                 f"(rows {lhs.shape[0]}, {rhs.shape[1]}, {rhs.shape[2]}) are not all "
                 f"multiples of {MEGABLOX_TILE}.")
  if kernel == "ragged_dot":
    return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=lhs.dtype)
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # pylint: disable=g-import-not-at-top
  return gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype,
             interpret=kernel == "megablox_interpret")


class ExpertLora(NamedTuple):
  """The routed experts' adapters as `experts_ffn` applies them (layers.lora target
  `experts`): `adapters` whole (gathered, in the compute dtype), the rows' `x_in` (wi's and
  wg's adapter inputs: the rows, or their dropout), `scale` alpha / r, `matmul(rows, w)`
  (the adapters' grouped or batched matmul), `drop_h(h, i)` (wo's adapter input from ff
  slice i's hidden: identity, or its dropout)."""
  adapters: lora_lib.ExpertAdapters
  x_in: tuple[jax.Array, jax.Array]
  scale: float
  matmul: Callable
  drop_h: Callable


def _swiglu(x, gates, wi, wg, wo, matmul, lora: ExpertLora | None = None, part=0):
  """Expert SwiGLU with the MLP's checkpoint names (every remat preset applies), each
  output row scaled by its gate; with `lora` each weight's adapter term
  (alpha / r)·x_in·A·B added to its product (`part`: the ff slice, for wo's dropout).
  The gate scales the hidden row before wo (the same product, wo being linear): its
  gradient is then a sum over d_ff, not d_model, and no d_model-wide row is scaled."""
  def lin(i, inp, w, lora_in):
    y = matmul(inp, w, i)
    if lora is None:
      return y
    a, b = lora.adapters[i]
    return y + lora.matmul(lora.matmul(lora_in, a), b) * jnp.asarray(lora.scale, y.dtype)

  x_in = (None, None) if lora is None else lora.x_in
  h = checkpoint_name(lin(0, x, wi, x_in[0]), remat.MLP_UP)
  gate = checkpoint_name(lin(1, x, wg, x_in[1]), remat.MLP_GATE)
  h = checkpoint_name(jax.nn.silu(gate) * h, remat.MLP_HIDDEN) * gates[..., None].astype(
      h.dtype)
  return lin(2, h, wo, None if lora is None else lora.drop_h(h, part))


def experts_ffn(x: jax.Array, gates: jax.Array, weights, whole: Callable, matmul: Callable,
                chunks: int, lora: ExpertLora | None = None,
                place: moe_dispatch.Placement | None = None) -> jax.Array:
  """x [..., d] through the routed experts' SwiGLU, each row times its gate (`gates` [...]);
  `weights` (wi, wg [E, d, f], wo [E, f, d]) as this device holds them, `whole(w, i)` the
  i-th of them whole (gathered over FSDP axes, in the compute dtype; quantized: the shard,
  which `matmul` quantizes and gathers), `matmul(rows, w, i)` one expert matmul with
  weight i; `lora`: their adapters (`ExpertLora`), or None.

  chunks > 1: the ff dim runs in `chunks` slices (hidden units j, j + chunks, ...: a
  `model` split of f holds every slice's share), one after another in a `lax.scan`: each
  slice's weights are gathered and its [..., f / chunks] activations made, used and freed
  in its own step, and its backward recomputes them (a checkpoint per slice, so a remat
  preset's MLP names are not kept across slices; each slice's weight gradients are its
  own, never summed over steps). The gates are applied inside, so the gates' gradient
  comes from each slice's backward and a remat'd layer need not rerun the slices for it.
  The slices' outputs sum in float32. Same FLOPs and collective bytes as chunks = 1. The
  adapters' f-dim factors (wi's and wg's B, wo's A) are sliced alike; the others and
  `lora.x_in` are every slice's (x·A is recomputed per slice: r columns, cheap).

  With `place` (moe_dispatch.Placement) `x` are the tokens [g, t, d]: each slice makes its
  rows from them and returns its output to them (the result [g, t, d]), so no [m, d] array
  (m = tokens · top_k) outlives a slice, in the forward or the backward, and the float32
  sum is over tokens, top_k times smaller than over rows."""
  def run(x, gates, wi, wg, wo, adapters, part):
    ad = None if lora is None else lora._replace(adapters=adapters)
    rows = x if place is None else place.rows(x)
    out = _swiglu(rows, gates, whole(wi, 0), whole(wg, 1), whole(wo, 2), matmul, ad, part)
    return out if place is None else place.tokens(out)

  ads = None if lora is None else lora.adapters
  if chunks == 1:
    return run(x, gates, *weights, ads, 0)

  def sliced(w, axis):  # [..., f, ...] -> [chunks, ..., f / chunks, ...], strided
    shape = w.shape[:axis] + (w.shape[axis] // chunks, chunks) + w.shape[axis + 1:]
    return jnp.moveaxis(w.reshape(shape), axis + 1, 0)

  wi, wg, wo = weights
  step = jax.checkpoint(run)
  per_slice = None if ads is None else (sliced(ads.wi[1], 2), sliced(ads.wg[1], 2),
                                         sliced(ads.wo[0], 1))

  def body(total, xs):  # the sum stays outside the checkpoint: no per-step copy of it
    ws, lora_xs, part = xs
    adapters = None if ads is None else lora_lib.ExpertAdapters(
        (ads.wi[0], lora_xs[0]), (ads.wg[0], lora_xs[1]), (lora_xs[2], ads.wo[1]))
    return total + step(x, gates, *ws, adapters, part).astype(jnp.float32), None

  zero = jnp.zeros_like(x, jnp.float32)  # varying over the manual axes x varies over
  total, _ = jax.lax.scan(body, zero, ((sliced(wi, 2), sliced(wg, 2), sliced(wo, 1)),
                                       per_slice, jnp.arange(chunks)))
  return total.astype(x.dtype)


class MoeFfn(nn.Module):
  """Router + routed experts (+ shared experts) in place of a block's Mlp (module doc)."""
  d_model: int
  cfg: MoeConfig
  dtype: jnp.dtype
  router_split: SplitDims   # [d, E]
  in_split: SplitDims       # [E, d, f]
  out_split: SplitDims      # [E, f, d]
  shared_in_split: SplitDims
  shared_out_split: SplitDims
  ff_act_split: SplitDims | None
  embed_split: SplitDims | None
  kernel: str = "auto"      # grouped_matmul's kernel (dropless)
  # Frozen router and experts; with the target `experts` the routed wi, wg, wo adapted
  # (layers.lora.expert_adapters); the shared experts' Mlp adapted as a dense MLP.
  lora: lora_lib.LoraConfig | None = None
  # Quantized shared experts (layers.quant) and routed experts (layers.quant_experts).
  quant: quant_lib.Quantization | None = None

  @nn.compact
  def __call__(self, x: jax.Array, lora_drop: lora_lib.Dropout | None = None
               ) -> tuple[jax.Array, jax.Array]:
    cfg, d, f, e = self.cfg, self.d_model, self.cfg.d_ff, self.cfg.num_experts
    lora = self.lora
    router = lora_lib.weight(self, "router", (d, e), self.router_split,
                             nn.initializers.normal(0.02), lora)
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1,
                                            out_axis=2, batch_axis=(0,))
    wi = lora_lib.weight(self, "wi", (e, d, f), self.in_split, init, lora)
    wg = lora_lib.weight(self, "wg", (e, d, f), self.in_split, init, lora)
    wo = lora_lib.weight(self, "wo", (e, f, d), self.out_split, init, lora)
    adapters = lora_lib.expert_adapters(
        self, dict(wi=(wi, self.in_split), wg=(wg, self.in_split), wo=(wo, self.out_split)),
        lora)
    batch = self.embed_split
    logits = project("btd,de->bte", x.astype(jnp.float32), router, self.router_split, batch,
                     jnp.float32)
    bias = tap = None
    if cfg.score_bias:  # read without gradient; its gradient slot gets the loads instead
      bias = self.param(BIAS, nn.with_partitioning(nn.initializers.zeros, (None,)), (e,),
                        jnp.float32)
    gates, experts, scores = route(logits, cfg, None if bias is None else
                                   jax.lax.stop_gradient(bias))
    if bias is not None:
      load = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=tuple(
          range(experts.ndim)))
      tap = _load_tap(bias, jax.lax.stop_gradient(load))
    # At init the adapters' term is skipped (B = 0: it adds nothing): a stacked layer's init
    # under nn.vmap has B unbatched (zeros use no key), and ragged_dot's batching rule needs
    # every operand batched (jax 0.10.2: "ragged_dot vmap over any dim but 0 - NYI").
    adapters = None if self.is_initializing() else adapters
    drop = lora_drop if adapters is not None and lora.dropout else None
    y, dropped = self._experts(x, experts, gates, (wi, wg, wo), adapters, drop)
    y = checkpoint_name(constrain(y, batch), remat.MLP_OUT)
    if tap is not None:
      y = y + tap.astype(y.dtype)
    if cfg.shared_ff:
      y = y + Mlp(d, cfg.shared_ff, "swiglu", self.dtype, self.shared_in_split,
                  self.shared_out_split, self.ff_act_split, lora=lora, quant=self.quant,
                  name="shared")(x, lora_drop)
    return y, row_stats(logits, scores, experts, dropped, cfg)

  def _experts(self, x, experts, gates, weights, adapters, drop):
    """The dispatch, per device under a shard_map manual over the batch's axes (module doc);
    `adapters` (lora.ExpertAdapters or None) gathered and applied beside the weights, `drop`
    (lora.Dropout or None) their inputs' dropout, per assignment from its global id (row id
    · t·k + token · k + choice), which travels with the token."""
    cfg, dt = self.cfg, self.dtype
    if self.quant is not None and self.kernel.startswith("megablox"):
      raise ConfigError(
          f"MoeFfn.kernel={self.kernel!r} with task.model.quantization="
          f"{self.quant.kind!r}: megablox gmm multiplies bfloat16 / float32 only; quantized "
          "experts run as jax.lax.ragged_dot: set kernel='auto' or 'ragged_dot'.")
    mesh = jax.sharding.get_abstract_mesh()
    manual = base.batch_axes(mesh, self.embed_split, x.shape[0])
    ep = tuple(a for a in entry_axes(self.in_split[0]) if a in manual)
    n_ep = shards(ep, mesh.shape) if ep else 1
    # Per dim, the manual (FSDP) axes to gather over; the expert dim stays split.
    gathered = [((),) + tuple(tuple(a for a in entry_axes(s) if a in manual) for s in split[1:])
                for split in (self.in_split, self.in_split, self.out_split)]
    # An adapter's dims: A (e, in, r), B (e, r, out): the base weight's in / out entries.
    ad_gathered = [(((), g[1], ()), ((), (), g[2])) for g in gathered]

    def whole(w, i):  # weight i's local shard whole over the manual FSDP axes, in dt
      if self.quant is not None:  # quantized as a shard, gathered in int8 / fp8 (`grouped`)
        return w.astype(base.moved_dtype(dt))
      return base.gather(w.astype(base.moved_dtype(dt)), gathered[i]).astype(dt)

    same = tuple(a for a in manual if a not in ep)  # devices holding the same experts

    def grouped(h, w, i, sizes):  # the expert matmul h [m, k] x weight i, rows by `sizes`
      if self.quant is None:
        return grouped_matmul(h, w, sizes, self.kernel)
      return quant_experts.grouped(self.quant, h, w, sizes, dt, manual, same, gathered[i],
                                   base.gather, base.scatter)

    def local(x, experts, gates, ws, ads, ids, key):
      """One device's dispatch; `ads` its adapter shards, `ids` its assignments' global ids
      and `key` the dropout's key data (None without adapters / dropout)."""
      x = x.astype(dt)

      def lora_for(rows, row_ids, matmul):  # the adapters' ExpertLora for these rows
        if ads is None:
          return None
        whole_ads = lora_lib.ExpertAdapters(*[
            tuple(base.gather(w.astype(base.moved_dtype(dt)), axes).astype(dt)
                  for w, axes in zip(pair, ad_gathered[i])) for i, pair in enumerate(ads)])
        if row_ids is None:
          return ExpertLora(whole_ads, (rows, rows), self.lora.scale, matmul, lambda h, _: h)

        def dropped(v, which):  # v [..., n], a row per assignment: its mask from its id
          flat = v.reshape(-1, v.shape[-1])
          return base.dropout(flat, self.lora.dropout, key, row_ids.reshape(-1),
                              which).reshape(v.shape)
        wo, n = lora_lib.expert_dropout_stream("wo"), len(lora_lib.EXPERT_WEIGHTS)
        return ExpertLora(  # ff slice `part` of wo's input draws from stream wo + n·part
            whole_ads, tuple(dropped(rows, lora_lib.expert_dropout_stream(w))
                             for w in ("wi", "wg")),
            self.lora.scale, matmul, lambda h, part: dropped(h, wo + n * part))

      if cfg.dispatch == "dropless":
        def ffn(rows, row_gates, row_ids, sizes, place):
          if place is not None and ads is not None:  # the adapters' inputs: rows made once
            return place.tokens(ffn(place.rows(rows), row_gates, row_ids, sizes, None))
          mm = lambda h, w, i: grouped(h, w, i, sizes)
          # The adapters' rank is far below megablox's tile: plain ragged_dot.
          small = lambda h, w: grouped_matmul(h, w, sizes, "ragged_dot")
          return experts_ffn(rows, row_gates, ws, whole, mm, cfg.ff_chunks,
                             lora_for(rows, row_ids, small), place)
        return moe_dispatch.dropless(x, experts, gates, cfg.num_experts // n_ep, ep, n_ep, ffn,
                                     ids)
      cap = moe_dispatch.capacity(x.shape[1], cfg.top_k, cfg.num_experts,
                                  cfg.capacity_factor)
      mm = lambda h, w: jnp.einsum("emd,edf->emf", h, w)

      def mm_i(h, w, i):  # quantized: the slots as rows grouped by expert
        if self.quant is None:
          return mm(h, w)
        e_loc, r = h.shape[:2]
        sizes = jnp.full((e_loc,), r, jnp.int32)
        return grouped(h.reshape(e_loc * r, -1), w, i, sizes).reshape(e_loc, r, -1)
      ffn = lambda buf, buf_gates, buf_ids: experts_ffn(
          buf, buf_gates, ws, whole, mm_i, cfg.ff_chunks, lora_for(buf, buf_ids, mm))
      return moe_dispatch.capacity_dispatch(x, experts, gates, cfg.num_experts, cap, ep, n_ep,
                                            ffn, ids)

    ids = key = None
    if drop is not None:
      t, k = experts.shape[1:]
      ids = (drop.row_ids.astype(jnp.int32)[:, None, None] * (t * k)
             + jnp.arange(t * k, dtype=jnp.int32).reshape(t, k))
      key = drop.key
    # A Pallas kernel (megablox gmm, TPU) has no partitioning rule: its shard_map is manual
    # over every mesh axis (those that do not split an input replicate it), and unchecked:
    # gmm's group metadata (jnp.histogram) fails to trace with manual-axis types (jax 0.10.2).
    megablox = (cfg.dispatch == "dropless" and platform() == "tpu" and not mesh.empty
                and self.quant is None)
    if not manual and not megablox:
      return local(x, experts, gates, weights, adapters, ids, key)
    names = set(mesh.axis_names) - set(mesh.manual_axes) if megablox else set(manual)
    rows = P(manual or None)
    spec = lambda axes: P(ep or None, *[a or None for a in axes])
    w_specs = tuple(spec(axes[1:]) for axes in gathered)
    ad_specs = None if adapters is None else lora_lib.ExpertAdapters(
        *[tuple(spec(axes[1:]) for axes in pair) for pair in ad_gathered])
    # Optional inputs (None) pass outside the shard_map: `given` says which go in.
    opt = {"ads": (adapters, ad_specs), "ids": (ids, rows), "key": (key, P())}
    given = [n for n, (v, _) in opt.items() if v is not None]

    def manual_local(x, experts, gates, ws, *rest):
      got = dict(zip(given, rest))
      return local(x, experts, gates, ws, got.get("ads"), got.get("ids"), got.get("key"))
    return jax.shard_map(manual_local,
                         in_specs=(rows, rows, rows, w_specs) + tuple(opt[n][1] for n in given),
                         out_specs=(rows, rows), axis_names=names, check_vma=not megablox)(
                             x, experts, gates, weights, *[opt[n][0] for n in given])


class MoeBlock(Block):
  """A `Block` whose feed-forward is `MoeFfn` (submodule `moe`). Its carry is
  `(x [b, t, d], stats [b, len(STATS)])`: each layer adds its rows' `row_stats`."""
  moe: MoeConfig | None = None

  @nn.compact
  def __call__(self, carry, positions, segment_ids=None, row_ids=None, cache=None,
               dropout_key=None, is_local=None):
    x, stats = carry
    w, a = self.wsplit, self.asplit
    x, cache = self._attention(x, positions, segment_ids, row_ids, cache, dropout_key,
                               is_local)
    h = RmsNorm(self.d_model, self.norm_eps, w.norm, lora_lib.frozen(self.lora),
                name="mlp_norm")(x)
    h, layer_stats = MoeFfn(self.d_model, self.moe, self.dtype, w.router, w.expert_in,
                            w.expert_out, w.mlp_in, w.mlp_out, a.ff, a.embed, lora=self.lora,
                            quant=self.quant, name="moe")(h, self._lora_drop(dropout_key, row_ids))
    x = constrain(x + self._dropout(h, dropout_key, row_ids, 1), a.embed)
    return (x, stats + layer_stats), cache


def add_router_losses(cfg: MoeConfig | None, stats, token_xent, weights):
  """Each row's `aux_loss_coef · aux + z_loss_coef · z` (means over the MoE layers) added to
  its tokens' losses, and `STATS` as token-weighted means over rows; a dense
  model's (stats None) unchanged, no metrics."""
  if stats is None:
    return token_xent, {}
  row_tokens = jnp.sum(weights, axis=1)
  extra = cfg.aux_loss_coef * stats[:, 0] + cfg.z_loss_coef * stats[:, 1]
  metrics = {name: Weighted(jnp.sum(stats[:, i] * row_tokens), jnp.sum(row_tokens))
             for i, name in enumerate(STATS)}
  return token_xent + extra[:, None], metrics
