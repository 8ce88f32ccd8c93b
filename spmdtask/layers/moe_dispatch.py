"""Token dispatch for a Mixture of Experts: tokens to their experts and back, per device.

Both functions run on one device's tokens (inside a `jax.shard_map` manual over the
batch's axes, or globally where there is no such split) and take the routing for them:
`x [g, t, d]` (g rows of t tokens), `experts [g, t, k]` int32 ids and `gates [g, t, k]`.
`ffn` applies the local experts' SwiGLU, each output row times its gate (a remat'd layer
then needs no rerun of the experts for the gates' gradient): under `ep` (the `expert` mesh
axes, manual here) each device holds `E / n_ep` consecutive experts and tokens travel to
their experts' devices by all-to-all, and back.

- `dropless`: every assignment is computed. Assignments are sorted by expert and run as one
  grouped matmul (`ffn` gets rows sorted by local expert and the group sizes), then gathered
  back in token order (no scatter, no buffer besides the sorted rows). Without expert
  parallelism `ffn` gets the tokens and a `Placement` that makes the rows from them and
  returns its output to them, so that it can do both per ff slice (layers.moe). With expert
  parallelism each device sends every destination a buffer of the worst case (all its
  assignments), padded: XLA:CPU cannot compile `jax.lax.ragged_all_to_all` (jax 0.10.2:
  "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"), so the
  exchange is a dense `all_to_all` of `[n_ep, assignments, d]` and the padding rows form no
  group.
- `capacity` (GShard): within each row, expert e takes its first C assignments (all top-1
  choices before any top-2, then in token order); the others are dropped (the token keeps
  its residual only). Buffers `[g, E, C, d]` are exchanged by `all_to_all` over the expert dim.

Groups are rows: the capacity and the drops of a row do not depend on how the batch is
split over devices or microbatches, so every layout computes the same function.
"""
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  """Slots per expert per row: ceil(factor · tokens · k / E)."""
  return max(1, math.ceil(factor * tokens * top_k / num_experts))


class Placement(NamedTuple):
  """Where a dispatch's rows come from and go: `rows(tokens [g, t, d]) -> [m, d]` each
  assignment's token, sorted by expert; `tokens(out [m, d]) -> [g, t, d]` each token's
  assignments summed back (`placement`)."""
  rows: Callable
  tokens: Callable


def placement(order: jax.Array, k: int, g: int, t: int) -> Placement:
  """The Placement of the m = g·t·k assignments (flat ids token · k + choice) sorted by
  `order` [m]. Each of its two maps is the other's transpose, and is its backward: both
  ways run as gathers, never as a scatter-add or a [g, t, k, d] broadcast (what autodiff
  of the gathers would make: on TPU a slow scatter and a rows-sized buffer more)."""
  src, back = order // k, jnp.argsort(order)  # each row's token; each assignment's row

  @jax.custom_vjp
  def rows(tok, src, back):  # [g·t, d] -> [m, d]
    del back
    return tok[src]

  @jax.custom_vjp
  def tokens(out, src, back):  # [m, d] -> [g·t, d]
    del src
    return jnp.sum(out[back].reshape(-1, k, out.shape[-1]), axis=1)

  rows.defvjp(lambda tok, s, b: (rows(tok, s, b), (s, b)),
              lambda res, ct: (tokens(ct, *res), None, None))
  tokens.defvjp(lambda out, s, b: (tokens(out, s, b), (s, b)),
                lambda res, ct: (rows(ct, *res), None, None))
  return Placement(lambda x: rows(x.reshape(g * t, x.shape[-1]), src, back),
                   lambda out: tokens(out, src, back).reshape(g, t, out.shape[-1]))


def _exchange(x: jax.Array, ep: tuple[str, ...], axis: int) -> jax.Array:
  """Chunk j of `axis` to device j of the `ep` axes; chunk i back from device i."""
  if not ep:
    return x
  return jax.lax.all_to_all(x, ep, axis, axis, tiled=True)


