"""PEFT LoRA adapters in and out of spmdtask, for any `Family`. Pure numpy; no torch, no peft.

PEFT writes an adapter as `adapter_model.safetensors`, one pair per adapted Linear module:
`base_model.model.<module>.lora_A.weight` [r, in_features] and `...lora_B.weight`
[out_features, r] (e.g. module `model.layers.0.self_attn.q_proj`), and
`adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules, ...).
The module computes x·Wᵀ + (lora_alpha / r)·x·Aᵀ·Bᵀ. spmdtask's adapter of base weight X
(layers.lora) is `X_lora_a` [*in_dims, r] and `X_lora_b` [r, *out_dims] beside X
[*in_dims, *out_dims], stacked over layers [L, ...]: so a = Aᵀ and b = Bᵀ, reshaped to X's
dims (in-dims: o's two, [heads, head_dim]; every other target's one). No family permutes
HF's q/k rows, so neither A nor B is permuted.

Which modules an adapter covers follows from the family alone: every per-layer weight of
`Family.stacked` whose name is one of the family's `lora_targets` (spmdtask target -> PEFT
module name) is a module PEFT may adapt; target_modules picks them as PEFT does (a list:
a module whose name is an entry or ends with '.' + it; a string: a regular expression the
whole name matches; 'all-linear': all of them). spmdtask's target adapts every weight of its
name alike (one rank, every layer), so an adapter must cover all of a target's modules or
none. An MoE family's routed experts have no entry: transformers 5 fuses them into
`experts.gate_up_proj` [E, 2f, d] (gate rows, then up) and `experts.down_proj` [E, d, f],
which PEFT 0.21 adapts through `target_parameters`: lora_A [E·r, in] is A_e = rows e·r ..
(e+1)·r, lora_B [out, r·E] is B_e = columns r_i·E + e, delta_e = scale·B_e·A_e; so gate and up
share one A per expert (PEFT's own conversion of separate ones doubles the rank, rank_pattern
2r, with B block-diagonal). spmdtask's expert adapters (own A per weight, one rank) map onto
it only in that block-diagonal form, which PEFT's training leaves: it is refused by name (an
export in that form, rank_pattern and all, is not built). PEFT also maps any gate/up/down
projection of an MoE model onto those experts, so DeepSeek's dense and shared-expert MLPs are
no PEFT target either. Those leave by merging (merge.py).

Every key of adapter_config.json has a verdict (`READ`, `IGNORED`, `EXACT`): what changes
the math (DoRA, rsLoRA, aLoRA, biases, per-module ranks, extra trained modules, a base the
init rewrote, ...) is refused by name, as is a key this reader does not know.
"""
import ast
import dataclasses
import json
import math
import os
import re

import numpy as np

from spmdtask import fs
from spmdtask.core.train_state import ADAPTER_SUFFIXES
from spmdtask.errors import ConfigError
from spmdtask.hf import families
from spmdtask.hf.trees import leaf
from spmdtask.layers.lora import TARGETS, LoraConfig

A_SUFFIX, B_SUFFIX = ADAPTER_SUFFIXES  # our adapter params beside base weight X: X_lora_a, ...

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."
# adapter_config.json keys (PEFT 0.21's LoraConfig fields, tests/hf/data/peft_lora_fields.json)
# that this reader uses.
READ = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
        "init_lora_weights")
# No effect on the adapter's math once its weights are saved: bookkeeping, the runtime, and
# the settings of init methods (which `init_lora_weights` names; those that rewrite the
# base weights are refused there).
IGNORED = ("task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
           "revision", "inference_mode", "megatron_core", "qalora_group_size",
           "runtime_config", "ensure_weight_tying", "eva_config", "corda_config",
           "lora_ga_config")
