"""Hugging Face Llama checkpoints in and out of spmdtask (safetensors, numpy; no torch).

    python tools/convert_llama.py --from_hf=/models/llama --job_log_dir=/tmp/llama
    python -m spmdtask.main --exp=llama.LlamaImport --job_log_dir=/tmp/llama --mode=decode \
        --flagfile=/tmp/llama/model_overrides.txt
    python tools/convert_llama.py --job_log_dir=/tmp/llama --to_hf=/models/llama_out

--from_hf reads config.json and model.safetensors (or the shards listed in
model.safetensors.index.json) and writes, into --job_log_dir: a step-0 checkpoint (the
params, a fresh optimizer state) that --mode=decode, --mode=train and
task.train.init_checkpoint_dir accept on any mesh; model_overrides.txt, one
`--fdl_set=...` per line (an absl --flagfile) that makes `--exp=llama.LlamaImport` build
the matching TransformerLm (and, when the architecture is a published one, the name of
the configs/llama.py experiment that has it: that experiment decodes the checkpoint as
it is); the model's tokenizer.json (and tokenizer_config.json), when the HF directory
has one, for decode text; and hf_source.json (the HF config and tensor dtypes) for
--to_hf. --to_hf writes config.json and model.safetensors from the latest checkpoint.
Converting in and out gives bit-identical tensors (float32, bfloat16 and float16
weights are exact in float32).

Config layouts: RoPE is read from transformers >= 5's `rope_parameters` ({rope_theta,
rope_type, factor, ...}) or from the older top-level `rope_theta` / `rope_scaling`;
rope_type 'default' and 'llama3' are supported. Anything this converter cannot express
exactly (another rope_type, unknown RoPE keys, biases, a non-SiLU activation, another
model_type) is refused by name (exit 2), never replaced by a default.

Layouts. HF Linear weights are [out, in]; spmdtask's are [in, ...]. q_proj [h·hd, d] ->
q [d, h, hd], k/v_proj [kv·hd, d] -> [d, kv, hd], o_proj [d, h·hd] -> o [h, hd, d],
gate/up/down_proj -> mlp wg/wi/wo transposed, per-layer tensors stacked on a leading
[num_layers] dim. No permutation of q/k rows is needed: HF Llama applies rotary
embeddings in rotate-half form (pairs (i, i + hd/2), HF's checkpoint conversion already
permuted Meta's interleaved rows), which is the form of `spmdtask.layers.attention.rope`,
with the same frequencies theta^(-2i/hd). A tied HF head is unscaled: scale_tied_logits=False.
"""
import argparse
import json
import os
import sys

import numpy as np
from safetensors import numpy as st_numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
from spmdtask import fs
from spmdtask.errors import ConfigError

EXP = "llama.LlamaImport"
OVERRIDES_FILE = "model_overrides.txt"
SOURCE_FILE = "hf_source.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
# HF config fields whose non-default values this converter cannot express.
UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
# The keys each supported rope_type has (HF's names); any other key is refused.
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
ROPE_TYPES = {"default": (), "llama3": LLAMA3_KEYS}
HF_DEFAULT_ROPE_THETA = 10000.0  # LlamaConfig's, for old configs without rope_theta
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints hold


def _hf_layer(i: int) -> dict[str, tuple[str, str]]:
  """Our stacked param path -> (HF name of layer i, layout kind)."""
  p = f"model.layers.{i}."
  return {"layers/block/attn/q": (p + "self_attn.q_proj.weight", "heads_in"),
          "layers/block/attn/k": (p + "self_attn.k_proj.weight", "kv_in"),
          "layers/block/attn/v": (p + "self_attn.v_proj.weight", "kv_in"),
          "layers/block/attn/o": (p + "self_attn.o_proj.weight", "heads_out"),
          "layers/block/mlp/wg": (p + "mlp.gate_proj.weight", "t"),
          "layers/block/mlp/wi": (p + "mlp.up_proj.weight", "t"),
          "layers/block/mlp/wo": (p + "mlp.down_proj.weight", "t"),
          "layers/block/attn_norm/scale": (p + "input_layernorm.weight", "same"),
          "layers/block/mlp_norm/scale": (p + "post_attention_layernorm.weight", "same")}


