"""DeepSeek checkpoints in the Hugging Face layout (tools/hf_deepseek.py through
tools/convert_hf.py): a tiny random DeepSeek-V3 (MLA with a q latent and YaRN, group
routing with the balancing bias, a dense first layer, a shared expert) and DeepSeek-V2
(a direct q projection, softmax routing, two shared experts) give HF's own logits and go
back out bit-identically; fields the converter cannot express exit 2 naming them; a
DeepSeek checkpoint restored by a Llama experiment (converted back, or a warm start) is a
config error saying so.

The fixtures (tests/tools/data/deepseek_v{2,3}/) were written by transformers 5.23's
DeepseekV3ForCausalLM / DeepseekV2ForCausalLM in float32 (tests/tools/data/make_deepseek.py,
README.md); this test needs no torch.
"""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.run import loop
from tests import util
from tests.tools.test_convert_hf import _assert_bit_identical, _assert_hf_logits, _fixture
from tools import convert_hf


def test_tiny_v3_gives_hf_logits_round_trips_and_is_no_llama(tmp_path):
  hf, cfg, tokens, want = _fixture("deepseek_v3")
  out, back = str(tmp_path / "job"), str(tmp_path / "back")
  exp = convert_hf.experiment(cfg)
  assert exp == "deepseek.DeepSeekImport"
  lines = convert_hf.from_hf(hf, out)
  model = util.build_run(exp, lines).task.model
  # The step-0 checkpoint's params: to_hf below reads them back bit-identically.
  params = convert_hf.to_params(cfg, convert_hf.read_hf(hf)[1])
  moe = params["layers"]["block"]["moe"]
  assert moe["wg"].shape == (2, 8, 64, 32) and moe["score_bias_buffer"].shape == (2, 8)
  assert params["dense_layers"]["block"]["attn"]["q_up"].shape == (1, 32, 4, 16)
  _assert_hf_logits(model, params, tokens, want)
  convert_hf.to_hf(out, back)
  got_cfg, got = convert_hf.read_hf(back)
  assert got_cfg == cfg
  _assert_bit_identical(got, convert_hf.read_hf(hf)[1])
  # Restored by a Llama experiment of the same dims: one paragraph naming the attention.
  llama = [l for l in lines if not l.startswith(("task.model.moe.", "task.model.mla."))]
  no_llama = (r"(?s)does not match this model's params.*The checkpoint's attention is "
              r"multi-head latent attention \(DeepSeek")
  with pytest.raises(ConfigError, match=no_llama):
    convert_hf.read_checkpoint(out, llama, convert_hf.EXP)
  # The same as a Llama job's warm start (task.train.init_checkpoint_dir), in the loop.
  run = util.build_run(convert_hf.EXP, llama + [f"task.train.init_checkpoint_dir={out!r}",
                                                "task.train.num_train_steps=0"])
  with pytest.raises(ConfigError, match=no_llama):
    loop.train(run, job_log_dir=str(tmp_path / "warm"))


def test_tiny_v2_gives_hf_logits_and_round_trips_bit_identically():
  hf, cfg, tokens, want = _fixture("deepseek_v2")
  lines = convert_hf.overrides(cfg)
  assert "task.model.mla.q_lora_rank=None" in lines
  model = util.build_run(convert_hf.experiment(cfg), lines).task.model
  _, tensors = convert_hf.read_hf(hf)
  params = convert_hf.to_params(cfg, tensors)
  assert "q" in params["layers"]["block"]["attn"]
  _assert_hf_logits(model, params, tokens, want)
  dtypes = {k: str(v.dtype) for k, v in tensors.items()}
  _assert_bit_identical(convert_hf.from_params(cfg, params, dtypes), tensors)


@pytest.mark.parametrize("family,edit,named", [
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                         "factor": 4.0, "original_max_position_embeddings":
                                         32, "attention_factor": 1.2}}, "attention_factor")])
def test_fields_the_converter_cannot_express_exit_2_naming_them(tmp_path, capsys, monkeypatch,
                                                                family, edit, named):
  hf = str(tmp_path / family)
  shutil.copytree(_fixture(family)[0], hf)
  with open(os.path.join(hf, "config.json")) as f:
    cfg = json.load(f)
  with open(os.path.join(hf, "config.json"), "w") as f:
    json.dump({**cfg, **edit}, f)
  job = str(tmp_path / "job")
  monkeypatch.setattr(sys, "argv", ["convert_hf.py", f"--from_hf={hf}", f"--job_log_dir={job}"])
  with pytest.raises(SystemExit) as e:
    convert_hf.main()
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert named in err and len(err.splitlines()) == 1, err
  assert not os.path.exists(job)  # nothing written
