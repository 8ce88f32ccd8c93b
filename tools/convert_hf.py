"""Hugging Face checkpoints in and out of spmdtask: Llama, Qwen3, Gemma 3 (text), Mixtral,
Qwen3-MoE, DeepSeek-V2 and V3 (safetensors, numpy; no torch).

    python tools/convert_hf.py --from_hf=/models/llama --job_log_dir=/tmp/llama
    python -m spmdtask.main --exp=llama.LlamaImport --job_log_dir=/tmp/llama --mode=decode \
        --flagfile=/tmp/llama/model_overrides.txt
    python tools/convert_hf.py --job_log_dir=/tmp/llama --to_hf=/models/llama_out

(`tools/convert_llama.py`, the older name, runs this same command.) --from_hf reads
config.json and model.safetensors (or the shards listed in model.safetensors.index.json) and
writes, into --job_log_dir: a step-0 checkpoint (the params, a fresh optimizer state) that
--mode=decode, --mode=train and task.train.init_checkpoint_dir accept on any mesh;
model_overrides.txt, one `--fdl_set=...` per line (an absl --flagfile) that makes the
family's import experiment (hf_models.EXPERIMENTS: `llama.LlamaImport`, `qwen3.Qwen3Import`,
`gemma3.Gemma3Import`, `moe.MoeImport` for Mixtral and Qwen3-MoE, `deepseek.DeepSeekImport`)
build the matching TransformerLm (and, when the architecture is a published one, the name of
the configs/ experiment that has it: that experiment decodes the checkpoint as it is); the
model's tokenizer.json (and tokenizer_config.json), when the HF directory has one, for
decode text; and hf_source.json (the HF config and tensor dtypes) for --to_hf. --to_hf
writes config.json and model.safetensors from the latest checkpoint. Converting in and out
gives bit-identical tensors (float32, bfloat16 and float16 weights are exact in float32).

LoRA (Llama): `--from_hf --adapter=DIR` loads a PEFT adapter (tools/hf_lora.py), or
`--lora_rank=R` makes fresh ones: a step-0 `finetune.LlamaLoraImport` job. `--to_hf` of a
LoRA job (that one, or one warm-started from an import: --base_job, default its
task.train.init_checkpoint_dir) writes the adapter in PEFT's format, `--merge_lora` the
merged model as a plain checkpoint.

Config layouts: RoPE is read from transformers >= 5's `rope_parameters` ({rope_theta,
rope_type, factor, ...}; Gemma 3's per layer type) or from the older top-level
`rope_theta` / `rope_scaling`; rope_type 'default' and 'llama3' (Gemma 3's global layers:
'linear'). Anything this converter cannot express exactly (another rope_type, unknown RoPE
keys, biases, another activation, sliding windows outside Gemma 3, softcapping, another
model_type) is refused by name (exit 2), never a default (tools/hf_models.py). A `gemma3`
(multimodal) checkpoint converts its language model alone; --to_hf writes it back as a
`gemma3_text` one (tools/hf_gemma3.py).

Layouts. HF Linear weights are [out, in]; spmdtask's are [in, ...]. q_proj [h·hd, d] -> q
[d, h, hd], k/v_proj [kv·hd, d] -> [d, kv, hd], o_proj [d, h·hd] -> o [h, hd, d],
gate/up/down_proj -> mlp wg/wi/wo transposed, per-layer tensors stacked on a leading
[num_layers] dim; a MoE router [E, d] -> moe/router [d, E], each expert's gate/up/down
(Mixtral's w1/w3/w2) -> moe/wg, wi, wo stacked [num_layers, E, ...]. No permutation of q/k
rows is needed: HF applies RoPE in rotate-half form (pairs (i, i + hd/2); HF's conversion
permuted Meta's interleaved rows), the form of `spmdtask.layers.attention.mha.rope`, with
the same frequencies theta^(-2i/hd). A tied HF head is unscaled: scale_tied_logits=False.
"""
import argparse
import dataclasses
import json
import re
import os
import sys

import numpy as np
from safetensors import numpy as st_numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from spmdtask import fs
from spmdtask.errors import ConfigError
from tools import hf_deepseek, hf_gemma3, hf_lora, hf_models

OVERRIDES_FILE = "model_overrides.txt"
SOURCE_FILE = "hf_source.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints hold
EXP = hf_models.EXPERIMENTS["llama"]  # the Llama experiment (the documented command's)