def dropless(x: jax.Array, experts: jax.Array, gates: jax.Array, num_local: int,
             ep: tuple[str, ...], n_ep: int, ffn: Callable, ids: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
  """(output [g, t, d], dropped assignments per row [g] (zeros)) (module doc).

  `ffn(rows [m, d], row_gates [m], row_ids [m] | None, group_sizes [num_local],
  place: Placement | None) -> [m, d]` runs rows sorted by local expert, each output row
  times its gate; `row_ids` are `ids` [g, t, k] (int32, one per assignment) travelling with
  their rows, or None. Without `ep`, `ffn(x, ..., place) -> [g, t, d]` gets the tokens and
  their `Placement` instead (module doc).
  """
  g, t, d = x.shape
  k = experts.shape[-1]
  m = g * t * k
  flat = experts.reshape(m)
  order = jnp.argsort(flat, stable=True)  # by expert, hence by destination device
  sorted_e = flat[order]
  row_gates = gates.reshape(m)[order]
  row_ids = None if ids is None else ids.reshape(m)[order]
  place = placement(order, k, g, t)
  if not ep:  # every expert here: one grouped matmul, then each assignment back in place
    sizes = jnp.bincount(flat, length=num_local).astype(jnp.int32)
    return ffn(x, row_gates, row_ids, sizes, place), jnp.zeros((g,), jnp.float32)
  rows = place.rows(x)
  dest = sorted_e // num_local
  # Slot of each assignment in its destination's buffer: its rank among those going there.
  per_dest = jnp.bincount(dest, length=n_ep)
  slot = jnp.arange(m) - (jnp.cumsum(per_dest) - per_dest)[dest]
  send = jnp.zeros((n_ep, m, d), x.dtype).at[dest, slot].set(rows)
  send_e = jnp.full((n_ep, m), num_local, jnp.int32).at[dest, slot].set(sorted_e % num_local)
  send_g = jnp.zeros((n_ep, m), gates.dtype).at[dest, slot].set(row_gates)
  recv, recv_e = _exchange(send, ep, 0), _exchange(send_e, ep, 0)
  recv_g = _exchange(send_g, ep, 0).reshape(n_ep * m)
  recv_i = None if ids is None else _exchange(
      jnp.zeros((n_ep, m), jnp.int32).at[dest, slot].set(row_ids), ep, 0).reshape(n_ep * m)
  # The receiver runs what arrived grouped by its local expert; padding (id num_local) last.
  recv_e = recv_e.reshape(n_ep * m)
  local_order = jnp.argsort(recv_e, stable=True)
  sizes = jnp.bincount(recv_e, length=num_local).astype(jnp.int32)
  valid = (recv_e[local_order] < num_local)[:, None]
  out = jnp.where(valid, ffn(recv.reshape(n_ep * m, d)[local_order], recv_g[local_order],
                             None if ids is None else recv_i[local_order], sizes, None), 0)
  back = jnp.zeros_like(out).at[local_order].set(out).reshape(n_ep, m, d)
  back = _exchange(back, ep, 0)[dest, slot]                 # [m, d], sorted order
  return place.tokens(back), jnp.zeros((g,), jnp.float32)


def capacity_dispatch(x: jax.Array, experts: jax.Array, gates: jax.Array, num_experts: int,
                      cap: int, ep: tuple[str, ...], n_ep: int, ffn: Callable,
                      ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(output [g, t, d], dropped assignments per row [g]) (module doc).

  `ffn(buffers [E_local, rows, d], gates [E_local, rows], ids [E_local, rows] | None)
  -> [E_local, rows, d]` runs each local expert's slots, each output row times its gate (0
  in an empty slot); `ids` are `ids` [g, t, k] (int32) travelling with their slots, or None.
  """
  g, t, d = x.shape
  k = experts.shape[-1]
  # Position in the expert's queue, top-1 choices of the whole row before any top-2.
  onehot = jax.nn.one_hot(experts.transpose(0, 2, 1), num_experts, dtype=jnp.int32)
  pos = jnp.cumsum(onehot.reshape(g, k * t, num_experts), axis=1).reshape(onehot.shape)
  pos = jnp.sum((pos - 1) * onehot, axis=-1).transpose(0, 2, 1)  # [g, t, k]
  keep = pos < cap
  rows = jnp.broadcast_to(jnp.arange(g)[:, None, None], experts.shape)
  src = jnp.broadcast_to(x[:, :, None, :], (g, t, k, d))
  # Dropped assignments index slot `cap` (out of range): the scatter drops them.
  slot = jnp.where(keep, pos, cap)
  buf = jnp.zeros((g, num_experts, cap, d), x.dtype).at[rows, experts, slot].set(
      src, mode="drop")
  e_loc = num_experts // n_ep
  buf_g = jnp.zeros((g, num_experts, cap), gates.dtype).at[rows, experts, slot].set(
      gates, mode="drop")
  buf = _exchange(buf.reshape(g, n_ep, e_loc, cap, d), ep, 1)  # [g, src dev, E_local, C, d]
  buf_g = _exchange(buf_g.reshape(g, n_ep, e_loc, cap), ep, 1)
  buf_i = None
  if ids is not None:
    buf_i = jnp.zeros((g, num_experts, cap), jnp.int32).at[rows, experts, slot].set(
        ids, mode="drop")
    buf_i = _exchange(buf_i.reshape(g, n_ep, e_loc, cap), ep, 1).transpose(2, 0, 1, 3)
    buf_i = buf_i.reshape(e_loc, g * n_ep * cap)
  out = ffn(buf.transpose(2, 0, 1, 3, 4).reshape(e_loc, g * n_ep * cap, d),
            buf_g.transpose(2, 0, 1, 3).reshape(e_loc, g * n_ep * cap), buf_i)
  out = out.reshape(e_loc, g, n_ep, cap, d).transpose(1, 2, 0, 3, 4)
  out = _exchange(out, ep, 1).reshape(g, num_experts, cap, d)
  y = out.at[rows, experts, slot].get(mode="fill", fill_value=0)  # [g, t, k, d], gated
  return jnp.sum(y, axis=2), jnp.sum(~keep, axis=(1, 2)).astype(jnp.float32)
