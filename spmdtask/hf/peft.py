"""PEFT LoRA adapters in and out of spmdtask, for any `Family` with `lora_targets`. Pure
numpy; no torch, no peft.

PEFT writes an adapter as `adapter_model.safetensors`, one pair per adapted Linear module:
`base_model.model.<module>.lora_A.weight` [r, in_features] and `...lora_B.weight`
[out_features, r] (e.g. module `model.layers.0.self_attn.q_proj`), and
`adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
base_model_name_or_path, task_type, ...). The module computes x·Wᵀ + (lora_alpha / r)·
x·Aᵀ·Bᵀ. spmdtask's adapter of base weight X (layers.lora) is `X_lora_a` [*in_dims, r] and
`X_lora_b` [r, *out_dims] beside X [*in_dims, *out_dims] (q [d | h, hd], k and v [d | kv, hd],
o [h, hd | d], wi and wg [d | f], wo [f | d]), stacked over layers [L, ...]: so a = Aᵀ and
b = Bᵀ, reshaped to those dims. HF's q/k rows need no permutation (llama.py), so
neither do B's. Anything of an adapter spmdtask cannot express exactly (DoRA, rsLoRA, biases,
per-module ranks, extra trained modules, other target modules or shapes) is a ConfigError.
"""
import ast
import dataclasses
import json
import os
import re

import numpy as np

from spmdtask import fs
from spmdtask.core.train_state import ADAPTER_SUFFIXES
from spmdtask.errors import ConfigError
from spmdtask.hf import families
from spmdtask.hf.trees import leaf
from spmdtask.layers.lora import LoraConfig

A_SUFFIX, B_SUFFIX = ADAPTER_SUFFIXES  # our adapter params beside base weight X: X_lora_a, ...

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."
# adapter_config.json fields whose other values change the math: (key, the values we take).
EXACT = {"use_dora": (False, None), "use_rslora": (False, None), "bias": ("none", None),
         "fan_in_fan_out": (False, None), "modules_to_save": (None, []),
         "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
         "layers_to_transform": (None,), "layers_pattern": (None, [], ""),
         "target_parameters": (None, []), "trainable_token_indices": (None,),
         "use_qalora": (False, None), "lora_bias": (False, None)}


def _dims(m: dict) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """Target -> (in dims, out dims) of its base weight, per layer."""
  d, h, kv, hd, f = m["d_model"], m["num_heads"], m["num_kv_heads"], m["head_dim"], m["d_ff"]
  return {"q": ((d,), (h, hd)), "k": ((d,), (kv, hd)), "v": ((d,), (kv, hd)),
          "o": ((h, hd), (d,)), "wi": ((d,), (f,)), "wg": ((d,), (f,)), "wo": ((f,), (d,))}


def _targets(cfg: dict, adapter: dict, where: str) -> tuple[str, ...]:
  """Our target names (layers.lora) of PEFT's target_modules, in our order."""
  modules, own = adapter.get("target_modules"), families.of(cfg).lora_targets
  ours = {hf: t for t, (hf, _) in own.items()}
  if modules == "all-linear":
    return tuple(ours.values())
  if isinstance(modules, str) or not modules:
    raise ConfigError(f"{where}: target_modules={modules!r}: give a list of module names "
                      f"({', '.join(ours)}); a regular expression is not supported.")
  bad = [m for m in modules if m not in ours]
  if bad:
    raise ConfigError(f"{where}: target_modules names {bad}, which no layer of this model has "
                      f"(a {families.model_type(cfg)} model's adaptable modules are "
                      f"{', '.join(ours)}): the adapter was made for another architecture.")
  return tuple(t for t, (hf, _) in own.items() if hf in modules)


def lora_fields(cfg: dict, adapter: dict, where: str) -> dict:
  """LoraConfig fields (layers.lora) of a PEFT adapter_config.json for the model of HF
  config `cfg`; ConfigError naming the first field spmdtask cannot express exactly (or a
  family without LoRA)."""
  families.lora_experiment(cfg)
  if adapter.get("peft_type") != "LORA":
    raise ConfigError(f"{where}: peft_type={adapter.get('peft_type')!r}; only LoRA adapters "
                      "(peft_type 'LORA') convert.")
  for key, ok in EXACT.items():
    if key in adapter and adapter[key] not in ok:
      raise ConfigError(f"{where}: {key}={adapter[key]!r} is not supported (only "
                        f"{ok[0]!r}): spmdtask's LoRA cannot express it exactly.")
  r, alpha = adapter.get("r"), adapter.get("lora_alpha")
  if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
    raise ConfigError(f"{where}: r={r!r}: the adapter's rank must be an integer > 0.")
  if not isinstance(alpha, (int, float)) or alpha <= 0:
    raise ConfigError(f"{where}: lora_alpha={alpha!r} must be > 0.")
  return {"rank": r, "alpha": float(alpha), "dropout": float(adapter.get("lora_dropout") or 0.0),
          "targets": _targets(cfg, adapter, where)}


def job_lora(config_text: str) -> dict | None:
  """LoraConfig fields (unset ones at their defaults) of a job's resolved config (its
  config.txt: one `path = value` a line); None where the model has no LoRA."""
  found = dict(re.findall(r"^task\.model\.lora\.(\w+) = (.+)$", config_text, re.M))
  set_ = {k: ast.literal_eval(v) for k, v in found.items() if not v.startswith("<[unset")}
  if "rank" not in set_ or "alpha" not in set_:
    return None
  return dataclasses.asdict(LoraConfig(**set_))