# Keys whose other values change the math: key -> (the values taken, what the key does).
EXACT = {  # (the first refused is named: target_parameters' form also sets rank_pattern)
    "target_parameters": ((None, []), "adapters on parameters (transformers 5's fused MoE "
                          "experts), with gate and up sharing A"),
    "alora_invocation_tokens": ((None, []), "an activated LoRA (aLoRA): the adapter acts "
                                "only from the invocation tokens on"),
    "use_dora": ((False, None), "DoRA: a learned magnitude rescales each column of W + BA"),
    "use_rslora": ((False, None), "rsLoRA: the scale is lora_alpha / sqrt(r)"),
    "layer_replication": ((None, []), "layers replicated into a deeper model"),
    "rank_pattern": (({}, None), "per-module ranks"),
    "alpha_pattern": (({}, None), "per-module alphas"),
    "bias": (("none", None), "trained biases"),
    "lora_bias": ((False, None), "a trained bias on lora_B"),
    "modules_to_save": ((None, []), "whole modules trained and saved beside the adapters"),
    "trainable_token_indices": ((None, [], {}), "trained embedding rows"),
    "layers_to_transform": ((None, []), "adapters on some layers only"),
    "layers_pattern": ((None, [], ""), "adapters on some layers only"),
    "fan_in_fan_out": ((False, None), "Conv1D-layout (GPT-2) weights"),
    "use_qalora": ((False, None), "QA-LoRA: pooled inputs to A"),
    "use_bdlora": ((None, False), "block-diagonal LoRA"),
    "velora_config": ((None,), "VeLoRA's compressed activations"),
    "monteclora_config": ((None,), "MonteCLoRA's sampled adapters"),
    "arrow_config": ((None,), "Arrow routing among adapters"),
    "kasa_config": ((None,), "KaSA's singular-value adapters"),
    "loftq_config": (({}, None), "LoftQ: the base weights quantized and rewritten"),
    "megatron_config": ((None,), "Megatron's parallel linear layers"),
}
# init_lora_weights values that leave the base weights as they are (the rest rewrite them:
# the adapter then fits a base other than the checkpoint's).
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
FIX = {"use_rslora": "set use_rslora false and lora_alpha to lora_alpha x sqrt(r), the same "
       "scale as alpha / r", "target_parameters": "adapt attention only (q_proj, k_proj, "
       "v_proj, o_proj), or fine-tune the experts in spmdtask (target `experts`) and export "
       "with --merge_lora"}


def _refuse(where: str, key: str, value, why: str, fix: str | None = None):
  fix = fix or FIX.get(key) or (f"give {key} its plain-LoRA value (PEFT's default), or merge "
                                "the adapter into its base with PEFT and import the merged model")
  raise ConfigError(f"{where}: {key}={value!r}: {why}, which spmdtask's LoRA (x·W + "
                    f"alpha/r · x·A·B on each adapted weight) cannot express exactly, so "
                    f"nothing was imported. To import it, {fix}.")


def check_keys(adapter: dict, where: str) -> None:
  """ConfigError naming the first adapter_config.json key spmdtask cannot express exactly,
  or one it does not know."""
  for key in [*EXACT, *(k for k in adapter if k not in EXACT)]:
    if key not in adapter:
      continue
    value = adapter[key]
    if key in EXACT:
      ok, why = EXACT[key]
      if value not in ok:
        _refuse(where, key, value, why)
    elif key == "init_lora_weights":
      if value not in PLAIN_INITS:
        _refuse(where, key, value, "an init that rewrites the base weights (the adapter "
                "fits that rewritten base, not the checkpoint's)", "convert it to a plain "
                "LoRA first (PEFT's save_pretrained(..., path_initial_model_for_weight_"
                "conversion=...)) or import the merged model")
    elif key not in READ + IGNORED:
      _refuse(where, key, value, "a setting this reader does not know (a newer PEFT?)",
              "save it with PEFT 0.21, or remove the key if it is at its plain-LoRA value")


@dataclasses.dataclass(frozen=True)
class Module:
  """A weight PEFT may adapt: spmdtask's target, its stacked base path, the HF module
  (without '.weight') per layer."""
  target: str
  path: str
  names: tuple[str, ...]


def adaptable(cfg: dict) -> list[Module]:
  """Every weight of the config's model that a PEFT adapter may adapt (module doc)."""
  family = families.of(cfg)
  out = []
  for path, names, _ in family.stacked(cfg, families.model_fields(cfg)):
    target = path.rsplit("/", 1)[-1]
    peft_name = family.lora_targets.get(target)
    if peft_name is None or not names or isinstance(names[0], list):
      continue
    modules = tuple(n.removesuffix(".weight") for n in names)
    if all(m.rsplit(".", 1)[-1] == peft_name for m in modules):
      out.append(Module(target, path, modules))
  return out


