"""Runs an MPMD `Pipeline`'s schedule: one pass of F / B / I / W actions in the pipeline's
one execution order (`schedule.execution_order` under the value dependencies of the split),
each kind dispatched by one table (`Runner.run`), the arrays moved between stages.

F(m, c): outgoing, res[m, c] = fwd(...); each outgoing value goes to the sharding of every
         part that consumes it (directly, producer -> consumer)
B(m, c): grad_acc, d_in = bwd(res.pop(m, c), sum of d_outgoing from its consumers,
         grad_acc); each d_in goes back to its producer
I(m, c): d_in, stash[m, c] = input_grad(res.pop(m, c), d_outgoing); d_in sent as for B
W(m, c): grad_acc = weight_grad(stash.pop(m, c), grad_acc)     acc donated
Where the schedule always runs the last part's B (or I) right after its F, both run as one
program at F's turn (`Part.fused`): one dispatch, and the residuals stay inside it.

Memory is measured, not counted from the schedule: after every action the runner sums
the bytes of the residual arrays (and W stashes) it holds per stage, from the arrays'
shards on that stage's devices (once per part: every microbatch's set has the same
arrays), and reports each stage's peak (`RunResult`); the number of sets held is
reported beside it (a fused part's set counts, with 0 bytes held between dispatches).
`simulate.peak_bytes` predicts the same peaks from the schedule and one set's bytes per
part.
"""
import dataclasses
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask.errors import ConfigError
from spmdtask.pipeline.mpmd import transfers
from spmdtask.pipeline.mpmd.parts import Part, RunResult, kept_inputs


def held_bytes(tree) -> int:
  """Bytes of `tree`'s arrays on this process's devices (0 for None: another process's)."""
  return sum(sh.data.nbytes for x in jax.tree.leaves(tree) for sh in x.addressable_shards)


class Meter:
  """Per stage: residual sets and W stashes held, in count and measured bytes, and peaks.

  A part's residuals (or stash) have the same arrays' shapes and shardings for every
  microbatch and step (one program makes them), so their bytes are measured once per
  part and kept in `measured`, shared across passes: summing shards per array on every
  action was most of the host's time per action."""

  def __init__(self, num_stages: int, num_parts: int, measured: dict):
    z = lambda: [0] * num_stages
    self.sets, self.peak_sets, self.stashes, self.peak_stashes = z(), z(), z(), z()
    self.bytes, self.peak_bytes, self.stash_bytes, self.peak_stash_bytes = z(), z(), z(), z()
    self.set_bytes = [None] * num_parts  # one F's residual bytes, per part
    self._of, self._measured = {}, measured

  def hold(self, s: int, key, tree, stash: bool = False) -> None:
    if tree is None:  # another process's stage
      n = 0
    else:
      n = self._measured.get((key[0], stash))
      if n is None:
        n = self._measured[key[0], stash] = held_bytes(tree)
    self._of[key, stash] = n
    if stash:
      self.stashes[s] += 1
      self.stash_bytes[s] += n
      self.peak_stashes[s] = max(self.peak_stashes[s], self.stashes[s])
      self.peak_stash_bytes[s] = max(self.peak_stash_bytes[s], self.stash_bytes[s])
      return
    if self.set_bytes[key[0]] is None:
      self.set_bytes[key[0]] = n
    self.sets[s] += 1
    self.bytes[s] += n
    self.peak_sets[s] = max(self.peak_sets[s], self.sets[s])
    self.peak_bytes[s] = max(self.peak_bytes[s], self.bytes[s])

  def release(self, s: int, key, stash: bool = False) -> None:
    n = self._of.pop((key, stash))
    if stash:
      self.stashes[s] -= 1
      self.stash_bytes[s] -= n
    else:
      self.sets[s] -= 1
      self.bytes[s] -= n


@dataclasses.dataclass
class _Pass:
  """The state of one pass of the schedule."""
  stage_params: Sequence[dict]
  batches: list
  seeds: tuple | None
  acc: list
  meter: Meter
  losses: list
  aux: list
  inbox: dict = dataclasses.field(default_factory=dict)
  cots: dict = dataclasses.field(default_factory=dict)
  res: dict = dataclasses.field(default_factory=dict)
  stash: dict = dataclasses.field(default_factory=dict)