def warm_start_job(config_text: str) -> str | None:
  """The job a job warm-started from: task.train.init_checkpoint_dir of its resolved config
  (config.txt), or None."""
  found = re.search(r"^task\.train\.init_checkpoint_dir = (.+)$", config_text, re.M)
  value = ast.literal_eval(found.group(1)) if found and found.group(1) != "None" else None
  return value if isinstance(value, str) else None


def _key(module: str, which: str) -> str:
  return f"{PREFIX}{module}.lora_{which}.weight"


def modules(cfg: dict, i: int, targets) -> dict[str, tuple[str, str]]:
  """Adapter target -> (our stacked base param path, HF module name in layer i without
  '.weight') for each of `targets`."""
  family = families.of(cfg)
  tensors, out = family.layer_tensors(cfg, i), {}
  for t in targets:
    path = family.lora_targets[t][1]
    out[t] = (path, tensors[path][0].removesuffix(".weight"))
  return out


def to_params(cfg: dict, lora: dict, tensors: dict[str, np.ndarray], where: str) -> dict:
  """Our adapter params {stacked path: float32 array} from PEFT's tensors; ConfigError for
  a missing, unexpected or misshapen tensor."""
  m, r = families.model_fields(cfg), lora["rank"]
  dims, out, used = _dims(m), {}, set()
  for t in lora["targets"]:
    ins, outs = dims[t]
    a_s, b_s = [], []
    for i in range(m["num_layers"]):
      module = modules(cfg, i, (t,))[t][1]
      for which, want, dest in (("A", (r, int(np.prod(ins))), a_s),
                                ("B", (int(np.prod(outs)), r), b_s)):
        key = _key(module, which)
        if key not in tensors:
          raise ConfigError(f"{where}: no tensor {key!r}, which target {t!r} of a "
                            f"{m['num_layers']}-layer model needs.")
        x = np.asarray(tensors[key])
        if x.shape != want:
          raise ConfigError(f"{where}: {key} is {list(x.shape)}, this model needs {list(want)} "
                            "(r × in, out × r): the adapter was made for another "
                            "architecture or size.")
        used.add(key)
        dest.append(x.astype(np.float32))
    path = modules(cfg, 0, (t,))[t][0]
    out[path + A_SUFFIX] = np.stack([a.T.reshape(*ins, r) for a in a_s])
    out[path + B_SUFFIX] = np.stack([b.T.reshape(r, *outs) for b in b_s])
  extra = sorted(set(tensors) - used)
  if extra:
    raise ConfigError(f"{where}: tensors this model has no place for: {extra[:5]}"
                      f"{' ...' if len(extra) > 5 else ''} (another architecture, or "
                      "layers this model lacks).")
  return out


def from_params(cfg: dict, lora: dict, params: dict) -> dict[str, np.ndarray]:
  """PEFT's tensors (float32) from our params (nested, stacked: the inverse of to_params)."""
  m, r = families.model_fields(cfg), lora["rank"]
  out = {}
  for t in lora["targets"]:
    path = modules(cfg, 0, (t,))[t][0]
    a, b = leaf(params, path + A_SUFFIX), leaf(params, path + B_SUFFIX)
    for i in range(m["num_layers"]):
      module = modules(cfg, i, (t,))[t][1]
      out[_key(module, "A")] = np.ascontiguousarray(
          np.asarray(a[i], np.float32).reshape(-1, r).T)
      out[_key(module, "B")] = np.ascontiguousarray(
          np.asarray(b[i], np.float32).reshape(r, -1).T)
  return out


def adapter_config(cfg: dict, lora: dict, base_model: str | None) -> dict:
  """adapter_config.json for PEFT (the fields LoraConfig reads; PEFT fills the rest)."""
  own = families.of(cfg).lora_targets
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
          "target_modules": [own[t][0] for t in lora["targets"]],
          "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
          "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
          "alpha_pattern": {}, "revision": None}


def read(adapter_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(adapter_config.json, tensors) of a PEFT adapter dir; ConfigError if either is missing."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  for name in (CONFIG_FILE, ADAPTER_FILE):
    if not fs.isfile(fs.join(adapter_dir, name)):
      raise ConfigError(f"--adapter={adapter_dir!r} has no {name}; point it at a PEFT LoRA "
                        f"adapter directory ({CONFIG_FILE} + {ADAPTER_FILE}).")
  adapter = json.loads(fs.read_text(fs.join(adapter_dir, CONFIG_FILE)))
  with fs.local_file(fs.join(adapter_dir, ADAPTER_FILE)) as path:
    return adapter, st_numpy.load_file(path)


def base_mismatch(adapter: dict, hf_dir: str, cfg: dict) -> str | None:
  """A warning where the adapter names a base other than --from_hf (by path, its last
  part, or config.json's _name_or_path); None where it matches or names none."""
  name = adapter.get("base_model_name_or_path")
  if not name:
    return None
  ours = {os.path.normpath(hf_dir), os.path.basename(os.path.normpath(hf_dir)),
          cfg.get("_name_or_path")}
  if name in ours or os.path.basename(os.path.normpath(name)) in ours:
    return None
  return (f"warning: the adapter's base_model_name_or_path is {name!r}, not --from_hf="
          f"{hf_dir!r}; its tensors fit this model, so it is loaded onto it.")
