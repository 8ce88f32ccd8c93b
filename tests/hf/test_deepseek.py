"""DeepSeek checkpoints in the Hugging Face layout (spmdtask/hf/deepseek.py; the command
tools/convert_hf.py): a tiny random DeepSeek-V3 (MLA with a q latent and YaRN, group
routing with the balancing bias, a dense first layer, a shared expert, a multi-token-
prediction layer) and DeepSeek-V2 (a direct q projection, softmax routing, two shared
experts) give HF's own logits and go back out bit-identically; an MTP layer whose copy of
the head differs is refused, one that is absent or skipped imports without MTP; fields
the converter cannot express exit 2 naming them; a DeepSeek checkpoint restored by a Llama
experiment (converted back, or a warm start) is a config error saying so.

The fixtures (tests/tools/data/deepseek_v{2,3}/) were written by transformers 5.23's
DeepseekV3ForCausalLM / DeepseekV2ForCausalLM in float32 (tests/tools/data/make_deepseek.py,
README.md); this test needs no torch. transformers' DeepseekV3 has no MTP layer (its
config says num_nextn_predict_layers 1, its checkpoint holds none): `_with_mtp` writes one
from numpy, in the hub checkpoint's names, beside the fixture's tensors.
"""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from safetensors import numpy as st_numpy

from spmdtask.errors import ConfigError
from spmdtask.hf import convert, deepseek, families, files, llama, model_overrides
from spmdtask.hf.jobs import checkpoints, exports, imports
from spmdtask.run import loop
from tests import util
from tests.hf import checks
from tools import convert_hf

LLAMA = llama.FAMILY.experiment


def _with_mtp(tmp_path) -> str:
  """The deepseek_v3 fixture with an MTP layer (model.layers.3, an MoE layer) of random
  float32 tensors; its embed_tokens and shared_head.head copies of the main ones."""
  hf, cfg, _, _ = checks.fixture("deepseek_v3")
  tensors = files.read_hf(hf)[1]
  rng, d, p = np.random.default_rng(0), cfg["hidden_size"], "model.layers.3."
  new = {p + k.removeprefix("model.layers.2."): v for k, v in tensors.items()
         if k.startswith("model.layers.2.")}
  new.update({p + "eh_proj.weight": np.zeros((d, 2 * d), np.float32),
              **{p + n + ".weight": np.ones((d,), np.float32)
                 for n in ("enorm", "hnorm", "shared_head.norm")},
              p + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
              p + "shared_head.head.weight": tensors["lm_head.weight"]})
  new = {k: (v if k.endswith("head.weight") or "embed" in k else
             v + rng.normal(0, 0.3, v.shape).astype(np.float32)) for k, v in new.items()}
  out = tmp_path / "deepseek_v3_mtp"
  shutil.copytree(hf, out)
  st_numpy.save_file({**tensors, **new}, str(out / "model.safetensors"), {"format": "pt"})
  return str(out)


def test_tiny_v3_gives_hf_logits_round_trips_and_is_no_llama(tmp_path):
  _, cfg, tokens, want = checks.fixture("deepseek_v3")
  hf = _with_mtp(tmp_path)
  out, back = str(tmp_path / "job"), str(tmp_path / "back")
  exp = families.experiment(cfg)
  assert exp == "deepseek.DeepSeekImport"
  lines = imports.from_hf(hf, out)
  assert "task.model.mtp_depth=1" in lines
  model = util.build_run(exp, lines).task.model
  # The step-0 checkpoint's params: to_hf below reads them back bit-identically.
  tensors = files.read_hf(hf)[1]
  params = convert.to_params(cfg, tensors)
  moe = params["layers"]["block"]["moe"]
  assert moe["wg"].shape == (2, 8, 64, 32) and moe["score_bias_buffer"].shape == (2, 8)
  assert params["dense_layers"]["block"]["attn"]["q_up"].shape == (1, 32, 4, 16)
  mtp = params["mtp"]
  np.testing.assert_array_equal(mtp["eh_proj"][0], tensors["model.layers.3.eh_proj.weight"].T)
  assert mtp["block"]["moe"]["wg"].shape == (1, 8, 64, 32)
  checks.assert_hf_logits(model, params, tokens, want)  # decode's logits: MTP plays no part
  exports.to_hf(out, back)
  got_cfg, got = files.read_hf(back)
  assert got_cfg == cfg
  checks.assert_bit_identical(got, tensors)
  # A head copy that differs is refused; a checkpoint without the layer (transformers'
  # fixture), or --skip_mtp, imports without MTP, one line saying so.
  bad = dict(tensors, **{"model.layers.3.shared_head.head.weight": tensors["lm_head.weight"] + 1})
  with pytest.raises(ConfigError, match="shared_head.head.weight' differs from 'lm_head"):
    convert.to_params(cfg, bad)
  plain = files.read_hf(checks.fixture("deepseek_v3")[0])[1]
  for names, skip in ((plain, False), (tensors, True)):
    held, kept, note = deepseek.held(cfg, names, skip)
    assert held["num_nextn_predict_layers"] == 0 and "task.model.mtp_depth=0" in note
    assert not any(k.startswith("model.layers.3.") for k in kept)
  # Restored by a Llama experiment of the same dims: one paragraph naming the attention.
  dense = [l for l in lines
           if not l.startswith(("task.model.moe.", "task.model.mla.", "task.model.mtp_"))]
  no_llama = (r"(?s)does not match this model's params.*The checkpoint's attention is "
              r"multi-head latent attention \(DeepSeek")
  with pytest.raises(ConfigError, match=no_llama):
    checkpoints.read_checkpoint(out, dense, LLAMA)
  # The same as a Llama job's warm start (task.train.init_checkpoint_dir), in the loop.
  run = util.build_run(LLAMA, dense + [f"task.train.init_checkpoint_dir={out!r}",
                                       "task.train.num_train_steps=0"])
  with pytest.raises(ConfigError, match=(r"(?s)is not a start for this model.*The "
                                         r"checkpoint's attention is multi-head latent")):
    loop.train(run, job_log_dir=str(tmp_path / "warm"))


def test_tiny_v2_gives_hf_logits_and_round_trips_bit_identically():
  hf, cfg, tokens, want = checks.fixture("deepseek_v2")
  lines = model_overrides.overrides(cfg)
  assert "task.model.mla.q_lora_rank=None" in lines
  model = util.build_run(families.experiment(cfg), lines).task.model
  _, tensors = files.read_hf(hf)
  params = convert.to_params(cfg, tensors)
  assert "q" in params["layers"]["block"]["attn"]
  checks.assert_hf_logits(model, params, tokens, want)
  dtypes = {k: str(v.dtype) for k, v in tensors.items()}
  checks.assert_bit_identical(convert.from_params(cfg, params, dtypes), tensors)


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
  shutil.copytree(checks.fixture(family)[0], hf)
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