def _matches(spec, name: str) -> bool:
  """Whether PEFT's target_modules / exclude_modules `spec` names module `name`."""
  if spec is None:
    return False
  if isinstance(spec, str):
    return bool(re.fullmatch(spec, name))
  return any(name == k or name.endswith("." + k) for k in spec)


def _targets(cfg: dict, adapter: dict, where: str) -> tuple[str, ...]:
  """Our targets (layers.lora) the adapter's target_modules pick, in TARGETS' order."""
  spec, exclude = adapter.get("target_modules"), adapter.get("exclude_modules")
  if not spec:
    raise ConfigError(f"{where}: target_modules={spec!r}: name the adapted modules (a list, a "
                      "regular expression or 'all-linear').")
  modules, kind, on, off = adaptable(cfg), families.model_type(cfg), {}, {}
  names = sorted({m.names[0].rsplit(".", 1)[-1] for m in modules})
  if isinstance(spec, str) and spec.lower() == "all-linear":
    spec = names
  for m in modules:
    for name in m.names:
      picked = _matches(spec, name) and not _matches(exclude, name)
      (on if picked else off).setdefault(m.target, []).append(name)
  if isinstance(spec, list):
    unused = [k for k in spec if not any(_matches([k], n) for ns in on.values() for n in ns)]
    if unused:
      raise ConfigError(
          f"{where}: target_modules names {unused}, which no weight spmdtask can adapt in "
          f"this {kind} model matches (its adaptable modules: {', '.join(names)}; an MoE's "
          "routed experts, routers, embeddings and head are none): the adapter was made for "
          "another architecture, or adapts what spmdtask's LoRA does not.")
  for target in on:
    if target in off:
      raise ConfigError(
          f"{where}: target_modules={adapter.get('target_modules')!r} (exclude_modules="
          f"{exclude!r}) adapts {on[target][0]} but not {off[target][0]}: spmdtask's LoRA "
          f"target {target!r} adapts every {on[target][0].rsplit('.', 1)[-1]} alike (one "
          "rank, every layer). Adapt all of them or none.")
  if not on:
    raise ConfigError(f"{where}: target_modules={adapter.get('target_modules')!r} picks none "
                      f"of this {kind} model's adaptable modules ({', '.join(names)}).")
  return tuple(t for t in TARGETS if t in on)


def lora_fields(cfg: dict, adapter: dict, where: str) -> dict:
  """LoraConfig fields (layers.lora) of a PEFT adapter_config.json for the model of HF
  config `cfg`; ConfigError naming the first key spmdtask cannot express exactly."""
  families.lora_experiment(cfg)
  if adapter.get("peft_type") != "LORA":
    raise ConfigError(f"{where}: peft_type={adapter.get('peft_type')!r}; only LoRA adapters "
                      "(peft_type 'LORA') convert.")
  check_keys(adapter, where)
  r, alpha = adapter.get("r"), adapter.get("lora_alpha")
  if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
    raise ConfigError(f"{where}: r={r!r}: the adapter's rank must be an integer > 0.")
  if not isinstance(alpha, (int, float)) or alpha <= 0:
    raise ConfigError(f"{where}: lora_alpha={alpha!r} must be > 0.")
  return {"rank": r, "alpha": float(alpha), "dropout": float(adapter.get("lora_dropout") or 0.0),
          "targets": _targets(cfg, adapter, where)}


def job_lora(config_text: str, where: str) -> dict:
  """LoraConfig fields (unset ones at their defaults) of a job's resolved config (its
  config.txt: one `path = value` a line); ConfigError where the model has no LoRA."""
  found = dict(re.findall(r"^task\.model\.lora\.(\w+) = (.+)$", config_text, re.M))
  set_ = {k: ast.literal_eval(v) for k, v in found.items() if not v.startswith("<[unset")}
  if "rank" not in set_ or "alpha" not in set_:
    raise ConfigError(f"{where}: the job's model has no LoRA adapters (task.model.lora is "
                      "not set); export it without --base_job.")
  return dataclasses.asdict(LoraConfig(**set_))


def warm_start_job(config_text: str) -> str | None:
  """The job a job warm-started from: task.train.init_checkpoint_dir of its resolved config
  (config.txt), or None."""
  found = re.search(r"^task\.train\.init_checkpoint_dir = (.+)$", config_text, re.M)
  value = ast.literal_eval(found.group(1)) if found and found.group(1) != "None" else None
  return value if isinstance(value, str) else None


