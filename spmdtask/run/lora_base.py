"""A LoRA job's base checkpoint: the warm start that fills the frozen params from it (the
adapters stay fresh), and the `Base` its own checkpoints name, from which every restore
reads the frozen params back.

The base is any job's checkpoint (e.g. tools/convert_hf.py --from_hf) whose params are the
LoRA model's frozen params, by name and shape; it may store them in another dtype (a
float32 base for a bfloat16 `base_dtype`): they are read as stored, then cast.

A LoRA job warm-started from a base saves only what it trains: the adapters, their optimizer
state, the step and input position, and its `meta` names the base (META_KEY: dir, step, the
frozen params' shapes fingerprint and the base arrays' stored fingerprints). A LoRA job with
no base (a fresh init, or a tools/convert_hf.py --from_hf --lora_rank/--adapter import whose
step-0 checkpoint is itself base + adapters) saves its whole params.
"""
import dataclasses
import hashlib
import json
import re

import jax

from spmdtask import fs
from spmdtask.core import sharding
from spmdtask.core import train_state
from spmdtask.core.train_state import ADAPTER_SUFFIXES
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_io, fingerprints

FIELD = "task.train.init_checkpoint_dir"
META_KEY = "lora_base"  # in a LoRA job's checkpoint meta: Base.record()
SCALE_KEY = "lora_scale"  # in a LoRA model's checkpoint meta: its adapters' alpha / rank


def without_adapters(tree):
  """A params tree (nested dicts) with the adapters' leaves left out: the frozen params."""
  if isinstance(tree, dict):
    return {k: without_adapters(v) for k, v in tree.items()
            if not str(k).endswith(ADAPTER_SUFFIXES)}
  return tree


