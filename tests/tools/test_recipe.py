"""The README's fine-tuning recipe, run as written on examples/tiny_chat: the commands are
read from README.md itself (the bash block after its "Fine-tune on your conversations"
lead), /tmp/chat moved under the test's tmp dir, each run in a subprocess on one CPU device.
"""
import json
import os
import re
import shlex
import sys

import numpy as np
import pytest

from spmdtask.run import checkpoints
from tests import subproc as h
from tools import convert_hf, hf_lora

LEAD = "**Fine-tune on your conversations**"
MODEL = os.path.join(h.REPO, "examples", "tiny_chat", "model")
EOT = 6  # <|eot_id|> of the tiny model's tokenizer


def recipe_commands(readme: str) -> list[list[str]]:
  """The argv of each command in the first bash block after the recipe's lead."""
  text = open(readme, encoding="utf-8").read()
  block = re.search(r"```bash\n(.*?)```", text[text.index(LEAD):], re.S).group(1)
  return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _peft_shapes() -> dict[str, tuple[int, int]]:
  """PEFT's key -> shape for rank 8 on every linear of the tiny model (2 layers, d 64,
  4 heads / 2 KV heads of 16, MLP 128)."""
  dims = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32),
          "self_attn.v_proj": (64, 32), "self_attn.o_proj": (64, 64),
          "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128), "mlp.down_proj": (128, 64)}
  out = {}
  for layer in range(2):
    for module, (d_in, d_out) in dims.items():
      key = f"base_model.model.model.layers.{layer}.{module}"
      out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = (8, d_in), (d_out, 8)
  return out


@pytest.mark.slow
def test_the_readme_recipe_runs_as_written(tmp_path):
  out = str(tmp_path / "chat")
  commands = recipe_commands(os.path.join(h.REPO, "README.md"))
  assert [c[:2] for c in commands] == [
      ["python", "tools/convert_hf.py"], ["python", "tools/prepare_chat_data.py"],
      ["python", "-m"], ["python", "-m"], ["python", "tools/convert_hf.py"]]
  stdout = []
  for argv in commands:
    argv = [sys.executable] + [a.replace("/tmp/chat", out) for a in argv[1:]]
    r = h.run(argv, num_devices=1)
    assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-2000:])
    stdout.append(r.stdout)
  base, lora, adapter = (os.path.join(out, n) for n in ("base", "lora", "adapter"))

  # Training: the masked loss falls over the 50 steps; eval ran on the eval split.
  losses = h.train_losses(lora)
  first, last = losses[min(losses)], losses[max(losses)]
  assert max(losses) == 50 and last < first - 0.25, losses
  evals = [json.loads(l) for l in open(os.path.join(lora, "eval_metrics.jsonl"))]
  assert evals[-1]["dataset"] == "eval" and evals[-1]["step"] == 50, evals
  assert evals[-1]["weight"] > 0 and np.isfinite(evals[-1]["loss"]), evals

  # Decode: every prompt rendered with the template, stopped at end-of-turn or the length.
  rows = [json.loads(l) for l in open(os.path.join(lora, "decoder_out",
                                                   "own_prompts_step50.jsonl"))]
  prompts = [json.loads(l)["messages"][-1]["content"] for l in open(
      os.path.join(h.REPO, "examples", "tiny_chat", "prompts.jsonl"))]
  assert [r["id"] for r in rows] == [0, 1, 2, 3]
  for r, asked in zip(rows, prompts):
    assert r["prompt_text"] == (f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>"
                                f"\n\n{asked}<|eot_id|><|start_header_id|>assistant"
                                "<|end_header_id|>\n\n"), r
    ids, stopped = r["output_ids"], r["output_text"].endswith("<|eot_id|>")
    assert EOT not in ids[:-1] and (ids[-1] == EOT) == stopped, r
    assert stopped or len(r["prompt_ids"]) + len(ids) == 64, r
    assert asked in stdout[3]  # the console shows each prompt and its answer
  assert stdout[3].count("  prompt ") == 4

  # The adapter: PEFT's keys and shapes, rank 8, trained (B no longer 0).
  cfg, tensors = hf_lora.read(adapter)
  assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0
  assert {k: v.shape for k, v in tensors.items()} == _peft_shapes()
  assert all(np.abs(v).max() > 0 for k, v in tensors.items() if "lora_B" in k)

  # The LoRA job's checkpoints hold only the adapters and name the import as their base;
  # restored, its frozen params are the import's, bit for bit.
  meta = checkpoints.read_meta(lora)
  assert meta["params_held"] == "adapters" and meta["lora_base"]["dir"].endswith("base"), meta
  hf_cfg = convert_hf.read_hf(MODEL)[0]
  imported = convert_hf.read_checkpoint(base, convert_hf.overrides(hf_cfg), "llama.LlamaImport")
  trained = convert_hf.read_checkpoint(lora, convert_hf.overrides(
      hf_cfg, lora=hf_lora.lora_fields(cfg, adapter)), "finetune.LlamaLoraImport")
  flat_base = dict(_flatten(imported))
  flat_lora = dict(_flatten(trained))
  assert set(flat_base) < set(flat_lora)
  for path, value in flat_base.items():
    assert flat_lora[path].dtype == value.dtype and flat_lora[path].tobytes() == value.tobytes(), path
  # The exported adapter read back (--from_hf --adapter) is the trained one.
  again = os.path.join(out, "again")
  back = convert_hf.read_checkpoint(again, convert_hf.from_hf(MODEL, again, adapter),
                                    "finetune.LlamaLoraImport")
  for path, value in _flatten(back):
    np.testing.assert_allclose(value, flat_lora[path], rtol=0, atol=1e-6, err_msg=path)


def _flatten(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flatten(v, f"{prefix}{k}/")
    else:
      yield f"{prefix}{k}", np.asarray(v)