class Runner:
  """Walks a Pipeline's schedule (module doc)."""

  def __init__(self, pipeline):
    self.pl = pipeline
    self._send, self._measured, self._seeds = Sends(pipeline), {}, (None, None)
    self._dispatch = {"F": self._f, "B": self._b, "I": self._i, "W": self._w}

  def run(self, stage_params: Sequence[dict], batch, weights=None) -> RunResult:
    """Forward and backward of every microbatch, in the execution order."""
    pl = self.pl
    S, M = pl.schedule.num_stages, pl.schedule.num_microbatches
    local, last = pl.cross.local, pl.part_stage[-1]
    w = seeds = None
    if local[last]:
      w = pl._uniform if weights is None else jax.device_put(  # pylint: disable=protected-access
          weights, NamedSharding(pl._last_mesh, P()))  # pylint: disable=protected-access
      if w is not self._seeds[0]:  # the same weights every step (uniform or ones): once
        self._seeds = (w, pl._seeds(w))  # pylint: disable=protected-access
      seeds = self._seeds[1]
    acc = [pl.acc[s].fresh() if local[s] else None
           for s in range(S)]
    p = _Pass(stage_params, stage_batches(pl, batch), seeds, acc,
              Meter(S, len(pl.parts), self._measured),
              [None] * M, [None] * M)
    for s, a in pl.order:
      self._dispatch[a.kind](p, pl.parts[pl.schedule.virtual_stage(s, a.chunk)], a.microbatch)
    for s in range(S):  # the step's one data-parallel reduction per stage
      if local[s]:
        acc[s] = pl.acc[s].reduce(acc[s])
    sum_tied(pl, acc)
    mt = p.meter
    out = dict(grads=tuple(acc), peak_residuals=tuple(mt.peak_sets),
               peak_stash=tuple(mt.peak_stashes), num_chunks=pl.schedule.num_chunks,
               peak_residual_bytes=tuple(mt.peak_bytes), peak_stash_bytes=tuple(mt.peak_stash_bytes),
               residual_set_bytes=tuple(mt.set_bytes))
    if not local[last]:
      return RunResult(loss=None, aux=None, **out)
    return RunResult(loss=pl._combine(tuple(p.losses), w), aux=tuple(p.aux), **out)  # pylint: disable=protected-access

  # ---- the actions -----------------------------------------------------------------------

  def _f(self, p: _Pass, part: Part, m: int) -> None:
    if part.fused is not None and self.pl.cross.local[part.stage]:
      self._fused(p, part, m)
      return
    r = self.forward_part(part, m, p.stage_params, p.batches, p.inbox, p.losses, p.aux)
    p.res[part.index, m] = r
    p.meter.hold(part.stage, (part.index, m), r)

  def _fused(self, p: _Pass, part: Part, m: int) -> None:
    """F(m) and its B or I as one program (mpmd.parts.fused_part). The set is counted as
    held until the backward's turn, with no bytes: its residuals live inside the program.
    d_in is sent (and a stash kept) at the backward's turn in the order, where every
    process expects it."""
    args = self._fwd_args(part, m, p.stage_params, p.batches, p.inbox) + (
        self._cotangent(p, part, m),)
    if part.input_grad is None:
      outs, other, new, d_in = part.fused(*args, self._grads(p, part))
      p.acc[part.stage].update(zip(part.param_keys, new))
    else:
      outs, other, d_in, kept, st = part.fused(*args)
      p.stash[part.index, m] = (kept, st)
    self._loss(m, outs, other, p.losses, p.aux)
    p.res[part.index, m] = d_in
    p.meter.hold(part.stage, (part.index, m), ())

  def _cotangent(self, p: _Pass, part: Part, m: int) -> tuple:
    if part.index == len(self.pl.parts) - 1:
      return (p.seeds[m],)
    got = p.cots.pop((part.index, m))
    return tuple(got[i] for i in part.float_out)

  def _grads(self, p: _Pass, part: Part) -> tuple:
    return tuple(p.acc[part.stage][k] for k in part.param_keys)

  def _b(self, p: _Pass, part: Part, m: int) -> None:
    r = p.res.pop((part.index, m))
    p.meter.release(part.stage, (part.index, m))
    if not self.pl.cross.local[part.stage]:  # another process runs it: take what we need
      self._send_cotangents(part, m, (None,) * len(part.float_in), p.cots)
      return
    if part.fused is not None:  # ran with its F: r is d_in
      self._send_cotangents(part, m, r, p.cots)
      return
    new, d_in = part.bwd(r, self._cotangent(p, part, m), self._grads(p, part))
    p.acc[part.stage].update(zip(part.param_keys, new))
    self._send_cotangents(part, m, d_in, p.cots)

  def _i(self, p: _Pass, part: Part, m: int) -> None:
    """I: the activation set is released here; what W needs goes to its stash."""
    r = p.res.pop((part.index, m))
    p.meter.release(part.stage, (part.index, m))
    if not self.pl.cross.local[part.stage]:
      p.meter.hold(part.stage, (part.index, m), None, stash=True)
      self._send_cotangents(part, m, (None,) * len(part.float_in), p.cots)
      return
    if part.fused is not None:  # ran with its F: r is d_in, the stash is kept
      d_in = r
    else:
      cot = self._cotangent(p, part, m)
      d_in, st = part.input_grad(r, cot)
      p.stash[part.index, m] = (kept_inputs(r, cot, part.kept), st)
    p.meter.hold(part.stage, (part.index, m), p.stash[part.index, m], stash=True)
    self._send_cotangents(part, m, d_in, p.cots)

  def _w(self, p: _Pass, part: Part, m: int) -> None:
    p.meter.release(part.stage, (part.index, m), stash=True)
    if self.pl.cross.local[part.stage]:
      kept, st = p.stash.pop((part.index, m))
      p.acc[part.stage].update(zip(part.param_keys,
                                   part.weight_grad(kept, st, self._grads(p, part))))

  # ---- moving arrays ---------------------------------------------------------------------

  def _send_cotangents(self, part: Part, m: int, d_in, cots) -> None:
    """B(m) of `part` made d_in (None where another process ran it): each goes to the
    part that produced the value; cotangents of a value sent to several parts add up."""
    src = [self.pl.parts[self.pl.values[i].producer] for i in part.float_in]
    got = self._send(d_in, part.float_in, part.stage, [p.stage for p in src])
    for i, p, g in zip(part.float_in, src, got):
      if g is None:
        continue
      box = cots.setdefault((p.index, m), {})
      if i in box:
        g = box[i] + jax.device_put(g, box[i].sharding)
      box[i] = g


  def _fwd_args(self, part: Part, m: int, stage_params, batches, inbox) -> tuple:
    s = part.stage
    box = inbox.pop((part.index, m), {})
    return (tuple(stage_params[s][k] for k in part.param_keys),
            tuple(batches[s][j] for j in part.batch_leaves), self.pl._mb_index[s][m],  # pylint: disable=protected-access
            tuple(box[i] for i in part.float_in), tuple(box[i] for i in part.int_in))

  def _loss(self, m: int, outs, other, losses, aux) -> None:
    losses[m] = outs[0]
    aux[m] = jax.tree.unflatten(self.pl.aux_tree, other) if self.pl.has_aux else None

  def forward_part(self, part: Part, m: int, stage_params, batches, inbox, losses, aux):
    """Runs F(m) of `part`, sends its outputs on; the last part's loss and aux go to
    losses[m], aux[m]. Returns the residuals."""
    if not self.pl.cross.local[part.stage]:  # another process runs it: receive what we need
      inbox.pop((part.index, m), None)
      if part.index < len(self.pl.parts) - 1:
        self._send_outputs(part, m, (None,) * len(part.float_out + part.int_out), inbox)
      return None
    outs, r, other = part.fwd(*self._fwd_args(part, m, stage_params, batches, inbox))
    if part.index == len(self.pl.parts) - 1:
      self._loss(m, outs, other, losses, aux)
      return r
    self._send_outputs(part, m, outs + other, inbox)
    return r


  def _send_outputs(self, part: Part, m: int, outs, inbox) -> None:
    """F(m) of `part` made `outs` (None where another process ran it): to every consumer."""
    ids = part.float_out + part.int_out
    to = [(i, x, c) for i, x in zip(ids, outs) for c in self.pl.values[i].consumers]
    got = self._send([x for _, x, _ in to], [i for i, _, _ in to], part.stage,
                     [self.pl.parts[c].stage for _, _, c in to])
    for (i, _, c), y in zip(to, got):
      if y is not None:
        inbox.setdefault((c, m), {})[i] = y


  def forward(self, stage_params: Sequence[dict], batch) -> tuple[tuple, tuple]:
    """Forward only (e.g. eval): per microbatch, the loss and aux on the last stage.

    Parts run in order for each microbatch; residuals are dropped as soon as they are made.
    """
    batches = stage_batches(self.pl, batch)
    M = self.pl.schedule.num_microbatches
    inbox, losses, aux = {}, [None] * M, [None] * M
    for m in range(M):
      for part in self.pl.parts:
        self.forward_part(part, m, stage_params, batches, inbox, losses, aux)
    return tuple(losses), tuple(aux)


