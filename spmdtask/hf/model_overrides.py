"""model_overrides.txt: the `--fdl_set` lines that make a family's import experiment build
the model of a HF config (an absl --flagfile, one `--fdl_set=...` a line). Pure.
"""
from spmdtask.hf import deepseek, families

OVERRIDES_FILE = "model_overrides.txt"


def overrides(cfg: dict, tokenizer: str | None = None, lora: dict | None = None) -> list[str]:
  """`--fdl_set` values that make `families.experiment(cfg, lora)` build this model (its
  synthetic data, used without --data_dir, in vocab); `tokenizer`, a tokenizer.json path,
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
  lines += [f"datasets['{s}'].synthetic.vocab_size={cfg['vocab_size']}" for s in ("train", "eval")]
  lines.append(f"decode_datasets['prompts'].default.vocab_size={cfg['vocab_size']}")
  if isinstance(cfg.get("eos_token_id"), int):
    lines.append(f"task.decode.eos_id={cfg['eos_token_id']}")
  if tokenizer:
    lines.append(f"decode_datasets['prompts'].default.tokenizer={'hf:' + tokenizer!r}")
  lines += [f"task.model.lora.{k}={tuple(v) if k == 'targets' else v!r}"
            for k, v in (lora or {}).items()]
  return lines


def flagfile(lines: list[str]) -> str:
  """model_overrides.txt's text of override `lines`."""
  return "".join(f"--fdl_set={line}\n" for line in lines)
