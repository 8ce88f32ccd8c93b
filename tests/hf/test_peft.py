"""LoRA adapters in and out of PEFT's format (spmdtask/hf/peft.py, merge.py; the command
tools/convert_hf.py):
a PEFT adapter imported onto its base gives PEFT's logits; exported back it is the same
tensors and an adapter_config.json PEFT loads; --merge_lora gives the merged model's logits;
an adapter made for another architecture is a ConfigError (exit 2) that writes nothing.

The fixture (tests/tools/data/peft/: a PEFT adapter of tests/tools/data/llama/ with random
nonzero A and B, PEFT's logits and the merged model's) was made with peft and torch
(tests/tools/data/README.md, which also records PEFT loading this export); no torch here.
"""
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.hf import convert, families, files, llama, peft
from spmdtask.hf.jobs import checkpoints, exports, imports
from tests import subproc as h
from tests import util
from tests.hf import checks

DATA = checks.DATA
BASE, PEFT = os.path.join(DATA, "llama"), os.path.join(DATA, "peft")
LLAMA = llama.FAMILY.experiment


def _logits(exp, lines, params):
  model = util.build_run(exp, lines).task.model
  tokens = np.load(os.path.join(PEFT, "tokens.npy"))
  return np.asarray(jax.jit(model.apply)({"params": params}, tokens))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """(job dir, override lines) of the fixture base + adapter through --from_hf --adapter."""
  job = str(tmp_path_factory.mktemp("peft") / "job")
  return job, imports.from_hf(BASE, job, PEFT)


def test_a_peft_adapter_imported_gives_pefts_logits(imported, capsys):
  job, lines = imported
  exp = "finetune.LlamaLoraImport"
  assert "task.model.lora.rank=4" in lines and "task.model.lora.alpha=8.0" in lines
  params = checkpoints.read_checkpoint(job, lines, exp)
  assert params["layers"]["block"]["attn"]["o_lora_a"].shape == (2, 4, 8, 4)  # [L, h, hd, r]
  assert params["layers"]["block"]["mlp"]["wo_lora_b"].shape == (2, 4, 32)    # [L, r, d]
  want = np.load(os.path.join(PEFT, "logits.npy"))
  err = float(np.abs(_logits(exp, lines, params) - want).max())
  # float32 both sides, |logits| <= 12: rounding, far below the adapter's effect (4.75).
  assert err <= 1e-4, err
  with open(os.path.join(job, imports.SOURCE_FILE)) as f:
    assert json.load(f)["base_model_name_or_path"] == "tiny-llama"


def test_export_gives_the_same_tensors_and_a_config_peft_reads(imported, tmp_path):
  job, _ = imported
  out = str(tmp_path / "adapter")
  assert exports.to_hf(job, out) == [peft.CONFIG_FILE, peft.ADAPTER_FILE]
  want_cfg, want = peft.read(PEFT)
  got_cfg, got = peft.read(out)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    assert got[k].dtype == np.float32
  for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias",
              "base_model_name_or_path", "use_rslora", "use_dora", "fan_in_fan_out"):
    assert got_cfg[key] == want_cfg[key], key
  assert sorted(got_cfg["target_modules"]) == sorted(want_cfg["target_modules"])
  base = files.read_hf(BASE)[0]
  assert peft.lora_fields(base, got_cfg, "x") == peft.lora_fields(base, want_cfg, "x")


def test_merge_lora_export_gives_the_merged_models_logits(imported, tmp_path):
  job, _ = imported
  merged, again = str(tmp_path / "merged"), str(tmp_path / "again")
  assert exports.to_hf(job, merged, merge_lora=True) == [
      "config.json", "generation_config.json", "model.safetensors"]
  lines = imports.from_hf(merged, again)  # a plain Llama now: no adapter tensors
  params = checkpoints.read_checkpoint(again, lines, LLAMA)
  assert "q_lora_a" not in params["layers"]["block"]["attn"]
  err = float(np.abs(_logits(LLAMA, lines, params)
                     - np.load(os.path.join(PEFT, "merged_logits.npy"))).max())
  assert err <= 1e-4, err
  with pytest.raises(ConfigError, match="--merge_lora: the job .* has no LoRA adapters"):
    exports.to_hf(again, str(tmp_path / "none"), merge_lora=True)