def experiment(cfg: dict, lora: dict | None = None) -> str:
  """The experiment (`configs/`) whose model the overrides of this HF config set (with
  `lora`, LoraConfig fields, the family's LoRA experiment)."""
  if lora is not None:
    return hf_models.lora_experiment(cfg)
  return hf_models.EXPERIMENTS[hf_models.family(cfg)]


def overrides(cfg: dict, tokenizer: str | None = None, lora: dict | None = None) -> list[str]:
  """`--fdl_set` values that make `experiment(cfg, lora)` build this model (its synthetic
  data, used without --data_dir, in vocab); `tokenizer`, a tokenizer.json path, gives the
  decode output its text; `lora` (LoraConfig fields) sets the adapters' rank, alpha,
  dropout and targets."""
  cfg = hf_gemma3.text_config(cfg)  # a multimodal Gemma 3: its language model's
  fields = hf_models.model_fields(cfg)
  scaling, moe, mla = fields.pop("rope_scaling"), fields.pop("moe", {}), fields.pop("mla", None)
  lines = [f"task.model.{k}={v!r}" for k, v in fields.items()]
  lines += [f"task.model.moe.{k}={v!r}" for k, v in moe.items()] + hf_deepseek.override_lines(mla)
  if scaling is None:
    lines.append("task.model.rope_scaling=None")
  else:  # EXP's model has a Llama3Scaling config: its fields are set one by one
    lines += [f"task.model.rope_scaling.{k}={v!r}" for k, v in scaling.items()]
  if isinstance(cfg.get("eos_token_id"), int):
    lines.append(f"task.decode.eos_id={cfg['eos_token_id']}")
  if tokenizer:
    lines.append(f"decode_datasets['prompts'].default.tokenizer={'hf:' + tokenizer!r}")
  lines += [f"task.model.lora.{k}={tuple(v) if k == 'targets' else v!r}"
            for k, v in (lora or {}).items()]
  return lines


def published_experiment(cfg: dict) -> str | None:
  """The registered experiment (`llama.NAME`, `moe.NAME`: the module of `experiment(cfg)`)
  whose model is exactly this architecture, if any."""
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  from spmdtask import registry  # pylint: disable=g-import-not-at-top
  want, exp = hf_models.model_fields(cfg), experiment(cfg)
  module = "configs." + exp.split(".")[0] + "."
  for name in registry.names():
    if not name.startswith(module) or name.endswith("." + exp.split(".")[-1]):
      continue
    model = fdl.build(registry.get(name)().task().model)
    got = {k: getattr(model, k) for k in want}
    if got["rope_scaling"] is not None:
      got["rope_scaling"] = dataclasses.asdict(got["rope_scaling"])
    got.update(hf_deepseek.sub_fields(got, want))  # moe and mla as dicts
    if got == want:
      return name.removeprefix("configs.")
  return None


