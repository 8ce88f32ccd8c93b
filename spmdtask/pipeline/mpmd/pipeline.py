"""MPMD pipeline: one program per stage on its own submesh, run by a schedule.

`Pipeline(loss_fn, params, microbatch, stages, schedule)` splits `loss_fn(params, batch)`
at its `stage_boundary` markers into `num_stages * num_chunks` parts (see split.py) and
jits, for every part on the submesh of the stage that runs it (schedule.virtual_stage):

  fwd(params, batch[M, ...], m, incoming) -> (outgoing, residuals)    jax.fwd_and_bwd
  bwd(residuals, d_outgoing, grad_acc) -> (grad_acc + d_params, d_incoming)   acc donated

through `steps.partition` (mpmd.programs). With `rows_are_sums` (the loss and aux are sums
over the microbatch's rows, as the MPMD program's are), a stage whose submesh splits the rows
over data-parallel axes runs its parts per device on them and keeps grad_acc as per-device
partial sums `[D, ...]`, reduced once after the step's last backward (mpmd.local): one
data-parallel reduction per step instead of one per microbatch. `run` walks the schedule in one Python process, dispatching
asynchronously (no host sync inside a step), in `order`: one execution order consistent
with every stage's list and the split's value dependencies (mpmd.parts.execution_order,
the validator's and simulator's engine); `mpmd.runner.Runner` holds the dispatch table of
F / B / I / W and measures the residual bytes each stage holds.

I and W (zero-bubble schedules such as zb_h1) are B cut in two by `backward_split`: I
computes only what the input cotangents need and stashes the per-layer output cotangents
(with the layer inputs W reads from the residuals); W turns them into weight grads without
recomputing anything, so FLOPs(I) + FLOPs(W) = FLOPs(B).

Memory: F(m, c) makes one activation set (residuals) and B or I releases it; I to W holds
the smaller weight-grad stash. `RunResult` reports per stage the peak count and the peak
measured bytes of both (see mpmd.runner).

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
that point (mpmd.transfers.Cross.move). Results then exist only where their stage does: `run`
gives None for the loss, aux and grads of stages this process does not own.
"""
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core import steps
from spmdtask.errors import ConfigError
from spmdtask.pipeline.mpmd import transfers, local as mpmd_local, programs
from spmdtask.pipeline.mpmd.compiled import backward_flops, compiled_backward
from spmdtask.pipeline.mpmd.runner import Runner
from spmdtask.pipeline.mpmd import split as split_lib
from spmdtask.pipeline.mpmd.parts import (RunResult, StageSpec, check_meshes, flat_specs,
                                          execution_order, fused_part, is_float)
from spmdtask.pipeline.schedules.schedule import Schedule


