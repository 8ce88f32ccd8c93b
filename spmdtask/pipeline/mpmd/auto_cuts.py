"""`task.pipeline.layer_cuts="auto"`: MPMD cuts from compiled per-layer costs.

`measure` prices every layer on every stage: the model's own loss is traced under the
probe cuts `(1, L-1)`, split at the stage boundaries as the pipeline splits it, and each
of its three parts is compiled as the pipeline compiles it (`jax.fwd_and_bwd`: a forward
program that keeps residuals and a backward program, which recomputes what remat
dropped), one microbatch, with the stage's shardings on its submesh (the model's
activation constraints apply there): part 0 (embedding + layer 0), part 1 (layers
1..L-2 in one scan: the layers are identical; its cost / (L-2) is a layer's) and part 2
(layer L-1 + head and loss). Their per-device FLOPs, forward + backward
(`xla_cost.per_step`: loop bodies counted per trip), fill the table `cost[s][l]`,
embedding folded into layer 0 and head into layer L-1 (fewer than 3 layers: a part per
layer). Submeshes of the same shape share one measurement, so a job compiles six small
programs per distinct submesh shape.

`resolve` turns "auto" into the cuts of `balance.balance_table(cost)` (the slowest stage
as fast as possible; ties: early stages shorter) for `stages.plan`, whose cuts the program
uses everywhere after. `CutCosts` gives each stage's cost next to the
slowest: in the start summary with "auto" (measured anyway) and in every MPMD plan; hand-set
cuts are measured only when the plan asks, so that starting a job costs no extra compiles.

Several parts per stage (num_chunks > 1) are not balanced: "auto" needs num_chunks=1
(the parts of a stage are not contiguous layers); hand-set chunked cuts still get their
stage costs (`balance.stage_loads` over `schedule.owner`).
"""
import dataclasses
import functools
from typing import Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core import mesh as mesh_lib, sharding, steps, train_state
from spmdtask.plan import xla_cost
from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import balance
from spmdtask.pipeline.mpmd import split as split_lib
from spmdtask.pipeline.mpmd.parts import StageSpec, is_float

_PL = "task.pipeline."


@dataclasses.dataclass(frozen=True)
class CutCosts:
  """The stages' costs under `cuts`: `table[s][l]` is layer l's per-device train FLOPs
  (forward + backward of one microbatch) on stage s's submesh, embedding in layer 0, head
  and loss in layer L-1; part v runs on stage `part_stage[v]`."""
  table: tuple[tuple[float, ...], ...]
  cuts: tuple[int, ...]
  part_stage: tuple[int, ...]
  auto: bool  # the cuts were chosen here ("auto") rather than set by hand

  @property
  def loads(self) -> tuple[float, ...]:
    return balance.stage_loads(self.table, self.cuts, self.part_stage)

  @property
  def ratios(self) -> tuple[float, ...]:
    """Each stage's cost relative to the slowest stage's (1.0 for the slowest)."""
    top = max(self.loads)
    return tuple(x / top if top else 1.0 for x in self.loads)

  def line(self) -> str:
    how = "chosen by layer_cuts='auto'" if self.auto else "set by hand"
    return (f"  layer_cuts {self.cuts} ({how}); stage cost per microbatch (compiled train "
            f"FLOPs per device): " + ", ".join(f"{x:.3g}" for x in self.loads)
            + "; relative to the slowest: " + ", ".join(f"{r:.2f}" for r in self.ratios))


def check(config, num_layers: int) -> None:
  """ConfigError unless "auto" can cut `num_layers` layers for `config`'s stages."""
  if config.num_chunks != 1:
    raise ConfigError(
        f"{_PL}layer_cuts='auto' with {_PL}num_chunks={config.num_chunks}: auto balances one "
        f"contiguous part per stage. Set {_PL}num_chunks=1, or give the "
        f"{config.num_stages * config.num_chunks - 1} layer_cuts by hand.")
  if num_layers < config.num_stages:
    raise ConfigError(
        f"{_PL}layer_cuts='auto' cannot cut {num_layers} layers into {config.num_stages} "
        f"stages ({_PL}submesh_shapes): every stage needs a layer; use fewer stages.")


class LazyCosts:
  """`costs()`: the CutCosts, measured on the first call; `costs(measure=False)`: them if
  measured already (always with "auto"), else None."""

  def __init__(self, measure: Callable[[], CutCosts], measured: bool):
    self._measure, self._value = measure, measure() if measured else None

  def __call__(self, measure: bool = True) -> CutCosts | None:
    if self._value is None and measure:
      self._value = self._measure()
    return self._value


def resolve(task, canonical_model, config, meshes, micro, batch_split,
            part_stage: tuple[int, ...], auto: bool) -> tuple[tuple[int, ...], LazyCosts]:
  """(the cuts, their LazyCosts). `auto`: the cuts that balance the measured costs
  (`balance.balance_table`, module doc), measured now; else `config`'s cuts, measured when
  first asked (the plan)."""
  measured = functools.cache(lambda: measure(task, canonical_model, config, meshes, micro,
                                             batch_split))
  cuts = balance.balance_table(measured()).cuts if auto else tuple(config.layer_cuts)
  return cuts, LazyCosts(lambda: CutCosts(measured(), cuts, part_stage, auto), auto)