def _rope_parameters(cfg: dict) -> tuple[dict, str]:
  """(RoPE parameters in transformers >= 5's form, the config key they came from)."""
  legacy = dict(cfg.get("rope_scaling") or {})
  if "rope_theta" in cfg:
    legacy["rope_theta"] = cfg["rope_theta"]
  params = cfg.get("rope_parameters")
  if params is None:
    legacy.setdefault("rope_theta", HF_DEFAULT_ROPE_THETA)
    return legacy, "rope_scaling"
  if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
    raise ConfigError(f"config.json: rope_parameters={params!r} is not one flat RoPE setting "
                      "(per-layer-type RoPE is not supported).")
  clash = {k: (v, params.get(k)) for k, v in legacy.items() if params.get(k) != v}
  if clash:
    raise ConfigError(f"config.json: rope_parameters and the top-level rope_theta/rope_scaling "
                      f"disagree on {sorted(clash)} ({clash}); keep one of the two layouts.")
  if "rope_theta" not in params:
    raise ConfigError("config.json: rope_parameters has no rope_theta; add the model's RoPE "
                      "base (e.g. 500000.0 for Llama 3).")
  return dict(params), "rope_parameters"


def rope_fields(cfg: dict) -> dict:
  """TransformerLm's rope_theta and rope_scaling (None or the llama3 fields) of a HF config."""
  params, where = _rope_parameters(cfg)
  rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  theta = params.pop("rope_theta")
  if rope_type not in ROPE_TYPES:
    raise ConfigError(f"config.json: {where} rope_type={rope_type!r} is not supported (only "
                      f"{sorted(ROPE_TYPES)}); spmdtask's RoPE cannot express it, so the "
                      "conversion would not be exact.")
  keys = ROPE_TYPES[rope_type]
  unknown, missing = sorted(set(params) - set(keys)), [k for k in keys if k not in params]
  if unknown or missing:
    raise ConfigError(f"config.json: {where} (rope_type={rope_type!r}) "
                      + (f"has keys this converter does not support: {unknown}" if unknown
                         else f"lacks {missing}, which rope_type {rope_type!r} needs")
                      + "; refusing rather than guessing their effect.")
  scaling = {k: float(params[k]) for k in keys}
  if "original_max_position_embeddings" in scaling:
    scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
  return dict(rope_theta=float(theta), rope_scaling=scaling or None)


def model_fields(cfg: dict) -> dict:
  """TransformerLm fields of a HF Llama config; ConfigError naming an unsupported key."""
  if cfg.get("model_type", "llama") != "llama":
    raise ConfigError(f"config.json: model_type={cfg['model_type']!r} is not 'llama'; this "
                      "converter reads LlamaForCausalLM checkpoints only.")
  for key in REQUIRED:
    if key not in cfg:
      raise ConfigError(f"config.json has no {key!r}, which a Llama config needs.")
  for key, ok in UNSUPPORTED.items():
    if cfg.get(key, ok) != ok:
      raise ConfigError(f"config.json: {key}={cfg[key]!r} is not supported (only {ok!r}); "
                        "spmdtask's TransformerLm cannot express it, so the conversion would "
                        "not be exact.")
  heads = cfg["num_attention_heads"]
  tied = bool(cfg.get("tie_word_embeddings", False))
  return dict(vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
              num_layers=cfg["num_hidden_layers"], num_heads=heads,
              num_kv_heads=cfg.get("num_key_value_heads") or heads,
              head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
              d_ff=cfg["intermediate_size"], max_seq_len=cfg.get("max_position_embeddings", 2048),
              mlp_activation="swiglu", **rope_fields(cfg),
              norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=tied,
              scale_tied_logits=False)  # HF's tied head is unscaled


def overrides(cfg: dict, tokenizer: str | None = None) -> list[str]:
  """`--fdl_set` values that make EXP build this model (its synthetic data in vocab);
  `tokenizer`, a tokenizer.json path, gives the decode output its text."""
  fields = model_fields(cfg)
  scaling = fields.pop("rope_scaling")
  lines = [f"task.model.{k}={v!r}" for k, v in fields.items()]
  if scaling is None:
    lines.append("task.model.rope_scaling=None")
  else:  # EXP's model has a Llama3Scaling config: its fields are set one by one
    lines += [f"task.model.rope_scaling.{k}={v!r}" for k, v in scaling.items()]
  lines += [f"datasets['{s}'].vocab_size={cfg['vocab_size']}" for s in ("train", "eval")]
  lines.append(f"decode_datasets['prompts'].vocab_size={cfg['vocab_size']}")
  if isinstance(cfg.get("eos_token_id"), int):
    lines.append(f"task.decode.eos_id={cfg['eos_token_id']}")
  if tokenizer:
    lines.append(f"decode_datasets['prompts'].tokenizer={'hf:' + tokenizer!r}")
  return lines


