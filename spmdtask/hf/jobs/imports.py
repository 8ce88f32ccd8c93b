"""--from_hf: a Hugging Face model directory (and a PEFT adapter of it) as a spmdtask job
dir: a step-0 checkpoint, model_overrides.txt, hf_source.json, and the model dir's
tokenizer files, chat template and generation_config.json (what an export writes back).
"""
import json
import sys

from spmdtask import fs
from spmdtask.hf import convert, families, files, model_overrides, peft, trees
from spmdtask.hf.jobs import checkpoints, targets

SOURCE_FILE = "hf_source.json"  # the HF config and tensor dtypes, for --to_hf


def from_hf(hf_dir: str, job_log_dir: str, adapter: str | None = None,
            new_lora: dict | None = None, skip_mtp: bool = False, overwrite: bool = False,
            report: files.Report | None = None) -> list[str]:
  """Writes the job; returns the override lines. With `adapter` (--adapter, a PEFT LoRA
  dir) the model has LoRA adapters (its family's LoRA experiment) loaded from it; with
  `new_lora` (PEFT adapter_config fields: --lora_rank, --lora_alpha) fresh ones. Every
  input is read and checked before anything is written; an existing job there is a
  ConfigError unless `overwrite` (targets.job_dir). `skip_mtp`: a DeepSeek-V3's MTP layers
  are left out (Family.held). `report` gets the progress lines."""
  replaced = targets.job_dir(job_log_dir, overwrite)
  with files.opened_hf(hf_dir, report) as (raw_cfg, raw):
    return _from_hf(hf_dir, job_log_dir, raw_cfg, raw, adapter, new_lora, skip_mtp, replaced,
                    report)


def _from_hf(hf_dir: str, job_log_dir: str, raw_cfg: dict, raw: dict, adapter: str | None,
             new_lora: dict | None, skip_mtp: bool, replaced, report) -> list[str]:
  """`from_hf` on the opened HF dir (`raw`: `files.Tensor`s by name)."""
  family = families.of(raw_cfg)
  source_cfg, tensors = family.text(raw_cfg, raw)  # a multimodal Gemma 3: its text
  cfg, tensors, note = family.held(source_cfg, tensors, skip_mtp)
  kept = files.present(hf_dir, files.TOKENIZER_FILES + (files.GENERATION_FILE,))
  has_tokenizer = files.TOKENIZER_FILES[0] in kept
  tokenizer = fs.join(fs.absolute(job_log_dir), files.TOKENIZER_FILES[0])
  params, lora = convert.leaves(cfg, tensors), None
  base_name = cfg.get("_name_or_path") or fs.absolute(hf_dir)
  if adapter is not None:
    where = fs.join(adapter, peft.CONFIG_FILE)
    peft_cfg, peft_tensors = peft.read(adapter)
    lora = peft.lora_fields(cfg, peft_cfg, where)
    for path, x in peft.to_params(cfg, lora, peft_tensors, params, where).items():
      trees.set_leaf(params, path, x)
    warning = peft.base_mismatch(peft_cfg, hf_dir, cfg)
    if warning:
      print(warning, file=sys.stderr)
    base_name = peft_cfg.get("base_model_name_or_path") or base_name
  elif new_lora is not None:
    lora = peft.lora_fields(cfg, {"peft_type": "LORA", **new_lora}, "--lora_rank/--lora_alpha")
  lines = model_overrides.overrides(cfg, tokenizer if has_tokenizer else None, lora)
  # Checks the model before anything is written (without the tokenizer line: its file is
  # copied below, and the program does not need it).
  program = checkpoints.program(model_overrides.overrides(cfg, lora=lora),
                                families.experiment(cfg, lora))
  ready = checkpoints.prepared(lines, params, program)  # reads every tensor once
  if note:  # said once every input is checked
    print(note, file=sys.stderr)
  if replaced:
    targets.clear(job_log_dir, replaced)
  fs.makedirs(job_log_dir)
  for name in kept:
    fs.write_bytes(fs.join(job_log_dir, name), fs.read_bytes(fs.join(hf_dir, name)))
  checkpoints.write_prepared(job_log_dir, ready)
  fs.write_text(fs.join(job_log_dir, model_overrides.OVERRIDES_FILE),
                model_overrides.flagfile(lines, raw_cfg["model_type"]))
  source = {"config": source_cfg, "dtypes": {k: str(v.dtype) for k, v in tensors.items()},
            "base_model_name_or_path": base_name}
  if lora is not None:
    source["lora"] = {**lora, "targets": list(lora["targets"])}
  fs.write_text(fs.join(job_log_dir, SOURCE_FILE), json.dumps(source, indent=1))
  if replaced and report:
    report(targets.replaced_line(job_log_dir, replaced))
  return lines


def source(job_log_dir: str) -> dict:
  """hf_source.json of a --from_hf job: {config, dtypes, base_model_name_or_path[, lora]}."""
  return json.loads(fs.read_text(fs.join(job_log_dir, SOURCE_FILE)))