class Pipeline:
  """A loss function cut into stages on submeshes, and a schedule to run it (module doc)."""

  def __init__(self, loss_fn: Callable, params, microbatch, stages: Sequence[StageSpec],
               schedule: Schedule, has_aux: bool = False, rows_are_sums: bool = False,
               compile_only: bool = False):
    self.stages, self.schedule, self.has_aux = tuple(stages), schedule, has_aux
    S, V = schedule.num_stages, schedule.num_chunks
    check_meshes(self.stages, S)
    self.cross = transfers.Cross([st.mesh for st in self.stages], compile_only)
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
    self.split_parts = {schedule.virtual_stage(s, a.chunk)
                         for s, row in enumerate(schedule.actions) for a in row if a.kind == "I"}
    self.dp = [()] * S
    for s in range(S):
      self.dp[s] = self._dp_axes(s, rows_are_sums)
    self.fused = fused_part(schedule)
    self.parts = tuple(programs.build_part(self, v) for v in range(S * V))
    self.acc = [mpmd_local.Accumulators(self.stages[s].mesh, self.dp[s], {
        k: self.param_shapes[self.paths.index(k)] for k in self.stage_keys[s]}, [
            self.param_specs[s][self.paths.index(k)] for k in self.stage_keys[s]])
                for s in range(S)]
    self.tied = {k: tuple(s for s in range(S) if k in self.stage_keys[s])
                 for k in self.paths if sum(k in ks for ks in self.stage_keys) > 1}
    self.order = execution_order(schedule, self.parts, self.values)
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

  def traced_on_stage(self, v: int) -> split_lib.Stage:
    """Part v traced under its stage's submesh, so the model's activation sharding
    constraints (split-dims mappings) apply inside the stage; the same cut as `staged`.
    With per-device accumulation (`dp`), traced on one device's rows inside the stage's
    manual context (mpmd.local)."""
    s = self.part_stage[v]
    if s not in self._under_mesh:
      mesh, dp = self.stages[s].mesh, self.dp[s]
      if dp:
        loss_fn, params, micro = self._split_args
        n = mpmd_local.size(mesh, dp)
        micro = jax.tree.unflatten(self.batch_tree, [
            jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]) if split else x.shape, x.dtype)
            for x, split in zip(jax.tree.leaves(micro), self.rows_split(s))])
        self._under_mesh[s] = mpmd_local.trace_local(
            lambda: split_lib.split(loss_fn, params, micro), mesh, dp)
      else:
        with jax.set_mesh(mesh):
          self._under_mesh[s] = split_lib.split(*self._split_args)
    got, want = self._under_mesh[s].stages[v], self.staged.stages[v]
    if (got.arg_leaves, got.incoming, got.outgoing) != (want.arg_leaves, want.incoming,
                                                        want.outgoing):
      raise ValueError(f"Part {v} traced under stage {s}'s submesh is cut differently "
                       "than without a mesh; keep sharding constraints off stage boundaries.")
    return got

  def rows_split(self, s: int) -> list[bool]:
    """Per batch leaf: whether stage s splits its rows (a dim-0 entry in its spec)."""
    return [len(sp) > 0 and sp[0] is not None for sp in self.batch_specs[s]]

  def _dp_axes(self, s: int, rows_are_sums: bool) -> tuple[str, ...]:
    """Stage s's per-device accumulation axes (mpmd.local.dp_axes), () if none. The
    candidates split the rows of every row-split batch leaf; they hold if, traced on one
    device's rows, every differentiable value between parts keeps its rows split (a
    replicated float would need its cotangent summed over the devices)."""
    if not rows_are_sums:
      return ()
    spec = self.stages[s]
    rows = [sp for sp, split in zip(self.batch_specs[s], self.rows_split(s)) if split]
    dp = mpmd_local.dp_axes(spec.mesh, rows, self.param_specs[s])
    if not dp:
      return ()
    self.dp[s] = dp
    self.traced_on_stage(next(v for v in range(len(self.part_stage)) if self.part_stage[v] == s))
    if all(self.row_split(s, i) for st in self.staged.stages if self.part_stage[st.index] == s
           for i in st.incoming + st.outgoing if is_float(self.values[i].aval)):
      return dp
    self._under_mesh.pop(s)
    return ()

  def row_split(self, s: int, value: int) -> bool:
    """Whether value's rows are split over stage s's dp axes (its local trace has fewer)."""
    full, here = self.values[value].aval, self._under_mesh[s].values[value].aval
    return bool(full.shape) and here.shape[0] != full.shape[0]

  def sharding(self, stage: int, key: str) -> NamedSharding:
    spec = self.param_specs[stage][self.paths.index(key)]
    return NamedSharding(self.stages[stage].mesh, spec)

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

  # ---- running (mpmd.runner.Runner) ---------------------------------------------------------

  def run(self, stage_params: Sequence[dict], batch, weights=None) -> RunResult:
    """Forward and backward of every microbatch, in schedule order (module doc)."""
    return self.runner.run(stage_params, batch, weights)

  def forward(self, stage_params: Sequence[dict], batch) -> tuple[tuple, tuple]:
    """Forward only (e.g. eval): per microbatch, the loss and aux on the last stage."""
    return self.runner.forward(stage_params, batch)

  def compiled_backward(self, stage_params: Sequence[dict], batch) -> dict:
    """Every part's compiled backward programs and each stage's reduction
    (mpmd.compiled.compiled_backward)."""
    return compiled_backward(self.runner, stage_params, batch)

  def backward_flops(self, stage_params: Sequence[dict], batch) -> dict[int, tuple]:
    """Compiled FLOPs of B, I and W per part the schedule splits (mpmd.compiled.backward_flops)."""
    return backward_flops(self.runner, stage_params, batch)