def published_experiment(cfg: dict) -> str | None:
  """The registered configs/llama.py experiment (`llama.NAME`) whose model is exactly this
  architecture, if any."""
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  from spmdtask import registry  # pylint: disable=g-import-not-at-top
  want = model_fields(cfg)
  for name in registry.names():
    if not name.startswith("configs.llama.") or name.endswith("." + EXP.split(".")[-1]):
      continue
    model = fdl.build(registry.get(name)().task().model)
    got = {k: getattr(model, k) for k in want}
    if got["rope_scaling"] is not None:
      got["rope_scaling"] = {k: getattr(got["rope_scaling"], k) for k in LLAMA3_KEYS}
    if got == want:
      return name.removeprefix("configs.")
  return None


def read_hf(hf_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json, tensors by name) of a HF directory, single-file or sharded."""
  path = fs.join(hf_dir, "config.json")
  if not fs.isfile(path):
    raise ConfigError(f"--from_hf={hf_dir!r} has no config.json; point it at a Hugging Face "
                      "Llama directory (config.json + *.safetensors).")
  cfg = json.loads(fs.read_text(path))
  index = fs.join(hf_dir, "model.safetensors.index.json")
  if fs.isfile(index):
    files = sorted(set(json.loads(fs.read_text(index))["weight_map"].values()))
  else:
    files = ["model.safetensors"]
  for name in files:
    if not fs.isfile(fs.join(hf_dir, name)):
      raise ConfigError(f"--from_hf={hf_dir!r} has no {name}, which holds the weights.")
  tensors = {}
  for name in files:
    with fs.local_file(fs.join(hf_dir, name)) as path:  # safetensors reads (mmaps) a file
      tensors.update(st_numpy.load_file(path))
  return cfg, tensors


def to_params(cfg: dict, tensors: dict[str, np.ndarray]) -> dict:
  """spmdtask's logical params (float32, layers stacked [L, ...]) from HF tensors."""
  m = model_fields(cfg)
  d, h, kv, hd = m["d_model"], m["num_heads"], m["num_kv_heads"], m["head_dim"]
  used = set()

  def take(name):
    if name not in tensors:
      raise ConfigError(f"The checkpoint has no tensor {name!r}, which config.json implies.")
    used.add(name)
    return np.asarray(tensors[name]).astype(np.float32)

  layouts = {"heads_in": lambda w: w.T.reshape(d, h, hd), "kv_in": lambda w: w.T.reshape(d, kv, hd),
             "heads_out": lambda w: w.T.reshape(h, hd, d), "t": lambda w: w.T,
             "same": lambda w: w}
  flat = {"embedding": take("model.embed_tokens.weight"),
          "final_norm/scale": take("model.norm.weight")}
  if not m["tie_embeddings"]:
    flat["unembed"] = take("lm_head.weight").T
  elif "lm_head.weight" in tensors:
    used.add("lm_head.weight")  # a tied head's copy; HF ignores it too
  for path in _hf_layer(0):
    flat[path] = np.stack([layouts[_hf_layer(i)[path][1]](take(_hf_layer(i)[path][0]))
                           for i in range(m["num_layers"])])
  extra = sorted(k for k in set(tensors) - used if not k.endswith(IGNORED_TENSORS))
  if extra:
    raise ConfigError(f"The checkpoint has tensors this Llama converter does not map: "
                      f"{extra[:10]}{' ...' if len(extra) > 10 else ''}. It is not a plain "
                      "LlamaForCausalLM (config.json fields and tensors disagree).")
  params = {}
  for path, value in flat.items():
    node = params
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = np.ascontiguousarray(value)
  return params


def from_params(cfg: dict, params: dict, dtypes: dict[str, str]) -> dict[str, np.ndarray]:
  """HF tensors from spmdtask's params (the inverse of `to_params`), cast to `dtypes`."""
  m = model_fields(cfg)
  d, h, hd = m["d_model"], m["num_heads"], m["head_dim"]
  out = {"model.embed_tokens.weight": params["embedding"],
         "model.norm.weight": params["final_norm"]["scale"]}
  if not m["tie_embeddings"]:
    out["lm_head.weight"] = params["unembed"].T
  inverse = {"heads_in": lambda w: w.reshape(d, -1).T, "kv_in": lambda w: w.reshape(d, -1).T,
             "heads_out": lambda w: w.reshape(h * hd, d).T, "t": lambda w: w.T,
             "same": lambda w: w}
  for i in range(m["num_layers"]):
    for path, (name, kind) in _hf_layer(i).items():
      leaf = params
      for key in path.split("/"):
        leaf = leaf[key]
      out[name] = inverse[kind](np.asarray(leaf[i]))
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  def cast(name, x):
    dtype = dtypes.get(name, "float32")
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)))
  return {k: cast(k, v) for k, v in out.items()}