def _flat(tree) -> dict:
  return {sharding.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _hash(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(params) -> str:
  """A short hash of the frozen params' names and shapes (what a base must match)."""
  return _hash(sorted((k, list(x.shape)) for k, x in _flat(without_adapters(params)).items()))


def _values_fingerprint(meta: dict) -> str | None:
  """A hash of a base checkpoint's stored params fingerprints: its values (None: it has none)."""
  stored = {k: v for k, v in meta.get(fingerprints.KEY, {}).items() if k.startswith("params/")}
  return _hash(stored) if stored else None


@dataclasses.dataclass(frozen=True)
class Base:
  """The base checkpoint a LoRA job's checkpoints hold their adapters against."""
  dir: str
  step: int
  shapes_fingerprint: str
  values_fingerprint: str | None = None
  merged: bool = True  # its own adapters (a LoRA job's) merged into its params, or left out

  def record(self) -> dict:
    """What the job's checkpoints' `meta` say of it (META_KEY)."""
    return {k: v for k, v in dataclasses.asdict(self).items()
            if v is not None and (k, v) != ("merged", True)}  # the default: as before

  @classmethod
  def of(cls, meta: dict) -> "Base | None":
    """The base a checkpoint's `meta` names; None for a job without one."""
    return cls(**meta[META_KEY]) if META_KEY in meta else None


def targets(model_params, saved, init_dir: str, field: str = FIELD):
  """Restore targets of the base: the model's frozen params (`model_params`: sharded
  ShapeDtypeStructs, adapters included) in the dtypes the checkpoint (`saved`: its params'
  metadata tree, without adapters) holds. ConfigError naming `field` when its params are
  not this base."""
  want, have = _flat(without_adapters(model_params)), _flat(saved)
  count, shown = checkpoint_io.differences(
      {k: (tuple(x.shape),) for k, x in have.items()},
      {k: (tuple(x.shape),) for k, x in want.items()}, 10)
  if count and not train_state.adapters(model_params):
    kind = checkpoint_io.attention_kind(have, want)
    raise ConfigError(
        f"{field}={init_dir!r} is not a start for this model: its params (a LoRA job's without "
        f"its adapters) must be the model's, by name and shape; {count} differ: {shown}.{kind} "
        "Start from a job of this architecture (an import by tools/convert_hf.py --from_hf, "
        "or a stage trained from one), or give the model that job's architecture: "
        "--init_from=DIR sets both.")
  if count:
    raise ConfigError(
        f"{field}={init_dir!r} is not the base of this LoRA model: its params must be the "
        f"model's frozen params (every param but the *_lora_a / *_lora_b adapters), by name "
        f"and shape; {count} differ: {shown}. Point {FIELD} at a checkpoint of this model "
        "without LoRA (e.g. made by tools/convert_hf.py --from_hf), or set task.model to the "
        "base's architecture.")
  return jax.tree_util.tree_map_with_path(
      lambda p, t: jax.ShapeDtypeStruct(t.shape, have[sharding.path_str(p)].dtype,
                                        sharding=t.sharding),
      without_adapters(model_params))


def merged(model, base, adapters=None):
  """`model`'s params tree (nested dicts of arrays or ShapeDtypeStructs) with every frozen
  leaf taken from `base` (`targets`' tree) cast to the model's dtype, and every adapter from
  `adapters` (a tree of the adapters alone), else `model`'s own."""
  if isinstance(model, dict):
    return {k: ((model[k] if adapters is None else adapters[k])
                if str(k).endswith(ADAPTER_SUFFIXES)
                else merged(v, base[k], None if adapters is None else adapters.get(k, {})))
            for k, v in model.items()}
  return base.astype(model.dtype)


def lora_scale(meta: dict) -> float:
  """alpha / rank of the adapters a checkpoint holds (its `meta`: SCALE_KEY, or the rank and
  alpha lines of the config it names, for a checkpoint written before SCALE_KEY)."""
  if SCALE_KEY in meta:
    return float(meta[SCALE_KEY])
  found = dict(re.findall(r"^task\.model\.lora\.(rank|alpha)\s*=\s*([0-9.eE+-]+)\s*$",
                          meta.get("config", ""), re.M))
  if len(found) < 2:
    raise ConfigError("A checkpoint holds LoRA adapters but names neither their scale nor "
                      "task.model.lora.rank and alpha in its config; train it again with "
                      "this version, or export it merged (tools/convert_hf.py --merge_lora).")
  return float(found["alpha"]) / float(found["rank"])


def _overlay(tree: dict, extra: dict) -> dict:
  """`tree` (nested dicts) with the leaves of `extra` (the same nesting) added."""
  out = dict(tree)
  for k, v in extra.items():
    out[k] = _overlay(out.get(k, {}), v) if isinstance(v, dict) else v
  return out


def _replicated(saved, mesh):
  """Restore targets of a checkpoint's adapters (`saved`: their metadata tree): whole on
  every device of `mesh` (they are small), in the dtypes stored."""
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                                saved)


def read(init_dir: str, program, step: int | None = None, expected: Base | None = None,
         field: str = FIELD, merge: bool = True) -> tuple[Base, dict]:
  """(the Base, its frozen params on `program.mesh`) of job `init_dir`'s checkpoint `step`
  (None: its latest): the model's params without adapters, by name and shape, in the dtypes
  stored. A LoRA job's checkpoint (adapters beside its params, or adapters alone beside the
  base its meta names) gives its params with its adapters merged in, W + (alpha / r)·A·B
  (`train_state.merged_adapters`, float32): where a stage starts. With `expected` (what a LoRA job's
  checkpoint names), ConfigError naming FIELD and the base dir when it is gone or is not
  that base. Without `merge` (task.train.init_adapters='continue') the params are the
  start's base's with the start's adapters beside them, and the Base is the one those
  adapters continue on. Every process calls it.
  A QLoRA model's base (`train_state.base_storage`) is read in float (its stored weights
  under their float names: `float_view`) and quantized here, weight by weight on the
  devices that hold it (`quantized`), once a job (its restores read the job's own copy,
  run.quantized_base, where it has one). From a float checkpoint (no adapters of its own)
  each weight is read only when its turn comes (`_streamed`), so the float base is never
  whole on the devices."""
  storage = train_state.base_storage(program.model)
  base, params = _read(init_dir, program, step, expected, field, merge, storage,
                       stream=storage is not None)
  if storage is None:
    return base, params
  return base, storage.quantized(params, program.canonical_targets().params)


def _read(init_dir: str, program, step: int | None, expected: Base | None, field: str,
          merge: bool, storage, stream: bool = False) -> tuple[Base, dict]:
  """`read`'s base and params, a QLoRA base in float (`stream`: from a float checkpoint,
  its stored weights as loaders, `_streamed`)."""
  merge = expected.merged if expected is not None else merge
  model_params = program.canonical_targets().params
  stored_names = ()
  if storage is not None:
    floats = storage.float_view(model_params)
    stored_names = set(_flat(floats)) - set(_flat(model_params))
    model_params = floats
  shapes = fingerprint(model_params)
  if expected is not None:
    _check_expected(expected, shapes)
  else:
    fs.check_reachable(init_dir, field)
  directory = checkpoint_io.checkpoint_dir(init_dir)
  step = checkpoint_io.pick_step(directory, init_dir, step)
  mngr = checkpoint_io.manager(directory, read_only=True)
  try:
    meta = checkpoint_io.read_meta(mngr, step)
    saved = mngr.item_metadata(step)["params"]
    saved = dict(getattr(saved, "tree", saved))
    own_base = Base.of(meta) if meta.get(checkpoint_io.HELD_KEY) == checkpoint_io.ADAPTERS \
        else None
    if own_base is not None:  # adapters alone: the params are its base's
      want = _replicated(saved, program.mesh)
    else:
      want = _overlay(targets(model_params, without_adapters(saved), init_dir, field),
                      _replicated(train_state.adapters(saved), program.mesh))
    if stream and own_base is None and not train_state.adapters(saved):
      got = {"params": _streamed(directory, step, program, want, meta, stored_names),
             "meta": meta}
    else:
      got = checkpoint_io.restore(mngr, directory, program, step, ("params",), own=False,
                                  params_targets=want)
  finally:
    mngr.close()
  base = Base(init_dir, step, shapes, _values_fingerprint(got["meta"]))
  if expected is not None and None not in (expected.values_fingerprint, base.values_fingerprint) \
      and expected.values_fingerprint != base.values_fingerprint:
    raise _mismatch(expected, f"its checkpoint at step {step} holds other values than the "
                    "base this job started from (its stored fingerprints differ)")
  params = got["params"]
  if own_base is not None:
    params = _overlay(_read(own_base.dir, program, own_base.step, own_base, FIELD, True,
                            storage)[1], params)
  if not merge:  # the adapters continue: on the start's own base, or on its params
    return own_base or dataclasses.replace(base, merged=False), params
  if train_state.adapters(params):
    params = _merged_adapters(params, lora_scale(meta))
  return base, params


def _streamed(directory: str, step: int, program, want: dict, meta: dict,
              stored_names) -> dict:
  """The params of checkpoint `step` as `want` (restore targets) has them, each weight of
  `stored_names` (paths) a loader (`() -> array`: it reads that one array when called,
  `checkpoint_io.read_params`) that `Storage.quantized` calls and quantizes before the
  next: the device holds one float weight of a QLoRA base at a time (Llama31_8B_QLora on
  one 16 GiB v5e: its bfloat16 base whole is 15 GiB). The rest is read at once."""
  stored = meta.get(fingerprints.KEY)

  def load(path):
    one = _select(want, lambda p: p == path)
    return lambda: _flat(checkpoint_io.read_params(directory, step, program, one, stored))[path]
  loaders = jax.tree_util.tree_map_with_path(lambda p, _: load(sharding.path_str(p)),
                                             _select(want, lambda p: p in stored_names))
  rest = _select(want, lambda p: p not in stored_names)
  return _overlay(checkpoint_io.read_params(directory, step, program, rest, stored), loaders)


def _select(tree: dict, keep, prefix: str = "") -> dict:
  """`tree` (nested dicts) with only the leaves whose path ('a/b/c') `keep` accepts."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, dict):
      inner = _select(v, keep, path + "/")
      if inner:
        out[k] = inner
    elif keep(path):
      out[k] = v
  return out


# One program for the whole merge (op by op, each adapted weight's einsum, casts and add
# were a dozen small programs compiled apiece).
_merged_adapters = jax.jit(train_state.merged_adapters, static_argnums=1)


def _check_expected(expected: Base, shapes: str) -> None:
  """ConfigError when the base a checkpoint names is gone or cannot be this model's."""
  if shapes != expected.shapes_fingerprint:
    raise _mismatch(expected, "this model's frozen params do not have the shapes the base had "
                    "(shapes fingerprint "
                    f"{shapes}, base {expected.shapes_fingerprint}): the model config changed")
  directory = checkpoint_io.checkpoint_dir(expected.dir)
  if not fs.isdir(directory) or expected.step not in checkpoint_io.complete_steps(directory):
    raise _mismatch(expected, f"there is no complete checkpoint at step {expected.step} in "
                    f"{directory} any more")


def _mismatch(base: Base, why: str) -> ConfigError:
  return ConfigError(
      f"This LoRA job's checkpoints hold only the adapters; the frozen params are read from "
      f"the base it was warm-started from ({FIELD}={base.dir!r}, step {base.step}), but {why}. "
      f"Put that base checkpoint back at {base.dir} (e.g. rerun the same tools/convert_hf.py "
      "--from_hf into it), or restore with the model config the job was trained with (its "
      "config.txt); nothing was changed.")


def whole_params(program, got: dict, frozen=None):
  """The whole canonical params of a restored checkpoint (`got`: its items and `meta`): as
  read, or, for one that holds only the adapters, with the frozen params `frozen` (a QLoRA
  job's own copy, run.quantized_base) or else read from the base its `meta` names
  (ConfigError naming FIELD when that base is gone or differs)."""
  if got["meta"].get(checkpoint_io.HELD_KEY) != checkpoint_io.ADAPTERS:
    return got["params"]
  if frozen is None:
    base = Base.of(got["meta"])
    _, frozen = read(base.dir, program, base.step, expected=base)
  return merged(program.canonical_targets().params, frozen, got["params"])
