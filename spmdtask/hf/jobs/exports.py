"""--to_hf: a Hugging Face directory from a job's latest checkpoint: config.json and
model.safetensors of a full model; of a LoRA job its adapter in PEFT's format, or the
merged model (W + (alpha / r)·A·B) as a plain checkpoint.
"""
import json
import re

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.hf import convert, families, files, merge, model_overrides, peft
from spmdtask.hf.jobs import checkpoints
from spmdtask.hf.jobs.imports import SOURCE_FILE, source


def import_of(job_log_dir: str) -> str | None:
  """The --from_hf job a job started from: its task.train.init_checkpoint_dir, or that
  job's, and so on (a chain of stages: configs/stages.py), up to one with SOURCE_FILE."""
  job = job_log_dir
  for _ in range(100):  # a loop of job dirs ends here
    text = fs.join(job, "config.txt")
    job = peft.warm_start_job(fs.read_text(text)) if fs.isfile(text) else None
    if job is None or fs.isfile(fs.join(job, SOURCE_FILE)):
      return job
  return None


def to_hf(job_log_dir: str, hf_dir: str, merge_lora: bool = False,
          base_job: str | None = None) -> list[str]:
  """Writes `hf_dir` from the latest checkpoint of job_log_dir; of a LoRA job
  (hf_source.json names its LoRA), the adapter in PEFT's format, or with `merge_lora` the
  merged model. `base_job`: the --from_hf job a LoRA job elsewhere warm-started from
  (default: the import its chain of init_checkpoint_dirs starts at, `import_of`; its
  config.txt gives the adapters). Returns the
  files' names."""
  text = fs.join(job_log_dir, "config.txt")
  given = base_job is not None
  if base_job is None and not fs.isfile(fs.join(job_log_dir, SOURCE_FILE)) and fs.isfile(text):
    base_job = import_of(job_log_dir)
  where = f"--base_job={base_job!r}" if base_job else f"--job_log_dir={job_log_dir!r}"
  if not fs.isfile(fs.join(base_job or job_log_dir, SOURCE_FILE)):
    raise ConfigError(f"{where} has no {SOURCE_FILE}; --to_hf converts back a job made by "
                      "--from_hf (it holds the HF config), or with --base_job=THAT_JOB a LoRA "
                      "job warm-started from one.")
  src = source(base_job or job_log_dir)
  lora, source_cfg = src.get("lora"), src["config"]
  family = families.of(source_cfg)
  cfg = family.held(source_cfg, src["dtypes"])[0]  # a DeepSeek-V3's MTP layers as read
  if base_job is not None:
    config_text = fs.read_text(text) if fs.isfile(text) else ""
    lora = (peft.job_lora(config_text, text)  # a stage without LoRA: its whole params
            if given or re.search(r"^task\.model\.lora\.rank = \d", config_text, re.M)
            else None)
  if merge_lora and lora is None:
    raise ConfigError(f"--merge_lora: the job {job_log_dir!r} has no LoRA adapters (its "
                      f"{SOURCE_FILE} names none); drop --merge_lora to export its model.")
  params = checkpoints.read_checkpoint(  # no tokenizer: not needed
      job_log_dir, model_overrides.overrides(cfg, lora=lora), families.experiment(cfg, lora))
  if lora is None or merge_lora:
    params = params if lora is None else merge.merged(lora, params)
    out = {files.WEIGHTS_FILE: convert.from_params(cfg, params, src["dtypes"]),
           files.CONFIG_FILE: json.dumps(source_cfg, indent=2)}
  else:
    out = {peft.ADAPTER_FILE: peft.from_params(cfg, lora, params),
           peft.CONFIG_FILE: json.dumps(peft.adapter_config(
               cfg, lora, src.get("base_model_name_or_path")), indent=2)}
  files.write_dir(hf_dir, out)
  return sorted(out)
