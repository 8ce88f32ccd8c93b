"""MPMD pipeline: one program per stage on its own submesh, run by a schedule.

`Pipeline(loss_fn, params, microbatch, stages, schedule)` splits `loss_fn(params, batch)`
at its `stage_boundary` markers into `num_stages * num_chunks` parts (see split.py) and
jits, for every part on the submesh of the stage that runs it (schedule.virtual_stage):

  fwd(params, batch[M, ...], m, incoming) -> (outgoing, residuals)    jax.fwd_and_bwd
  bwd(residuals, d_outgoing, grad_acc) -> (grad_acc + d_params, d_incoming)   acc donated

through `steps.partition`. `run` walks the schedule in one Python process, dispatching
asynchronously (no host sync inside a step), in `order`: one execution order consistent
with every stage's list and the split's value dependencies (mpmd_parts.execution_order,
the validator's and simulator's engine); `mpmd_run.Runner` holds the dispatch table of
F / B / I / W and measures the residual bytes each stage holds.

I and W (zero-bubble schedules such as zb_h1) are B cut in two by `backward_split`: I
computes only what the input cotangents need and stashes the per-layer output cotangents
(with the layer inputs W reads from the residuals); W turns them into weight grads without
recomputing anything, so FLOPs(I) + FLOPs(W) = FLOPs(B).

Memory: F(m, c) makes one activation set (residuals) and B or I releases it; I to W holds
the smaller weight-grad stash. `RunResult` reports per stage the peak count and the peak
measured bytes of both (see mpmd_run).

Microbatch m holds rows m, m + M, ... of the batch (as gradient accumulation splits it).

Loss: `loss_fn` returns microbatch m's loss (or `(loss, aux)` with has_aux); the step loss
is `sum_m w[m] * loss_m` with `w = 1/M` by default, so a per-example-mean loss over equal
microbatches gives the full-batch mean. Pass `weights` (e.g. tokens_m / tokens) for other
normalisations; w[m] is also the cotangent that seeds microbatch m's backward.

Params live per stage as a dict {path: array} (path = jax.tree_util.keystr within the
params tree) holding the leaves its parts use; a leaf used by several stages (tied) has a
copy on each, and `run` returns each copy's gradient summed over all of them (summed on
the first stage, sent back), so identical updates keep the copies identical. Leaves no
part uses go to stage 0 (zero gradient; weight decay still applies).

Several processes: each stage's submesh lies in one process, which alone runs its
programs; every process walks the same `order`, and a value (or cotangent) whose producer
and consumer stages sit in different processes crosses with a collective both call at
that point (mpmd_cross.Cross.move). Results then exist only where their stage does: `run`
gives None for the loss, aux and grads of stages this process does not own.
"""
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask import steps
from spmdtask.errors import ConfigError
from spmdtask.pipeline import mpmd_cross
from spmdtask.pipeline.mpmd_run import Runner, backward_flops
from spmdtask.pipeline import split as split_lib
from spmdtask.pipeline.mpmd_parts import (Part, RunResult, StageSpec, check_meshes, flat_specs,
                                          execution_order, is_float, split_backward)
from spmdtask.pipeline.schedule import Schedule