class Sends:
  """A pipeline's arrays from one stage to others (`__call__`); the destination layouts
  are built once per (layout, shape, stage)."""

  def __init__(self, pipeline):
    self._pl, self._dsts = pipeline, {}

  def __call__(self, xs, values, src: int, stages) -> list:
    """xs[k] (value values[k] on stage src's submesh) -> the devices of stages[k],
    asynchronously; None where that stage is another process's.

    Across processes: a collective both call (mpmd.transfers.Cross.move), x's layout kept.

    Within the process, with equal device counts the copy keeps x's layout: the
    destination devices arranged as x's mesh, same PartitionSpec, so every shard is a
    device-to-device copy, and the action's copies go as one batch (mpmd.transfers.copy); the
    receiving program re-splits them with a sharding constraint. (A device_put straight
    to a layout whose shards x does not have goes through the host in jax 0.10 and blocks
    until x is ready.) Different device counts fall back to that device_put.
    """
    local = self._pl.cross.local
    out, fast, dsts = [None] * len(xs), [], []
    for k, (x, i, t) in enumerate(zip(xs, values, stages)):
      if not (local[src] and local[t]):
        aval = self._pl.values[i].aval
        out[k] = self._pl.cross.move(x, aval, self._pl.stages[src].spec_for(aval), src, t)
        continue
      if t == src:  # a part to the next chunk on the same stage: x as it is
        out[k] = x
        continue
      dst, same = self._mirror(x, t)
      if same:
        fast.append(k)
        dsts.append(dst)
      else:
        out[k] = jax.device_put(x, dst)
    if fast:
      for k, y in zip(fast, transfers.copy([xs[k] for k in fast], dsts)):
        out[k] = y
    return out

  def _mirror(self, x: jax.Array, stage: int) -> tuple[NamedSharding, bool]:
    """Where x goes on `stage` (`__call__`), and whether that is its own layout there; built
    once per (layout, shape, stage)."""
    key = (x.sharding, x.shape, stage)
    got = self._dsts.get(key)
    if got is None:
      src, st = x.sharding, self._pl.stages[stage]
      got = None
      if isinstance(src, NamedSharding) and src.mesh.size == st.mesh.size:
        dst = NamedSharding(Mesh(st.mesh.devices.reshape(src.mesh.devices.shape),
                                 src.mesh.axis_names, axis_types=src.mesh.axis_types), src.spec)
        got = (dst, True) if transfers.same_layout(src, dst) else None
      got = self._dsts[key] = got or (NamedSharding(st.mesh, st.spec_for(x.aval)), False)
    return got