def _broken(tmp_path, edit_cfg=None, edit_tensors=None) -> str:
  """A copy of the fixture adapter with its config and/or tensors edited."""
  out = tmp_path / "bad_adapter"
  shutil.copytree(PEFT, out)
  cfg, tensors = peft.read(str(out))
  if edit_cfg:
    edit_cfg(cfg)
    (out / peft.CONFIG_FILE).write_text(json.dumps(cfg))
  if edit_tensors:
    from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
    edit_tensors(tensors)
    st_numpy.save_file(tensors, str(out / peft.ADAPTER_FILE))
  return str(out)


def _gpt2_modules(cfg):
  cfg["target_modules"] = ["c_attn", "q_proj"]


def _rank_8(tensors):
  key = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
  tensors[key] = np.zeros((8, 32), np.float32)


def _third_layer(tensors):
  tensors["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"] = np.zeros(
      (4, 32), np.float32)


@pytest.mark.parametrize("edit_cfg,edit_tensors,message", [
    (_gpt2_modules, None, r"target_modules names \['c_attn'\].*another architecture"),
    (None, _rank_8, r"up_proj.lora_A.weight is \[8, 32\], this model needs \[4, 32\]"),
    (None, _third_layer, r"no place for.*layers.2.self_attn"),
    (lambda c: c.update(use_dora=True), None, r"use_dora=True is not supported"),
    (lambda c: c.update(peft_type="IA3"), None, r"peft_type='IA3'"),
], ids=["modules", "shape", "layers", "dora", "ia3"])
def test_an_adapter_for_another_architecture_is_refused_writing_nothing(
    tmp_path, edit_cfg, edit_tensors, message):
  adapter, job = _broken(tmp_path, edit_cfg, edit_tensors), str(tmp_path / "job")
  with pytest.raises(ConfigError, match=message):
    imports.from_hf(BASE, job, adapter)
  assert not os.path.exists(job)


def test_the_command_line_exits_2_and_only_warns_of_another_base_name(tmp_path):
  adapter, job = _broken(tmp_path, _gpt2_modules), str(tmp_path / "job")
  r = h.run([sys.executable, "tools/convert_hf.py", f"--from_hf={BASE}",
             f"--adapter={adapter}", f"--job_log_dir={job}"], num_devices=1)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "c_attn" in r.stderr and "Traceback" not in r.stderr and not os.path.exists(job)
  cfg = {"base_model_name_or_path": "someone/other-llama"}
  assert "warning" in peft.base_mismatch(cfg, BASE, {})
  assert peft.base_mismatch({"base_model_name_or_path": "x/llama"}, BASE, {}) is None


def test_new_adapters_start_as_peft_does_and_export(tmp_path):
  """--lora_rank: fresh adapters on the imported base (B = 0: the base model's logits),
  exported as a PEFT adapter; rank 0 is refused before anything is written."""
  job, out = str(tmp_path / "job"), str(tmp_path / "adapter")
  new = {"r": 2, "lora_alpha": 4.0, "target_modules": "all-linear"}
  lines = imports.from_hf(BASE, job, new_lora=new)
  params = checkpoints.read_checkpoint(job, lines, "finetune.LlamaLoraImport")
  attn = params["layers"]["block"]["attn"]
  assert attn["q_lora_a"].shape == (2, 32, 2) and not attn["q_lora_b"].any()
  assert np.abs(attn["q_lora_a"]).max() > 0
  plain = convert.to_params(*files.read_hf(BASE))
  np.testing.assert_array_equal(attn["q"], plain["layers"]["block"]["attn"]["q"])
  exports.to_hf(job, out)
  cfg, tensors = peft.read(out)
  assert cfg["r"] == 2 and cfg["lora_alpha"] == 4.0 and len(tensors) == 2 * 7 * 2
  with pytest.raises(ConfigError, match=r"r=0"):
    imports.from_hf(BASE, str(tmp_path / "bad"), new_lora={**new, "r": 0})
  assert not os.path.exists(tmp_path / "bad")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_peft_adapters_of_an_moe_are_refused(model_type):
  """Expert adapters (layers.lora target `experts`) have no PEFT layout here: an MoE's LoRA
  neither comes in (--adapter, --lora_rank) nor goes out (--to_hf) in PEFT's format."""
  with pytest.raises(ConfigError, match=rf"model_type='{model_type}': LoRA adapters in and "
                     r"out of PEFT are supported for 'llama' models only"):
    families.lora_experiment({"model_type": model_type})