def _program(lines: list[str]):
  from spmdtask import main
  from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  run = fdl.build(main.resolved_config(EXP, lines))
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def write_checkpoint(job_log_dir: str, lines: list[str], params: dict) -> None:
  """A step-0 train state with `params` (logical) and a fresh optimizer state, via spmdtask's
  checkpoint module: the one place that knows the checkpoint layout."""
  from spmdtask.run import checkpoints  # pylint: disable=g-import-not-at-top
  program = _program(lines)
  canonical = program.to_canonical(program.init())
  state = program.from_canonical(canonical._replace(params=params))
  ckpt = checkpoints.Checkpointer(job_log_dir, program, 1, None,
                                  {"config": "\n".join(lines) + "\n"})
  ckpt.save(0, state, None)
  ckpt.close()


def read_checkpoint(job_log_dir: str, lines: list[str]) -> dict:
  """The logical params of the latest checkpoint of `job_log_dir`, as numpy."""
  import jax  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints  # pylint: disable=g-import-not-at-top
  program = _program(lines)
  state, _ = checkpoints.restore_state(job_log_dir, program)
  return jax.device_get(program.to_canonical(state).params)


def from_hf(hf_dir: str, job_log_dir: str) -> list[str]:
  """--from_hf: writes the checkpoint, model_overrides.txt, the tokenizer files and
  hf_source.json; returns the override lines."""
  cfg, tensors = read_hf(hf_dir)
  has_tokenizer = fs.isfile(fs.join(hf_dir, TOKENIZER_FILES[0]))
  tokenizer = fs.join(fs.absolute(job_log_dir), TOKENIZER_FILES[0])
  lines = overrides(cfg, tokenizer if has_tokenizer else None)
  params = to_params(cfg, tensors)
  fs.makedirs(job_log_dir)
  for name in TOKENIZER_FILES if has_tokenizer else ():
    if fs.isfile(fs.join(hf_dir, name)):
      fs.write_bytes(fs.join(job_log_dir, name), fs.read_bytes(fs.join(hf_dir, name)))
  write_checkpoint(job_log_dir, lines, params)
  fs.write_text(fs.join(job_log_dir, OVERRIDES_FILE),
                "".join(f"--fdl_set={line}\n" for line in lines))
  fs.write_text(fs.join(job_log_dir, SOURCE_FILE), json.dumps(
      {"config": cfg, "dtypes": {k: str(v.dtype) for k, v in tensors.items()}}, indent=1))
  return lines


def to_hf(job_log_dir: str, hf_dir: str) -> None:
  """--to_hf: config.json and model.safetensors from the latest checkpoint of job_log_dir."""
  source = fs.join(job_log_dir, SOURCE_FILE)
  if not fs.isfile(source):
    raise ConfigError(f"--job_log_dir={job_log_dir!r} has no {SOURCE_FILE}; --to_hf converts "
                      "back a job made by --from_hf (it holds the HF config).")
  src = json.loads(fs.read_text(source))
  params = read_checkpoint(job_log_dir, overrides(src["config"]))  # tokenizer: not needed
  staged = fs.Staged(hf_dir, "spmdtask_hf_")  # safetensors writes a local file
  try:
    st_numpy.save_file(from_params(src["config"], params, src["dtypes"]),
                       os.path.join(staged.local, "model.safetensors"), metadata={"format": "pt"})
    fs.write_text(os.path.join(staged.local, "config.json"), json.dumps(src["config"], indent=2))
  except BaseException:
    staged.close(upload=False)
    raise
  staged.close()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--job_log_dir", required=True)
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--from_hf", help="a Hugging Face Llama directory to read")
  group.add_argument("--to_hf", help="a directory to write a Hugging Face Llama into")
  args = parser.parse_args()
  try:
    if args.from_hf:
      from_hf(args.from_hf, args.job_log_dir)
      published = published_experiment(json.loads(fs.read_text(fs.join(args.from_hf,
                                                                        "config.json"))))
      print(f"wrote {args.job_log_dir}: checkpoint step 0, {OVERRIDES_FILE} "
            f"(--exp={EXP} --flagfile={fs.join(args.job_log_dir, OVERRIDES_FILE)})")
      if published:
        print(f"the architecture of --exp={published}, which decodes or trains it as it is "
              "(its mesh and batch; add the --flagfile for the tokenizer's text)")
    else:
      to_hf(args.job_log_dir, args.to_hf)
      print(f"wrote {args.to_hf}: config.json, model.safetensors")
  except ConfigError as e:
    print(f"convert_llama: config error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
