"""Tests for spmdtask.pipeline.mpmd.split: the marker is an identity everywhere, and the stages
of a split function compose (forward and backward) to the function and its jax.grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.pipeline.mpmd.split import split, stage_boundary, stage_boundary_p
from tests import util

B = 4  # rows; every width below is distinct so a value is named by its shape


def params():
  ks = jax.random.split(jax.random.key(0), 6)
  shapes = {"w0": (3, 6), "w1": (6, 7), "wu": (7, 2), "w2": (7, 5), "ws": (6, 5), "w3": (5, 6)}
  return {k: jax.random.normal(kk, s) / np.sqrt(s[0]) for kk, (k, s) in zip(ks, shapes.items())}


def batch():
  return jax.random.normal(jax.random.key(1), (B, 3))


def four_stages(p, x, mark=True):
  """Stage 0: a = tanh(x w0). Stage 1: b from a; c = sum(sin b) is used in stage 1 only,
  `b @ wu` by nobody. Stage 2: d = tanh(b2 w2) + a ws (a skips stage 1). Stage 3: a
  reconstruction of x through w0 transposed (w0 tied between stages 0 and 3)."""
  m = stage_boundary if mark else (lambda v: v)
  a = m(jnp.tanh(x @ p["w0"]))                      # [B, 6]
  b = jnp.tanh(a @ p["w1"])                         # [B, 7]
  c = jnp.sum(jnp.sin(b), -1, keepdims=True)        # [B, 1]
  _ = b @ p["wu"]                                   # [B, 2], dead
  b2 = m(b * c)                                     # [B, 7]
  d = m(jnp.tanh(b2 @ p["w2"]) + a @ p["ws"])       # [B, 5]
  y = (d @ p["w3"]) @ p["w0"].T                     # [B, 3]
  return jnp.mean((y - x) ** 2)


def count_markers(jaxpr) -> int:
  return sum(e.primitive is stage_boundary_p for e in jaxpr.eqns)


def test_marker_is_identity_for_grad_vmap_jit():
  p, x = params(), batch()
  unmarked = jax.value_and_grad(four_stages)(p, x, mark=False)
  for got in (jax.value_and_grad(four_stages)(p, x),
              jax.jit(jax.value_and_grad(four_stages))(p, x)):
    np.testing.assert_allclose(got[0], unmarked[0], rtol=1e-6)
    util.assert_trees_close(got[1], unmarked[1], terms=B, rtol=1e-6)
  per_row = jax.vmap(lambda r: four_stages(p, r[None]))(x)
  per_row_ref = jax.vmap(lambda r: four_stages(p, r[None], mark=False))(x)
  np.testing.assert_allclose(per_row, per_row_ref, rtol=1e-6)
  # The transpose marks the backward: grad's jaxpr has each cut twice.
  assert count_markers(jax.make_jaxpr(four_stages)(p, x).jaxpr) == 3
  assert count_markers(jax.make_jaxpr(jax.grad(four_stages))(p, x).jaxpr) == 6


def test_split_boundaries_args_and_tied():
  p, x = params(), batch()
  staged = split(four_stages, p, x)
  assert staged.num_stages == 4
  crossing = [sorted((v.aval.shape, v.producer, v.consumers) for v in staged.crossing(b))
              for b in range(3)]
  a, b2, d = (B, 6), (B, 7), (B, 5)
  assert crossing == [[(a, 0, (1, 2))],             # a goes to stages 1 and 2 directly
                      [(a, 0, (1, 2)), (b2, 1, (2,))],  # c [B,1] and b@wu [B,2] never cross
                      [(d, 2, (3,))]]               # a is dead after stage 2
  used = [{staged.arg_paths[i] for i in st.arg_leaves} for st in staged.stages]
  assert used == [{"[0]['w0']", "[1]"}, {"[0]['w1']"}, {"[0]['w2']", "[0]['ws']"},
                  {"[0]['w0']", "[0]['w3']", "[1]"}]  # wu (dead) goes nowhere
  paths = {staged.arg_paths[i]: s for i, s in staged.tied.items()}
  assert paths == {"[0]['w0']": (0, 3), "[1]": (0, 3)}
  # The transpose of the tied w0 is computed on stage 3, where it is used.
  assert any(e.primitive.name == "transpose" for e in staged.stages[3].jaxpr.jaxpr.eqns)
  assert not any(e.primitive.name == "transpose" for e in staged.stages[0].jaxpr.jaxpr.eqns)


def test_stages_compose_to_value_and_grad():
  """Forward stage by stage, then backward with jax.vjp of each stage in reverse; the
  cotangent of a value sent to two stages is the sum of theirs."""
  p, x = params(), batch()
  staged = split(four_stages, p, x)
  leaves = jax.tree.leaves((p, x))
  have, vjps = {}, []
  for st in staged.stages:
    out, vjp = jax.vjp(st, [leaves[i] for i in st.arg_leaves], [have[i] for i in st.incoming])
    vjps.append(vjp)
    have.update(zip(st.outgoing, out))
  loss = out[0]
  grads = [jnp.zeros_like(l) for l in leaves]
  cot = {}
  for st, vjp in zip(reversed(staged.stages), reversed(vjps)):
    seed = (jnp.ones_like(loss),) if st.index == 3 else tuple(cot.pop(i) for i in st.outgoing)
    d_args, d_in = vjp(seed)
    for i, g in zip(st.arg_leaves, d_args):
      grads[i] = grads[i] + g
    for i, g in zip(st.incoming, d_in):
      cot[i] = cot.get(i, 0) + g
  assert not cot
  want_loss, want = jax.value_and_grad(four_stages, argnums=(0, 1))(p, x, mark=False)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(staged(p, x), want_loss, rtol=1e-6)
  for g, w in zip(grads, jax.tree.leaves(want)):
    util.assert_close_f32(g, w, terms=B)


def test_markers_inside_jit_are_inlined_and_inside_scan_rejected():
  p, x = params(), batch()
  inner = jax.jit(lambda h, w: stage_boundary(jnp.tanh(h @ w)))

  def f(p, x):
    h = inner(inner(x, p["w0"]) @ p["w1"], p["wu"])  # the same jitted function twice
    return jnp.sum(h ** 2)

  staged = split(f, p, x)
  assert staged.num_stages == 3
  assert [[v.aval.shape for v in staged.crossing(b)] for b in range(2)] == [[(B, 6)], [(B, 2)]]
  np.testing.assert_allclose(staged(p, x), f(p, x), rtol=1e-6)

  def scanned(p, x):
    return jax.lax.scan(lambda h, _: (stage_boundary(h), None), x, None, length=2)[0].sum()

  with pytest.raises(ValueError, match="inside a `scan`"):
    split(scanned, p, x)