def read_hf(hf_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json, tensors by name) of a HF directory, single-file or sharded."""
  path = fs.join(hf_dir, "config.json")
  if not fs.isfile(path):
    raise ConfigError(f"--from_hf={hf_dir!r} has no config.json; point it at a Hugging Face "
                      "model directory (config.json + *.safetensors).")
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
  """spmdtask's logical params (float32, layers stacked [L, ...], routed experts
  [L, E, ...]) from HF tensors."""
  m = hf_models.model_fields(cfg)
  used = set()

  def take(name):
    if name not in tensors:
      raise ConfigError(f"The checkpoint has no tensor {name!r}, which config.json implies.")
    used.add(name)
    return np.asarray(tensors[name]).astype(np.float32)

  layout = hf_models.layouts(m)[0]
  flat = {"embedding": take("model.embed_tokens.weight"),
          "final_norm/scale": take("model.norm.weight")}
  if not m["tie_embeddings"]:
    flat["unembed"] = take("lm_head.weight").T
  elif "lm_head.weight" in tensors:
    used.add("lm_head.weight")  # a tied head's copy; HF ignores it too
  stack = lambda names, kind: np.stack([stack(n, kind) if isinstance(n, list)
                                        else layout[kind](take(n)) for n in names])
  for path, names, kind in hf_models.stacked_paths(cfg, m):
    flat[path] = stack(names, kind)
  for copy, main in hf_deepseek.mtp_copies(cfg).items():  # shared weights' copies
    if not np.array_equal(take(copy), take(main)):
      raise ConfigError(f"The checkpoint's {copy!r} differs from {main!r}: spmdtask's MTP head "
                        "shares the main model's (DeepSeek-V3's design), so it cannot hold both.")
  extra = sorted(k for k in set(tensors) - used if not k.endswith(IGNORED_TENSORS))
  if extra:
    raise ConfigError(f"The checkpoint has tensors this converter does not map: "
                      f"{extra[:10]}{' ...' if len(extra) > 10 else ''}. It is not a plain "
                      f"{cfg.get('architectures', [hf_models.family(cfg)])[0]} (config.json "
                      "fields and tensors disagree).")
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
  m = hf_models.model_fields(cfg)
  out = {"model.embed_tokens.weight": params["embedding"],
         "model.norm.weight": params["final_norm"]["scale"]}
  if not m["tie_embeddings"]:
    out["lm_head.weight"] = params["unembed"].T
  inverse = hf_models.layouts(m)[1]

  def put(names, stacked, kind):
    for name, x in zip(names, stacked):
      if isinstance(name, list):
        put(name, x, kind)
      else:
        out[name] = inverse[kind](np.asarray(x))
  for path, names, kind in hf_models.stacked_paths(cfg, m):
    leaf = params
    for key in path.split("/"):
      leaf = leaf[key]
    put(names, leaf, kind)
  out.update({copy: out[main] for copy, main in hf_deepseek.mtp_copies(cfg).items()})
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  def cast(name, x):
    dtype = dtypes.get(name, "float32")
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)))
  return {k: cast(k, v) for k, v in out.items()}


def _program(lines: list[str], exp: str):
  from spmdtask import main
  from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  run = fdl.build(main.resolved_config(exp, lines))
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def write_checkpoint(job_log_dir: str, lines: list[str], params: dict, exp: str = EXP) -> None:
  """A step-0 train state with `params` (logical) and a fresh optimizer state, via spmdtask's
  checkpoint module: the one place that knows the checkpoint layout."""
  from spmdtask.run import checkpoints  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  program = _program(lines, exp)
  canonical = program.to_canonical(program.init())
  # In the model's dtypes (a LoRA model may store its frozen base in bfloat16); adapters
  # `params` lacks (a new LoRA) keep their fresh init (PEFT's: B = 0, the base unchanged).
  params = hf_lora.filled(params, jax.device_get(canonical.params))
  state = program.from_canonical(canonical._replace(params=params))
  ckpt = checkpoints.Checkpointer(job_log_dir, program, 1, None,
                                  {"config": "\n".join(lines) + "\n"})
  ckpt.save(0, state, None)
  ckpt.close()


def read_checkpoint(job_log_dir: str, lines: list[str], exp: str = EXP) -> dict:
  """The logical params of the latest checkpoint of `job_log_dir` (its model: `exp` with
  the override `lines`), as numpy."""
  import jax  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints  # pylint: disable=g-import-not-at-top
  program = _program(lines, exp)
  state, _ = checkpoints.restore_state(job_log_dir, program)
  return jax.device_get(program.to_canonical(state).params)


def from_hf(hf_dir: str, job_log_dir: str, adapter: str | None = None,
            new_lora: dict | None = None, skip_mtp: bool = False) -> list[str]:
  """--from_hf: writes the checkpoint, model_overrides.txt, the tokenizer files and
  hf_source.json; returns the override lines. With `adapter` (--adapter, a PEFT LoRA
  dir) the model has LoRA adapters (its family's LoRA experiment) loaded from it; with
  `new_lora` (PEFT adapter_config fields: --lora_rank, --lora_alpha) fresh ones. Every
  input is read and checked before anything is written. `skip_mtp`: a DeepSeek-V3's MTP
  layers are left out (hf_deepseek.held)."""
  source_cfg, tensors = hf_gemma3.text_half(*read_hf(hf_dir))  # a multimodal Gemma 3: its text
  cfg, note = hf_deepseek.held(source_cfg, tensors, skip_mtp)
  if note:  # said once every input is checked
    tensors = {k: v for k, v in tensors.items()
               if not k.startswith(tuple(hf_deepseek.mtp_layers(source_cfg).values()))}
  has_tokenizer = fs.isfile(fs.join(hf_dir, TOKENIZER_FILES[0]))
  tokenizer = fs.join(fs.absolute(job_log_dir), TOKENIZER_FILES[0])
  params, lora = to_params(cfg, tensors), None
  base_name = cfg.get("_name_or_path") or fs.absolute(hf_dir)
  if adapter is not None:
    where = fs.join(adapter, hf_lora.CONFIG_FILE)
    peft_cfg, peft_tensors = hf_lora.read(adapter)
    lora = hf_lora.lora_fields(peft_cfg, where)
    hf_models.lora_experiment(cfg)  # a family with LoRA, or a ConfigError now
    for path, x in hf_lora.to_params(cfg, lora, peft_tensors, where).items():
      hf_lora.set_leaf(params, path, x)
    warning = hf_lora.base_mismatch(peft_cfg, hf_dir, cfg)
    if warning:
      print(warning, file=sys.stderr)
    base_name = peft_cfg.get("base_model_name_or_path") or base_name
  elif new_lora is not None:
    lora = hf_lora.lora_fields({"peft_type": "LORA", **new_lora}, "--lora_rank/--lora_alpha")
    hf_models.lora_experiment(cfg)
  lines = overrides(cfg, tokenizer if has_tokenizer else None, lora)
  if note:
    print(note, file=sys.stderr)
  fs.makedirs(job_log_dir)
  for name in TOKENIZER_FILES if has_tokenizer else ():
    if fs.isfile(fs.join(hf_dir, name)):
      fs.write_bytes(fs.join(job_log_dir, name), fs.read_bytes(fs.join(hf_dir, name)))
  write_checkpoint(job_log_dir, lines, params, experiment(cfg, lora))
  fs.write_text(fs.join(job_log_dir, OVERRIDES_FILE),  # the family: for stages.* experiments
                f"--family={hf_models.family(cfg)}\n" +
                "".join(f"--fdl_set={line}\n" for line in lines))
  source = {"config": source_cfg, "dtypes": {k: str(v.dtype) for k, v in tensors.items()},
            "base_model_name_or_path": base_name}
  if lora is not None:
    source["lora"] = {**lora, "targets": list(lora["targets"])}
  fs.write_text(fs.join(job_log_dir, SOURCE_FILE), json.dumps(source, indent=1))
  return lines


def _import_of(job_log_dir: str) -> str | None:
  """The --from_hf job a job started from: its task.train.init_checkpoint_dir, or that
  job's, and so on (a chain of stages), up to one with SOURCE_FILE."""
  job = job_log_dir
  for _ in range(100):  # a chain of stages; a loop of job dirs ends here
    text = fs.join(job, "config.txt")
    job = hf_lora.warm_start_job(fs.read_text(text)) if fs.isfile(text) else None
    if job is None or fs.isfile(fs.join(job, SOURCE_FILE)):
      return job
  return None


def to_hf(job_log_dir: str, hf_dir: str, merge_lora: bool = False,
          base_job: str | None = None) -> list[str]:
  """--to_hf: config.json and model.safetensors from the latest checkpoint of job_log_dir;
  of a LoRA job (hf_source.json names its LoRA), the adapter in PEFT's format, or with
  `merge_lora` the merged model (W + (alpha / r)·A·B) as a plain checkpoint. `base_job`: the
  --from_hf job a LoRA job elsewhere warm-started from (default: its init_checkpoint_dir;
  its config.txt gives the adapters). Returns the files' names."""
  text = fs.join(job_log_dir, "config.txt")
  given = base_job is not None
  if base_job is None and not fs.isfile(fs.join(job_log_dir, SOURCE_FILE)) and fs.isfile(text):
    base_job = _import_of(job_log_dir)
  where = f"--base_job={base_job!r}" if base_job else f"--job_log_dir={job_log_dir!r}"
  source = fs.join(base_job or job_log_dir, SOURCE_FILE)
  if not fs.isfile(source):
    raise ConfigError(f"{where} has no {SOURCE_FILE}; --to_hf converts back a job made by "
                      "--from_hf (it holds the HF config), or with --base_job=THAT_JOB a LoRA "
                      "job warm-started from one.")
  src = json.loads(fs.read_text(source))
  lora, source_cfg = src.get("lora"), src["config"]
  cfg = hf_deepseek.held(source_cfg, src["dtypes"])[0]  # a DeepSeek-V3's MTP layers as read
  if base_job is not None:
    config_text = fs.read_text(text) if fs.isfile(text) else ""
    lora = (hf_lora.job_lora(config_text, text)  # a stage without LoRA: its whole params
            if given or re.search(r"^task\.model\.lora\.rank = \d", config_text, re.M)
            else None)
  if merge_lora and lora is None:
    raise ConfigError(f"--merge_lora: the job {job_log_dir!r} has no LoRA adapters (its "
                      f"{SOURCE_FILE} names none); drop --merge_lora to export its model.")
  params = read_checkpoint(job_log_dir, overrides(cfg, lora=lora),  # tokenizer: not needed
                           experiment(cfg, lora))
  if lora is None or merge_lora:
    params = params if lora is None else hf_lora.merged(cfg, lora, params)
    files = {"model.safetensors": from_params(cfg, params, src["dtypes"]),
             "config.json": json.dumps(source_cfg, indent=2)}
  else:
    files = {hf_lora.ADAPTER_FILE: hf_lora.from_params(cfg, lora, params),
             hf_lora.CONFIG_FILE: json.dumps(hf_lora.adapter_config(
                 lora, src.get("base_model_name_or_path")), indent=2)}
  staged = fs.Staged(hf_dir, "spmdtask_hf_")  # safetensors writes a local file
  try:
    for name, content in files.items():
      if isinstance(content, str):
        fs.write_text(os.path.join(staged.local, name), content)
      else:
        st_numpy.save_file(content, os.path.join(staged.local, name), metadata={"format": "pt"})
  except BaseException:
    staged.close(upload=False)
    raise
  staged.close()
  return sorted(files)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--job_log_dir", required=True)
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--from_hf", help="a Hugging Face model directory to read")
  group.add_argument("--to_hf", help="a directory to write the Hugging Face model into")
  parser.add_argument("--adapter", help="with --from_hf: a PEFT LoRA adapter directory "
                      "(adapter_config.json + adapter_model.safetensors) of that model")
  parser.add_argument("--lora_rank", type=int, help="with --from_hf: add fresh LoRA adapters "
                      "of this rank to every attention and MLP weight (PEFT's init: B = 0)")
  parser.add_argument("--lora_alpha", type=float, help="with --lora_rank (default 2 x rank)")
  parser.add_argument("--merge_lora", action="store_true", help="with --to_hf of a LoRA job: "
                      "write the merged model (base + alpha/r A B), not the PEFT adapter")
  parser.add_argument("--skip_mtp", action="store_true", help="with --from_hf of a "
                      "DeepSeek-V3: leave its multi-token-prediction layers out")
  parser.add_argument("--base_job", help="with --to_hf of a LoRA job trained elsewhere: the "
                      "--from_hf job it warm-started from (default: its init_checkpoint_dir)")
  args = parser.parse_args()
  try:
    lora = args.adapter or args.lora_rank is not None
    if (lora and not args.from_hf or (args.merge_lora or args.base_job) and not args.to_hf
        or args.adapter and args.lora_rank is not None):
      raise ConfigError("--adapter (an adapter of that model) or else --lora_rank (new "
                        "adapters), not both, goes with --from_hf; --merge_lora with --to_hf "
                        "(of a LoRA job).")
    if args.from_hf:
      new = None if args.lora_rank is None else {
          "r": args.lora_rank, "target_modules": "all-linear",
          "lora_alpha": 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha}
      from_hf(args.from_hf, args.job_log_dir, args.adapter, new, args.skip_mtp)
      src = json.loads(fs.read_text(fs.join(args.job_log_dir, SOURCE_FILE)))
      cfg = hf_deepseek.held(src["config"], src["dtypes"])[0]
      exp = hf_models.lora_experiment(cfg) if lora else experiment(cfg)
      published = None if lora else published_experiment(cfg)
      print(f"wrote {args.job_log_dir}: checkpoint step 0"
            f"{' (base + LoRA adapters)' if lora else ''}, {OVERRIDES_FILE} "
            f"(--exp={exp} --flagfile={fs.join(args.job_log_dir, OVERRIDES_FILE)})")
      if published:
        print(f"the architecture of --exp={published}, which decodes or trains it as it is "
              "(its mesh and batch; add the --flagfile for the tokenizer's text)")
    else:
      files = to_hf(args.job_log_dir, args.to_hf, args.merge_lora, args.base_job)
      print(f"wrote {args.to_hf}: {', '.join(files)}")
  except ConfigError as e:
    print(f"{os.path.basename(sys.argv[0]).removesuffix('.py')}: config error: {e}",
          file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
