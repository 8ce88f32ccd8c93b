"""--to_hf: a Hugging Face directory from a job's latest checkpoint. Of a full model (or a
LoRA job's merged one: W + (alpha / r)·A·B) a chat model transformers loads from that dir
alone: config.json, model.safetensors, the import's tokenizer files and chat template, and
generation_config.json whose eos is the end-of-turn token (generation.py). Of a LoRA job
without --merge_lora, its adapter in PEFT's format.

The job is an import (--from_hf: it holds hf_source.json) or was started from one: its
config.txt's task.train.init_checkpoint_dir leads, maybe through earlier stages, to the
import (or --base_job names it), whose hf_source.json gives the HF config and dtypes and
whose dir the tokenizer files; the job's own config.txt gives its LoRA, if any.
"""
import json
import re

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.hf import convert, families, files, generation, merge, model_overrides, peft
from spmdtask.hf.jobs import checkpoints, targets
from spmdtask.hf.jobs.imports import SOURCE_FILE, source

CONFIG_TXT = "config.txt"
MAX_STAGES = 64  # init_checkpoint_dir hops from a job back to its import


def source_job(job_log_dir: str) -> str | None:
  """The import a job started from: itself if it holds hf_source.json, else the one its
  init_checkpoint_dir leads to (through earlier stages); None where the chain ends first."""
  job = job_log_dir
  for _ in range(MAX_STAGES):
    if fs.isfile(fs.join(job, SOURCE_FILE)):
      return job
    text = fs.join(job, CONFIG_TXT)
    job = peft.warm_start_job(fs.read_text(text)) if fs.isfile(text) else None
    if job is None:
      return None
  return None


def to_hf(job_log_dir: str, hf_dir: str, merge_lora: bool = False,
          base_job: str | None = None, overwrite: bool = False,
          report: files.Report | None = None) -> list[str]:
  """Writes `hf_dir` from the latest checkpoint of job_log_dir (see the module doc);
  `base_job`: the import a job elsewhere started from (default: found from its config).
  A non-empty `hf_dir` is a ConfigError unless `overwrite` (targets.export_dir), checked
  first. `report` gets the progress lines. Returns the written files' names."""
  own = fs.isfile(fs.join(job_log_dir, SOURCE_FILE))
  base = base_job or (job_log_dir if own else source_job(job_log_dir))
  where = f"--base_job={base_job!r}" if base_job else f"--job_log_dir={job_log_dir!r}"
  if base is None or not fs.isfile(fs.join(base, SOURCE_FILE)):
    raise ConfigError(f"{where} has no {SOURCE_FILE}, nor does a job it started from "
                      "(task.train.init_checkpoint_dir); --to_hf converts back a job made by "
                      "--from_hf (it holds the HF config) or one started from such a job, or "
                      "with --base_job=THAT_IMPORT a job trained elsewhere.")
  replaced = targets.export_dir(hf_dir, overwrite, [job_log_dir, base])
  src = source(base)
  lora, source_cfg = src.get("lora"), src["config"]
  cfg = families.of(source_cfg).held(source_cfg, src["dtypes"])[0]  # DeepSeek's MTP as read
  text = fs.join(job_log_dir, CONFIG_TXT)
  if base != job_log_dir:  # a job started from the import: its own config has its LoRA
    lora = peft.job_lora(fs.read_text(text) if fs.isfile(text) else "")
  if merge_lora and lora is None:
    raise ConfigError(f"--merge_lora: the job {job_log_dir!r} has no LoRA adapters "
                      "(task.model.lora is not set); drop --merge_lora to export its model.")
  params, step = checkpoints.latest(  # no tokenizer: not needed
      job_log_dir, model_overrides.overrides(cfg, lora=lora), families.experiment(cfg, lora))
  if report:
    report(f"read {job_log_dir}: checkpoint step {step}")
  params = merge.dequantized(lora, params)  # a QLoRA base: merged into as trained on
  if lora is None or merge_lora:
    params = params if lora is None else merge.merged(lora, params)
    out = {files.WEIGHTS_FILE: convert.from_params(cfg, params, src["dtypes"]),
           files.CONFIG_FILE: json.dumps(source_cfg, indent=2)}
    out.update(_chat_files(base, source_cfg))
  else:
    out = {peft.ADAPTER_FILE: peft.from_params(cfg, lora, params),
           peft.CONFIG_FILE: json.dumps(peft.adapter_config(
               cfg, lora, src.get("base_model_name_or_path")), indent=2)}
  if replaced:
    targets.clear(hf_dir, replaced)
  files.write_dir(hf_dir, out, report)
  if replaced and report:
    report(targets.replaced_line(hf_dir, replaced))
  return sorted(out)


def _chat_files(base: str, cfg: dict) -> dict[str, bytes | str]:
  """The import's tokenizer files and chat template, and generation_config.json."""
  out = {name: fs.read_bytes(fs.join(base, name))
         for name in files.present(base, files.TOKENIZER_FILES)}
  previous = fs.join(base, files.GENERATION_FILE)
  gen = generation.generation_config(
      cfg, base, json.loads(fs.read_text(previous)) if fs.isfile(previous) else None)
  out[files.GENERATION_FILE] = json.dumps(gen, indent=2) + "\n"
  return out
