"""Pipeline parallelism over a `stage` mesh axis: GPipe and circular schedules.

A stack of L identical layers is split over S pipeline stages. Each stage holds its
weights only (the stage dim of every weight is sharded over the stage mesh axis), the
batch is split into M microbatches, and activations move from stage s to stage s+1 with
`jax.lax.ppermute`. With `circular_repeat` R > 1 each stage holds R non-contiguous
groups of layers and a microbatch loops R times around the ring of stages, which
shrinks the bubble from (S-1)/M to (S-1)/(M*R) of the useful work.

Weight layout: every leaf of `stage_params` has leading dims `[S, R, Lps, ...]`
(stage, repeat, layer-in-stage), and global layer `l = (r*S + s)*Lps + j`.
`to_stages` / `from_stages` convert from / to a plain scanned stack `[L, ...]`.

Only the stage axis is manual (`jax.shard_map(..., axis_names={stage})`); every other
mesh axis (data, fsdp, model, ...) stays automatic inside a stage, so the usual GSPMD
shardings of weights and activations keep working within each stage.
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmdtask.core import checks, spmd_program
from spmdtask.errors import ConfigError
from spmdtask.core import remat
from spmdtask.core.model import LayoutMap
from spmdtask.core.strategy import StackFacts

_PL = "task.pipeline."


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How to pipeline a layer stack.

  Attributes:
    num_stages: S, the number of pipeline stages; must equal the size of the
      `stage_axis` mesh axis.
    num_microbatches: M, the number of microbatches the batch is split into.
    microbatch_size: alternatively, the microbatch size (then M = batch // size).
      Set exactly one of `num_microbatches` and `microbatch_size`.
    circular_repeat: R, how many times a microbatch loops over the stages. R = 1 is
      GPipe. R > 1 requires M >= S (a ConfigError otherwise; M < S would leave
      stage 0 without work while it waits for its first microbatch to come back).
    remat_policy: a remat policy name (spmdtask.core.remat: a preset over the layers'
      named activations, or a `jax.checkpoint_policies` policy) applied to the work of
      one stage in one iteration, or None for no rematerialization.
    stage_axis: name of the mesh axis that holds the stages.
    unroll: fully unroll the iteration loop and the per-stage layer loop (for FLOP
      counting: `cost_analysis` counts a loop body once).
  """

  num_stages: int
  num_microbatches: int | None = None
  microbatch_size: int | None = None
  circular_repeat: int = 1
  remat_policy: str | None = "nothing_saveable"
  stage_axis: str = "stage"
  unroll: bool = False

  def resolve_num_microbatches(self, batch_size: int) -> int:
    """Returns M for a global batch of `batch_size` examples."""
    if self.num_microbatches is not None:
      return self.num_microbatches
    return batch_size // self.microbatch_size

  def num_iterations(self, batch_size: int) -> int:
    """Returns M*R + S - 1, the trip count of the pipeline loop."""
    m = self.resolve_num_microbatches(batch_size)
    return m * self.circular_repeat + self.num_stages - 1

  # ---- the execution-strategy contract (spmdtask.core.strategy.Strategy) ---------------------

  def validate(self, stack: StackFacts) -> None:
    validate(self, num_layers=stack.num_layers, batch_size=stack.batch_size, mesh=stack.mesh)

  def apply_stack(self, runner, x: jax.Array, side: tuple, keys) -> jax.Array:
    """Weights `[S, R, Lps, ...]` (stage dim over the stage axis), run by `pipeline_apply`;
    per-example side inputs and row ids are split into microbatches like `x`, each layer's
    dropout key goes with its weights."""
    s, r = self.num_stages, self.circular_repeat
    # vmap once per leading dim, the outermost mapped to the stage axis.
    stack = runner.block_cls
    for length, axis_name in ((runner.num_layers // (s * r), None), (r, None),
                              (s, self.stage_axis)):
      stack = nn.vmap(stack, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(None,) * (1 + len(side)), out_axes=0, axis_size=length,
                      metadata_params={nn.PARTITION_NAME: axis_name})
    stack = stack(**runner.block_kwargs, name="block")
    if runner.is_initializing():
      stack(x, *side)  # the stacked weights' shapes and splits; values come canonical
      return x
    params = nn.unbox(runner.variables["params"]["block"])
    layer = runner.block_fn()
    given = tuple(a is not None for a in side)

    def layer_fn(pk, h, *arrays):
      it = iter(arrays)
      return layer(pk[0], h, pk[1], *(next(it) if g else None for g in given))

    stage_keys = None if keys is None else to_stages(keys, s, r)
    return pipeline_apply(layer_fn, (params, stage_keys), x,
                          mesh=jax.sharding.get_abstract_mesh(), config=self,
                          microbatched_args=tuple(a for a in side if a is not None))

  def layout_maps(self, path) -> tuple[LayoutMap, ...]:
    s, r = self.num_stages, self.circular_repeat
    return (LayoutMap(tuple(path), from_stages, lambda tree: to_stages(tree, s, r)),)

  def build_program(self, task, example_local_batch, devices):
    return spmd_program.build(task, self, example_local_batch, devices)

  def facts(self) -> dict:
    return {"strategy": "spmd_pipeline", **dataclasses.asdict(self)}

  def summary(self) -> str:
    s, r = self.num_stages, self.circular_repeat
    m = self.num_microbatches or f"batch/{self.microbatch_size}"
    kind = "GPipe" if r == 1 else f"circular x{r}"
    bubble = (f"; bubble (S-1)/(M*R+S-1) = {(s - 1) / (m * r + s - 1):.1%}"
              if isinstance(m, int) else "")
    return (f"strategy SPMD pipeline ({kind}) over mesh axis '{self.stage_axis}': {s} stages, "
            f"{m} pipeline microbatches{bubble}")


def _fail(msg: str):
  raise ConfigError(" ".join(msg.split()))


def validate(config: PipelineConfig, *, num_layers: int, batch_size: int, mesh) -> None:
  """Checks `config` against the model, the batch and the mesh.

  Raises:
    ConfigError: with one paragraph naming the config field and the fix.
  """
  s, r = config.num_stages, config.circular_repeat
  if not isinstance(s, int) or s < 1:
    _fail(f"{_PL}num_stages={s!r} must be a positive integer.")
  if not isinstance(r, int) or r < 1:
    _fail(f"{_PL}circular_repeat={r!r} must be a positive integer (1 means GPipe).")
  if (config.num_microbatches is None) == (config.microbatch_size is None):
    _fail(
        f"Set exactly one of {_PL}num_microbatches and {_PL}microbatch_size "
        f"(got num_microbatches={config.num_microbatches!r}, "
        f"microbatch_size={config.microbatch_size!r})."
    )
  checks.remat_policy(f"{_PL}remat_policy", config.remat_policy)
  axes = tuple(mesh.axis_names)
  if config.stage_axis not in axes:
    _fail(
        f"The mesh has no '{config.stage_axis}' axis (task.mesh_axis_names={axes}), "
        f"but pipelining with {_PL}num_stages={s} needs one: add "
        f"'{config.stage_axis}' to task.mesh_axis_names with size {s} in "
        f"task.ici_mesh_shape."
    )
  size = mesh.shape[config.stage_axis]
  if size != s:
    _fail(
        f"The mesh axis '{config.stage_axis}' has size {size} "
        f"(mesh shape {dict(mesh.shape)}, set by task.ici_mesh_shape; "
        f"task.mesh_axis_names={axes}) but {_PL}num_stages={s}: make them equal."
    )
  if num_layers % (s * r):
    _fail(
        f"task.model.num_layers={num_layers} is not divisible by {_PL}num_stages={s} x "
        f"{_PL}circular_repeat={r} = {s * r}: change task.model.num_layers to a "
        f"multiple of {s * r} or pick num_stages/circular_repeat that divide it."
    )
  if config.num_microbatches is not None:
    m = config.num_microbatches
    if m < 1 or batch_size % m:
      _fail(
          f"The batch of {batch_size} examples cannot be split into "
          f"{_PL}num_microbatches={m} equal microbatches: use a divisor of "
          f"{batch_size}, or change the batch size."
      )
  else:
    mbs = config.microbatch_size
    if mbs < 1 or batch_size % mbs:
      _fail(
          f"The batch of {batch_size} examples is not a multiple of "
          f"{_PL}microbatch_size={mbs}: use a divisor of {batch_size}, or "
          f"change the batch size."
      )
    m = batch_size // mbs
  if r > 1 and m < s:
    _fail(
        f"Circular pipelining ({_PL}circular_repeat={r}) needs at least as many "
        f"microbatches as stages, got {m} microbatches for {_PL}num_stages={s}: "
        f"raise {_PL}num_microbatches to >= {s} (or lower "
        f"{_PL}microbatch_size), or set {_PL}circular_repeat=1."
    )


def to_stages(tree: Any, num_stages: int, circular_repeat: int = 1) -> Any:
  """Maps leaves `[L, ...]` (layer l at index l) to the layout `[S, R, Lps, ...]`."""
  s, r = num_stages, circular_repeat

  def f(a):
    if a.shape[0] % (s * r):
      _fail(
          f"model.num_layers={a.shape[0]} is not divisible by "
          f"{_PL}num_stages={s} x {_PL}circular_repeat={r}."
      )
    a = a.reshape((r, s, a.shape[0] // (s * r)) + a.shape[1:])
    return jnp.swapaxes(a, 0, 1)

  return jax.tree.map(f, tree)


def from_stages(tree: Any) -> Any:
  """Inverse of `to_stages`: maps leaves `[S, R, Lps, ...]` to `[L, ...]`."""
  return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[3:]), tree)


def stage_spec(layer_spec: P | tuple = (), stage_axis: str = "stage") -> P:
  """PartitionSpec of a `[S, R, Lps, ...]` weight whose per-layer spec is `layer_spec`."""
  return P(stage_axis, None, None, *tuple(layer_spec))


def pipeline_apply(
    layer_fn: Callable[..., jax.Array],
    stage_params: Any,
    x: jax.Array,
    *,
    mesh,
    config: PipelineConfig,
    broadcast_args: tuple = (),
    microbatched_args: tuple = (),
    _bubble_fill: float | None = None,
) -> jax.Array:
  """Applies L = S*R*Lps layers to `x`, pipelined over the stage mesh axis.

  Schedule (N = M*R + S - 1 iterations; every stage runs the same program; k is the
  index of the (repeat, microbatch) pair a stage works on, in stage-0 order):

      for t in range(N):                           # lax.scan, unrolled if config.unroll
        for every stage s in parallel:             # shard_map, manual over stage_axis
          k = t - s; valid = 0 <= k < M*R
          r, m = k // M, k % M                     # repeat and microbatch being worked on
          if R > 1:                                # stage 0: microbatches back from stage S-1
            ring[t % (M-S+1)] = cur                # wait M-S iterations in a ring buffer
          if s == 0:
            inp = x_mb[m] if r == 0 else ring[(t+1) % (M-S+1)]
          else:
            inp = cur                              # shifted in from stage s-1 last iteration
          inp = where(valid, inp, 0)               # bubbles compute on zeros, never garbage
          h = layers[s, r, 0..Lps-1](inp)          # remat'd inner scan over j
          if valid and s == S-1 and r == R-1: out[m] = h
          cur = ppermute(h, s -> s+1)              # circular (S-1 -> 0) iff R > 1
      y = psum_over_stages(where(s == S-1, out, 0))

  Microbatch m holds the examples `x[m::M]` (a strided split), so a batch dim that is
  sharded over data axes stays sharded inside every microbatch. Results are
  exactly those of applying the L layers in order, as long as `layer_fn` treats
  examples independently. Bubble iterations contribute nothing, not even NaN: their
  inputs are replaced by zeros with `jnp.where` before any compute, and their outputs
  are dropped with `jnp.where`, so their gradient contributions are exactly zero.

  Args:
    layer_fn: `layer_fn(layer_params, h, *broadcast_args) -> h`, one layer, pure;
      `layer_params` has no leading stage/repeat/layer dims, `h` is `[mb, ...]`,
      the output has the shape and dtype of `h`.
    stage_params: pytree whose leaves are `[S, R, Lps, ...]`, dim 0 sharded over
      `config.stage_axis` (other dims may be sharded over other mesh axes).
    x: `[B, ...]` activations with B = M * mb, or a pytree of them (an MoE stack's carry
      holds its per-row statistics beside the activations).
    mesh: the `jax.sharding.Mesh` (Auto axes) holding `config.stage_axis`.
    config: a `PipelineConfig`.
    broadcast_args: extra arguments passed unchanged to every `layer_fn` call (e.g.
      a mask shared by all microbatches); replicated over stages.
    microbatched_args: `[B, ...]` arrays split into microbatches like `x` (e.g. per-example
      positions, segment ids); `layer_fn` gets microbatch m's after `broadcast_args`.
    _bubble_fill: test hook: initial value of the internal buffers (default 0).

  Returns:
    `[B, ...]`, replicated over the stage axis.

  Raises:
    ConfigError: see `validate`, or leaves whose leading dims are not `[S, R, Lps]`.
  """
  s_n, r_n, ax = config.num_stages, config.circular_repeat, config.stage_axis
  leads = {tuple(a.shape[:3]) for a in jax.tree.leaves(stage_params)}
  if len(leads) != 1 or next(iter(leads))[:2] != (s_n, r_n):
    _fail(
        f"Every pipelined weight must have leading dims [S, R, Lps] with "
        f"S={_PL}num_stages={s_n} and R={_PL}circular_repeat={r_n}, got leading "
        f"dims {sorted(leads)}: build the weights with to_stages(..., {s_n}, {r_n})."
    )
  lps = next(iter(leads))[2]
  batch = jax.tree.leaves(x)[0].shape[0]  # x may be a pytree of [B, ...] (an MoE carry)
  validate(config, num_layers=s_n * r_n * lps, batch_size=batch, mesh=mesh)
  m_n = config.resolve_num_microbatches(batch)
  mb = batch // m_n
  n_iter = m_n * r_n + s_n - 1
  ring = m_n - s_n + 1  # ring-buffer slots for microbatches looping back (R > 1)
  fill = 0.0 if _bubble_fill is None else _bubble_fill
  policy = remat.policy(config.remat_policy)

  def run_stage(params, r, h, bargs, margs):
    w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, False), params)

    def one_layer(h, p):
      return layer_fn(p, h, *bargs, *margs), None

    h, _ = jax.lax.scan(one_layer, h, w, unroll=bool(config.unroll))
    return h

  if policy is not None:
    run_stage = jax.checkpoint(run_stage, policy=policy)

  if r_n > 1:
    perm = [(i, (i + 1) % s_n) for i in range(s_n)]
  else:
    perm = [(i, i + 1) for i in range(s_n - 1)]

  def per_stage(params, x, bargs, margs):
    params = jax.tree.map(lambda a: a[0], params)  # [R, Lps, ...]: this stage's
    s = jax.lax.axis_index(ax)
    tree = jax.tree.map
    xs = tree(lambda a: a.reshape((mb, m_n) + a.shape[1:]), x)  # microbatch m = x[m::M]
    ms = tuple(a.reshape((mb, m_n) + a.shape[1:]) for a in margs)
    cur = tree(lambda a: jnp.full((mb,) + a.shape[1:], fill, a.dtype), x)
    buf = tree(lambda a: jnp.full((ring, mb) + a.shape[1:] if r_n > 1 else (0,), fill, a.dtype),
               x)
    out = tree(lambda a: jnp.full(a.shape, fill, a.dtype), xs)
    zeros = tree(jnp.zeros_like, cur)
    index = lambda t, i, axis: tree(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis, False), t)
    update = lambda t, u, i, axis: tree(
        lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i, axis), t, u)
    where = lambda c, a, b: tree(lambda u, v: jnp.where(c, u, v), a, b)

    def body(carry, t):
      cur, buf, out = carry
      k = t - s
      valid = (k >= 0) & (k < m_n * r_n)
      kc = jnp.clip(k, 0, m_n * r_n - 1)
      r, m = kc // m_n, kc % m_n
      first = index(xs, m, 1)
      if r_n > 1:
        buf = update(buf, cur, t % ring, 0)
        first = where(r == 0, first, index(buf, (t + 1) % ring, 0))
      inp = where(valid, where(s == 0, first, cur), zeros)
      margs_m = tuple(jax.lax.dynamic_index_in_dim(a, m, 1, False) for a in ms)
      h = run_stage(params, r, inp, bargs, margs_m)
      is_out = valid & (s == s_n - 1) & (r == r_n - 1)
      out = update(out, where(is_out, h, index(out, m, 1)), m, 1)
      cur = h if s_n == 1 else jax.lax.ppermute(h, ax, perm)
      return (cur, buf, out), None

    (_, _, out), _ = jax.lax.scan(
        body, (cur, buf, out), jnp.arange(n_iter), unroll=bool(config.unroll)
    )
    out = where(s == s_n - 1, out, tree(jnp.zeros_like, out))
    return jax.lax.psum(tree(lambda o, a: o.reshape(a.shape), out, x), ax)

  fn = jax.shard_map(
      per_stage,
      mesh=mesh,
      in_specs=(P(ax), P(), P(), P()),
      out_specs=P(),
      axis_names={ax},
      check_vma=False,
  )
  return fn(stage_params, x, tuple(broadcast_args), tuple(microbatched_args))