class Pipeline:
  """A loss function cut into stages on submeshes, and a schedule to run it (module doc)."""

  def __init__(self, loss_fn: Callable, params, microbatch, stages: Sequence[StageSpec],
               schedule: Schedule, has_aux: bool = False):
    self.stages, self.schedule, self.has_aux = tuple(stages), schedule, has_aux
    S, V = schedule.num_stages, schedule.num_chunks
    check_meshes(self.stages, S)
    self.cross = mpmd_cross.Cross([st.mesh for st in self.stages])
    local = self.cross.local
    self.staged = split_lib.split(loss_fn, params, microbatch)
    self._split_args, self._under_mesh = (loss_fn, params, microbatch), {}
    if self.staged.num_stages != S * V:
      raise ConfigError(
          f"The loss function has {self.staged.num_stages - 1} stage_boundary markers, so "
          f"{self.staged.num_stages} parts, but the schedule has {S} stages x {V} chunks = "
          f"{S * V} parts. Add or remove markers, or change the schedule's stages/chunks.")
    flat_params, self.params_tree = jax.tree_util.tree_flatten_with_path(params)
    self.paths = tuple(jax.tree_util.keystr(p) for p, _ in flat_params)
    self.batch_tree = jax.tree.structure(microbatch)
    self.num_params = len(self.paths)
    self.param_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in flat_params]
    for (p, x) in flat_params:
      if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ConfigError(f"Param {jax.tree_util.keystr(p)} has dtype {x.dtype}; pipelined "
                          "params must be floating point (pass integers in the batch).")
    self.param_specs = [flat_specs(st.param_specs, params, "param_specs") for st in stages]
    self.batch_specs = [flat_specs(st.batch_specs, microbatch, "batch_specs") for st in stages]
    self.values = self.staged.values
    self.part_stage = [schedule.owner(v)[0] for v in range(S * V)]
    self.stage_keys = self._stage_keys()
    M = schedule.num_microbatches
    self.batch_avals = [jax.ShapeDtypeStruct((M, *x.shape), x.dtype)
                         for x in jax.tree.leaves(microbatch)]
    self._split_parts = {schedule.virtual_stage(s, a.chunk)
                         for s, row in enumerate(schedule.actions) for a in row if a.kind == "I"}
    self.parts = tuple(self._build_part(v) for v in range(S * V))
    self.tied = {k: tuple(s for s in range(S) if k in self.stage_keys[s])
                 for k in self.paths if sum(k in ks for ks in self.stage_keys) > 1}
    self.order = execution_order(schedule, self.parts, self.values)
    self._zeros = [self._zeros_program(s) for s in range(S)]
    out_shapes = jax.eval_shape(loss_fn, params, microbatch)
    self.aux_tree = jax.tree.structure(out_shapes[1]) if has_aux else None
    loss_dtype = jax.tree.leaves(out_shapes)[0].dtype
    self.loss_aval = jax.ShapeDtypeStruct((), loss_dtype)
    last = self.part_stage[-1]
    self._last_mesh = stages[last].mesh
    self._combine = steps.partition(lambda ls, w: jnp.sum(jnp.stack(ls) * w), stages[last].mesh,
                                    (None, P()), P())
    M = schedule.num_microbatches
    self._uniform = jax.device_put(np.full((M,), 1.0 / M, np.float32), NamedSharding(
        self._last_mesh, P())) if local[last] else None
    self._seeds = steps.partition(lambda w: tuple(w[m].astype(loss_dtype) for m in range(M)),
                                  self._last_mesh,
                                  (P(),), P())
    self.runner = Runner(self)
    self._mb_index = [[jax.device_put(np.int32(m), NamedSharding(st.mesh, P()))
                       for m in range(M)] if local[s] else None for s, st in enumerate(stages)]

  # ---- building -------------------------------------------------------------------------

  def _stage_keys(self) -> list[tuple[str, ...]]:
    keys = [set() for _ in range(self.schedule.num_stages)]
    for st in self.staged.stages:
      keys[self.part_stage[st.index]].update(
          self.paths[i] for i in st.arg_leaves if i < self.num_params)
    keys[0].update(set(self.paths) - set().union(*keys))  # unused leaves: stage 0
    return [tuple(k for k in self.paths if k in ks) for ks in keys]

  def _traced_on_stage(self, v: int) -> split_lib.Stage:
    """Part v traced under its stage's submesh, so the model's activation sharding
    constraints (split-dims mappings) apply inside the stage; the same cut as `staged`."""
    s = self.part_stage[v]
    if s not in self._under_mesh:
      with jax.set_mesh(self.stages[s].mesh):
        self._under_mesh[s] = split_lib.split(*self._split_args)
    got, want = self._under_mesh[s].stages[v], self.staged.stages[v]
    if (got.arg_leaves, got.incoming, got.outgoing) != (want.arg_leaves, want.incoming,
                                                        want.outgoing):
      raise ValueError(f"Part {v} traced under stage {s}'s submesh is cut differently "
                       "than without a mesh; keep sharding constraints off stage boundaries.")
    return got

  def sharding(self, stage: int, key: str) -> NamedSharding:
    spec = self.param_specs[stage][self.paths.index(key)]
    return NamedSharding(self.stages[stage].mesh, spec)

  def _zeros_program(self, stage: int) -> steps.Partitioned:
    """`() -> zeros` for the stage's params: the gradient accumulators of one step."""
    keys = self.stage_keys[stage]
    shapes = dict(zip(self.paths, self.param_shapes))
    specs = tuple(self.param_specs[stage][self.paths.index(k)] for k in keys)
    return steps.partition(lambda: tuple(jnp.zeros(shapes[k].shape, shapes[k].dtype)
                                         for k in keys), self.stages[stage].mesh, (), specs)

  def _build_part(self, v: int) -> Part:
    st, s = self._traced_on_stage(v), self.part_stage[v]
    spec = self.stages[s]
    last = v == self.staged.num_stages - 1
    pleaves = [i for i in st.arg_leaves if i < self.num_params]
    bleaves = tuple(i - self.num_params for i in st.arg_leaves if i >= self.num_params)
    aval = lambda i: self.values[i].aval
    float_in = tuple(i for i in st.incoming if is_float(aval(i)))
    int_in = tuple(i for i in st.incoming if not is_float(aval(i)))
    float_out = tuple(i for i in st.outgoing if is_float(aval(i)))
    int_out = tuple(i for i in st.outgoing if not is_float(aval(i)))

    def part_fn(p, batch, m, fin, iin):
      mb = [jax.lax.dynamic_index_in_dim(b, m, keepdims=False) for b in batch]
      fin, iin = constrain(fin, float_in), constrain(iin, int_in)
      have = dict(zip(float_in + int_in, fin + iin))
      outs = st(list(p) + mb, [have[i] for i in st.incoming])
      if last:
        return (outs[0],), tuple(outs[1:])
      got = dict(zip(st.outgoing, outs))
      return tuple(got[i] for i in float_out), tuple(got[i] for i in int_out)

    fwd, bwd = jax.fwd_and_bwd(part_fn, argnums=(0, 3), has_aux=True, jitted=False)

    def bwd_acc(res, cot, acc):
      d_params, d_in = bwd(res, cot if last else constrain(cot, float_out))
      return tuple(a + g for a, g in zip(acc, d_params)), d_in

    pspecs = tuple(self.param_specs[s][i] for i in pleaves)
    bspecs = tuple(P(None, *self.batch_specs[s][j]) for j in bleaves)
    act = lambda ids: tuple(spec.spec_for(aval(i)) for i in ids)

    def constrain(xs, ids):  # values arrive in their sender's layout (see `_send`)
      return tuple(jax.lax.with_sharding_constraint(x, NamedSharding(spec.mesh, sp))
                   for x, sp in zip(xs, act(ids)))

    split_progs = {}
    if v in self._split_parts:
      args = ([self.param_shapes[i] for i in pleaves], [self.batch_avals[j] for j in bleaves],
              jax.ShapeDtypeStruct((), jnp.int32), [aval(i) for i in float_in],
              [aval(i) for i in int_in])
      split_progs = split_backward(fwd, bwd, args,
                                    (lambda c: c) if last else lambda c: constrain(c, float_out),
                                    spec.mesh, pspecs, act(float_in))
    out_specs = (((P(),), None, None) if last else
                 (act(float_out), None, act(int_out)))
    fwd_p = steps.partition(fwd, spec.mesh, (pspecs, bspecs, P(), None, None), out_specs)
    bwd_p = steps.partition(bwd_acc, spec.mesh, (None, (P(),) if last else None, pspecs),
                            (pspecs, act(float_in)), donate_argnums=(2,))
    return Part(v, s, tuple(self.paths[i] for i in pleaves), bleaves, float_in, int_in,
                float_out, int_out, fwd_p, bwd_p, **split_progs)

  # ---- placing params -------------------------------------------------------------------

  def place(self, params) -> tuple[dict, ...]:
    """Full params tree -> per stage {path: array on the stage's submesh}."""
    flat = dict(zip(self.paths, jax.tree.leaves(params)))
    return tuple({k: jax.device_put(flat[k], self.sharding(s, k)) for k in keys}
                 if self.cross.local[s] else None for s, keys in enumerate(self.stage_keys))

  def gather(self, stage_params: Sequence[dict]):
    """Per-stage params -> the full params tree (a tied leaf from its first stage)."""
    first = {}
    for sp in stage_params:
      for k, x in (sp or {}).items():
        first.setdefault(k, x)
    return jax.tree.unflatten(self.params_tree, [first[k] for k in self.paths])

  # ---- running (mpmd_run.Runner) ---------------------------------------------------------

  def run(self, stage_params: Sequence[dict], batch, weights=None) -> RunResult:
    """Forward and backward of every microbatch, in schedule order (module doc)."""
    return self.runner.run(stage_params, batch, weights)

  def forward(self, stage_params: Sequence[dict], batch) -> tuple[tuple, tuple]:
    """Forward only (e.g. eval): per microbatch, the loss and aux on the last stage."""
    return self.runner.forward(stage_params, batch)

  def backward_flops(self, stage_params: Sequence[dict], batch) -> dict[int, tuple]:
    """Compiled FLOPs of B, I and W per part the schedule splits (Runner.backward_flops)."""
    return backward_flops(self.runner, stage_params, batch)