def measure(task, canonical_model, config, meshes, micro,
            batch_split) -> tuple[tuple[float, ...], ...]:
  """cost[s][l] (module doc): per-device train FLOPs of layer l on stage s's submesh
  (`canonical_model`: the task's model unpipelined)."""
  L = canonical_model.num_layers
  probe_cuts = tuple(sorted({1, L - 1} - {0, L}))  # layer 0 | layers 1..L-2 | layer L-1
  model = canonical_model.with_pipeline(dataclasses.replace(config, layer_cuts=probe_cuts))
  init_batch = jax.tree.map(lambda x: np.zeros((1,) + x.shape[1:], x.dtype), micro)
  live = train_state.layout(model, optax.identity(), init_batch, mesh_lib.mesh_shape(meshes[0]))
  by_shape, table = {}, []
  for mesh in meshes:
    key = tuple(mesh.devices.shape)
    if key not in by_shape:
      ms = mesh_lib.mesh_shape(mesh)
      spec = StageSpec(mesh, sharding.even_splits(live.logical.params, live.split.params, ms),
                       sharding.even_splits(micro, batch_split, ms),
                       P(task.batch_axes() or None))
      by_shape[key] = _layer_row(_part_flops(model, live.logical.params, micro, spec), L)
    table.append(by_shape[key])
  return tuple(table)


def _layer_row(parts: list[float], L: int) -> tuple[float, ...]:
  """Per-layer costs from the probe parts' costs (module doc): part 0 for layer 0 (with
  the embedding), part 1 / (L - 2) for each middle layer, the last part for layer L-1
  (with the head and loss); with fewer than 3 layers a part is a layer."""
  if L < 3:
    return tuple(parts)
  mid = parts[1] / (L - 2)
  return tuple(parts[0] if l == 0 else parts[2] if l == L - 1 else mid for l in range(L))


def _part_flops(model, params, micro, spec: StageSpec) -> list[float]:
  """Per part of `model`'s loss: the per-device FLOPs of its forward + backward on
  `spec.mesh` (one microbatch)."""
  def loss_fn(p, mb):  # microbatch m's loss sum, as the pipeline's loss
    loss, metrics = model.apply({"params": p}, mb, method=model.loss)
    return loss * jax.lax.stop_gradient(metrics["loss"].weight), metrics

  with jax.set_mesh(spec.mesh):
    staged = split_lib.split(loss_fn, params, micro)
  flat_p, flat_b = jax.tree.leaves(params), jax.tree.leaves(micro)
  pspecs = jax.tree.leaves(spec.param_specs, is_leaf=lambda x: isinstance(x, P))
  bspecs = jax.tree.leaves(spec.batch_specs, is_leaf=lambda x: isinstance(x, P))
  n = len(flat_p)
  out = []
  for v in range(staged.num_stages):
    st, last = staged.stages[v], v == staged.num_stages - 1
    pl = [i for i in st.arg_leaves if i < n]
    bl = [i - n for i in st.arg_leaves if i >= n]
    aval = lambda i: staged.values[i].aval
    fin = tuple(i for i in st.incoming if is_float(aval(i)))
    iin = tuple(i for i in st.incoming if not is_float(aval(i)))
    fout = tuple(i for i in st.outgoing if is_float(aval(i)))

    def part_fn(p, b, xs, ys, st=st, last=last, fin=fin, iin=iin, fout=fout):
      have = dict(zip(fin + iin, tuple(xs) + tuple(ys)))
      outs = st(list(p) + list(b), [have[i] for i in st.incoming])
      if last:
        return (outs[0],), ()
      got = dict(zip(st.outgoing, outs))
      return tuple(got[i] for i in fout), ()

    # The pipeline's own split: a forward program keeping residuals, a backward program.
    fwd, bwd = jax.fwd_and_bwd(part_fn, argnums=(0, 2), has_aux=True, jitted=False)
    avals = ([flat_p[i] for i in pl], [flat_b[j] for j in bl], [aval(i) for i in fin],
             [aval(i) for i in iin])
    in_specs = ([pspecs[i] for i in pl], [bspecs[j] for j in bl],
                [spec.spec_for(aval(i)) for i in fin], [spec.spec_for(aval(i)) for i in iin])
    fwd_p = steps.partition(fwd, spec.mesh, in_specs, None)
    res = fwd_p.jitted.eval_shape(*avals)[1]
    put = lambda a, sp: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                             sharding=NamedSharding(spec.mesh, sp))
    cot = ((put(st.jaxpr.out_avals[0], P()),) if last else
           tuple(put(aval(i), spec.spec_for(aval(i))) for i in fout))
    flops = 0.0
    for lowered in (fwd_p.lower(*avals), steps.partition(bwd, spec.mesh, (None, None), None)
                    .lower(res, cot)):
      flops += float(xla_cost.per_step(lowered.compile().as_text())["flops"])
    out.append(flops)
  return out
