"""A LoRA job's base checkpoint: the warm start that fills the frozen params from it (the
adapters stay fresh), and the record of it the job's own checkpoints keep in their `meta`.

The base is any job's checkpoint (e.g. tools/convert_hf.py --from_hf) whose params are the
LoRA model's frozen params, by name and shape; it may store them in another dtype (a
float32 base for a bfloat16 `base_dtype`): they are read as stored, then cast.
"""
import hashlib
import json

import jax

from spmdtask.core import sharding
from spmdtask.core.train_state import ADAPTER_SUFFIXES
from spmdtask.errors import ConfigError

FIELD = "task.train.init_checkpoint_dir"
META_KEY = "lora_base"  # in a LoRA job's checkpoint meta: {dir, step, shapes_fingerprint}


def without_adapters(tree):
  """A params tree (nested dicts) with the adapters' leaves left out: the frozen params."""
  if isinstance(tree, dict):
    return {k: without_adapters(v) for k, v in tree.items()
            if not str(k).endswith(ADAPTER_SUFFIXES)}
  return tree


def _flat(tree) -> dict:
  return {sharding.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def fingerprint(params) -> str:
  """A short hash of the frozen params' names and shapes (what a base must match)."""
  shapes = sorted((k, list(x.shape)) for k, x in _flat(without_adapters(params)).items())
  return hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]


def targets(model_params, saved, init_dir: str):
  """Restore targets of the base: the model's frozen params (`model_params`: sharded
  ShapeDtypeStructs, adapters included) in the dtypes the checkpoint (`saved`: its params'
  metadata tree) holds. ConfigError naming FIELD when its params are not this base."""
  want, have = _flat(without_adapters(model_params)), _flat(saved)
  bad = [f"{k}: checkpoint {tuple(have[k].shape)}, model {tuple(want[k].shape)}"
         for k in sorted(want.keys() & have.keys())
         if tuple(have[k].shape) != tuple(want[k].shape)]
  bad += [f"{k}: missing from the checkpoint" for k in sorted(want.keys() - have.keys())]
  bad += [f"{k}: in the checkpoint, not in the model" for k in sorted(have.keys() - want.keys())]
  if bad:
    shown = "; ".join(bad[:10]) + (f"; ... ({len(bad) - 10} more)" if len(bad) > 10 else "")
    raise ConfigError(
        f"{FIELD}={init_dir!r} is not the base of this LoRA model: its params must be the "
        f"model's frozen params (every param but the *_lora_a / *_lora_b adapters), by name "
        f"and shape; {len(bad)} differ: {shown}. Point {FIELD} at a checkpoint of this model "
        "without LoRA (e.g. made by tools/convert_hf.py --from_hf), or set task.model to the "
        "base's architecture.")
  return jax.tree_util.tree_map_with_path(
      lambda p, t: jax.ShapeDtypeStruct(t.shape, have[sharding.path_str(p)].dtype,
                                        sharding=t.sharding),
      without_adapters(model_params))


def merged(fresh, base):
  """`fresh` params (a LoRA model's, nested dicts) with every frozen leaf taken from `base`
  (`targets`' tree) and cast to the model's dtype; the adapters stay fresh."""
  if isinstance(fresh, dict):
    return {k: v if str(k).endswith(ADAPTER_SUFFIXES) else merged(v, base[k])
            for k, v in fresh.items()}
  return base.astype(fresh.dtype)


def record(init_dir: str, step: int, params) -> dict:
  """What a LoRA job's checkpoints say of their base (META_KEY)."""
  return {"dir": init_dir, "step": int(step), "shapes_fingerprint": fingerprint(params)}