def stage_batches(pl, batch) -> list[dict]:
  """The Pipeline `pl`'s batch per local stage: {batch leaf: [M, rows/M, ...] on its submesh} for the leaves it
  reads; `batch` may hold None for leaves no local stage reads (mpmd.feed)."""
  M = pl.schedule.num_microbatches
  try:
    leaves = pl.batch_tree.flatten_up_to(batch)
  except ValueError as e:
    raise ValueError(f"the batch does not have the tree the pipeline was built for: {e}"
                     ) from None
  out, todo = [dict() for _ in pl.stages], {}
  for part in pl.parts:
    s = part.stage
    for j in part.batch_leaves if pl.cross.local[s] else ():
      if (s, j) in todo:
        continue
      x = leaves[j]
      if x is None:
        raise ValueError(f"batch leaf {j} is read by stage {s} but was not fed to process "
                         f"{jax.process_index()} (Program.input_share)")
      if x.shape[0] % M:
        raise ConfigError(f"The batch (leaf {j}, {x.shape[0]} rows) does not split into "
                          f"schedule.num_microbatches={M} equal microbatches.")
      # Microbatch m = rows m, m + M, ... (as steps.microbatches splits for accumulation);
      # methods, so a host array stays on the host and a device array on its device.
      todo[s, j] = (x.reshape((x.shape[0] // M, M, *x.shape[1:])).swapaxes(0, 1),
                    NamedSharding(pl.stages[s].mesh, P(None, *pl.batch_specs[s][j])))
  if todo:  # one placement for every stage's leaves
    placed = jax.device_put([x for x, _ in todo.values()], [d for _, d in todo.values()])
    for (s, j), x in zip(todo, placed):
      out[s][j] = x
  return out


def sum_tied(pl, acc: list) -> None:
  """Each tied copy's gradient becomes the sum over the stages holding the leaf (a
  non-local stage's acc is None: its copy moves by collective)."""
  put, local = pl.cross.put, pl.cross.local
  for k, where in pl.tied.items():
    first = where[0]
    aval = pl.param_shapes[pl.paths.index(k)]
    spec = lambda s: pl.param_specs[s][pl.paths.index(k)]
    total = acc[first][k] if local[first] else None
    for s in where[1:]:
      g = put(acc[s][k] if local[s] else None, aval, s, first, spec(s), spec(first))
      if g is not None:
        total = total + g
    if local[first]:
      acc[first][k] = total
    for s in where[1:]:
      g = put(total, aval, first, s, spec(first), spec(s))
      if g is not None:
        acc[s][k] = g
