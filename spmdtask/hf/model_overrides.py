"""model_overrides.txt: the `--fdl_set` lines that make a family's import experiment (and
the stage experiments) build the model of a HF config (an absl --flagfile: `--family=`,
then one `--fdl_set=...` a line). Pure.
"""
from spmdtask.hf import deepseek, families

OVERRIDES_FILE = "model_overrides.txt"


def overrides(cfg: dict, tokenizer: str | None = None, lora: dict | None = None) -> list[str]:
  """`--fdl_set` values that make `families.experiment(cfg, lora)` build this model (and the
  stage experiments, configs/stages.py: model fields, eos and the tokenizer only; the
  experiments take the data's vocabulary from the model); `tokenizer`, a tokenizer.json path,
  gives the decode output its text; `lora` (LoraConfig fields) sets the adapters' rank,
  alpha, dropout and targets."""
  cfg = families.of(cfg).text_config(cfg)  # a multimodal Gemma 3: its language model's
  fields = families.model_fields(cfg)
  scaling, moe, mla = fields.pop("rope_scaling"), fields.pop("moe", {}), fields.pop("mla", None)
  lines = [f"task.model.{k}={v!r}" for k, v in fields.items()]
  lines += [f"task.model.moe.{k}={v!r}" for k, v in moe.items()] + deepseek.override_lines(mla)
  if scaling is None:
    lines.append("task.model.rope_scaling=None")
  else:  # the import's model has a Llama3Scaling config: its fields are set one by one
    lines += [f"task.model.rope_scaling.{k}={v!r}" for k, v in scaling.items()]
  if isinstance(cfg.get("eos_token_id"), int):
    lines.append(f"task.decode.eos_id={cfg['eos_token_id']}")
  if tokenizer:
    lines.append(f"decode_datasets['prompts'].default.tokenizer={'hf:' + tokenizer!r}")
  lines += [f"task.model.lora.{k}={tuple(v) if k == 'targets' else v!r}"
            for k, v in (lora or {}).items()]
  return lines


def flagfile(lines: list[str], family: str) -> str:
  """model_overrides.txt's text: `--family=` (config.json's model_type: the stage experiments
  build that family's model: spmdtask/overrides.py's Start) and the override `lines`."""
  return f"--family={family}\n" + "".join(f"--fdl_set={line}\n" for line in lines)