def _key(module: str, which: str) -> str:
  return f"{PREFIX}{module}.lora_{which}.weight"


def _split(target: str, w_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(in dims, out dims) of one layer's base weight of `target` (shape [L, ...])."""
  n_in = 2 if target == "o" else 1
  return tuple(w_shape[1:1 + n_in]), tuple(w_shape[1 + n_in:])


def to_params(cfg: dict, lora: dict, tensors: dict[str, np.ndarray], base: dict,
              where: str) -> dict:
  """Our adapter params {stacked path: float32 array} from PEFT's tensors, shaped after the
  `base` params' weights; ConfigError for a missing, unexpected or misshapen tensor."""
  r, out, used = lora["rank"], {}, set()
  for m in adaptable(cfg):
    if m.target not in lora["targets"]:
      continue
    ins, outs = _split(m.target, np.shape(leaf(base, m.path)))
    a_s, b_s = [], []
    for module in m.names:
      for which, want, dest in (("A", (r, math.prod(ins)), a_s),
                                ("B", (math.prod(outs), r), b_s)):
        key = _key(module, which)
        if key not in tensors:
          raise ConfigError(f"{where}: no tensor {key!r}, which target_modules implies.")
        x = np.asarray(tensors[key])
        if x.shape != want:
          raise ConfigError(f"{where}: {key} is {list(x.shape)}, this model needs {list(want)} "
                            "(r × in, out × r): the adapter was made for another "
                            "architecture or size.")
        used.add(key)
        dest.append(x.astype(np.float32))
    out[m.path + A_SUFFIX] = np.stack([a.T.reshape(*ins, r) for a in a_s])
    out[m.path + B_SUFFIX] = np.stack([b.T.reshape(r, *outs) for b in b_s])
  extra = sorted(set(tensors) - used)
  if extra:
    raise ConfigError(f"{where}: tensors this model has no place for: {extra[:5]}"
                      f"{' ...' if len(extra) > 5 else ''} (another architecture, or "
                      "layers or modules this model lacks).")
  return out


def exportable(cfg: dict, lora: dict, where: str) -> list[Module]:
  """The weights a job's adapters (LoraConfig fields `lora`) go to PEFT as; ConfigError for
  a target no PEFT module of this family takes (module doc), before anything is written."""
  modules = adaptable(cfg)
  missing = [t for t in lora["targets"] if t not in {m.target for m in modules}]
  if missing:
    raise ConfigError(
        f"{where}: the job adapts {missing} (task.model.lora.targets), which no PEFT 0.21 "
        f"module of a {families.model_type(cfg)} model takes: transformers 5 fuses an MoE's "
        "routed experts (PEFT adapts them only through target_parameters, gate and up sharing "
        "A) and PEFT maps an MoE model's gate/up/down projections onto them. Export the merged "
        "model with --merge_lora (exact), or train without those targets for a PEFT adapter.")
  return [m for m in modules if m.target in lora["targets"]]


def from_params(cfg: dict, lora: dict, params: dict, where: str = "--to_hf"
                ) -> dict[str, np.ndarray]:
  """PEFT's tensors (float32) from our params (nested, stacked: the inverse of to_params)."""
  r, out = lora["rank"], {}
  for m in exportable(cfg, lora, where):
    a, b = leaf(params, m.path + A_SUFFIX), leaf(params, m.path + B_SUFFIX)
    for i, module in enumerate(m.names):
      out[_key(module, "A")] = np.ascontiguousarray(
          np.asarray(a[i], np.float32).reshape(-1, r).T)
      out[_key(module, "B")] = np.ascontiguousarray(
          np.asarray(b[i], np.float32).reshape(r, -1).T)
  return out


def adapter_config(cfg: dict, lora: dict, base_model: str | None) -> dict:
  """adapter_config.json for PEFT (the fields LoraConfig reads; PEFT fills the rest)."""
  modules = exportable(cfg, lora, "--to_hf")
  names = sorted({m.names[0].rsplit(".", 1)[-1] for m in modules})
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
          "target_modules": names, "bias": "none", "fan_in_fan_out": False,
          "use_rslora": False, "use_dora": False, "modules_to_save": None,
          "init_lora_weights": True, "inference_mode": True, "layers_to_transform": None,
          "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


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
