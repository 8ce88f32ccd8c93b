"""Gemma 3 checkpoints (spmdtask/hf/gemma3.py; the command tools/convert_hf.py): a tiny random
Gemma3ForCausalLM (local and global layers, a window shorter than the row, linear RoPE
scaling on the global layers, query_pre_attn_scalar != head_dim) converts, gives HF's logits
(<= 1e-4) and goes back out bit-identically; a multimodal gemma3 checkpoint's language model
converts the same; a config field the converter cannot express exits 2 naming it.
Fixture: tests/tools/data/gemma3 (tests/tools/data/README.md says how it was made)."""
import json
import os
import sys

import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.hf import convert, families, files, gemma3, model_overrides
from tests import util
from tests.hf import checks
from tests import subproc as h


def test_tiny_hf_gemma3_gives_hf_logits_and_round_trips_bit_identically():
  """In memory (tests/hf/test_moe.py runs the files' path: checkpoint, hf_source, --to_hf)."""
  hf, cfg, tokens, want = checks.fixture("gemma3")
  lines = model_overrides.overrides(cfg)
  assert "task.model.attention_pattern=('local', 'local', 'global')" in lines  # 4 layers
  assert {"task.model.sliding_window=5", "task.model.rope_scaling.factor=8.0",
          "task.model.local_rope_theta=10000.0", f"task.model.attention_scale={12 ** -0.5!r}",
          "task.model.norm_offset=1.0", "task.model.sandwich_norms=True"} <= set(lines)
  assert families.experiment(cfg) == "gemma3.Gemma3Import"
  model = util.build_run(families.experiment(cfg), lines).task.model
  tensors = files.read_hf(hf)[1]
  params = convert.to_params(cfg, tensors)
  checks.assert_hf_logits(model, params, tokens, want)
  dtypes = {k: str(v.dtype) for k, v in tensors.items()}
  checks.assert_bit_identical(convert.from_params(cfg, params, dtypes), tensors)


def test_the_language_model_of_a_multimodal_gemma3_converts(tmp_path):
  """A gemma3 (Gemma3ForConditionalGeneration) checkpoint: its text_config (hub configs
  leave transformers' defaults out) and the tensors under its language model; the vision
  tower is not read."""
  hf, cfg, tokens, want = checks.fixture("gemma3")
  tensors = files.read_hf(hf)[1]
  text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
  del text["rms_norm_eps"]  # the default: filled in
  multi = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {**text, "model_type": "gemma3_text"}, "vision_config": {}}
  named = {"model.language_model." + k.removeprefix("model."): v for k, v in tensors.items()}
  named["model.vision_tower.patch_embedding.weight"] = np.zeros((4, 3), np.float32)
  got_cfg, got = gemma3.text_half(multi, named)
  assert sorted(got) == sorted(tensors)
  params = convert.to_params(got_cfg, got)
  model = util.build_run(families.experiment(multi), model_overrides.overrides(multi)).task.model
  checks.assert_hf_logits(model, params, tokens, want)


@pytest.mark.parametrize("key,value", [("final_logit_softcapping", 30.0),
                                       ("use_bidirectional_attention", True)])
def test_an_unsupported_field_is_refused_by_name(key, value):
  cfg = checks.fixture("gemma3")[1]
  with pytest.raises(ConfigError, match=f"{key}={value!r} is not supported"):
    model_overrides.overrides({**cfg, key: value})


def test_an_unsupported_field_exits_2_naming_it(tmp_path):
  hf, cfg, _, _ = checks.fixture("gemma3")
  bad = tmp_path / "hf"
  bad.mkdir()
  (bad / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
  (bad / "model.safetensors").write_bytes(open(os.path.join(hf, "model.safetensors"), "rb").read())
  r = h.run([sys.executable, "tools/convert_hf.py", f"--from_hf={bad}",
             f"--job_log_dir={tmp_path / 'job'}"], 1)
  assert r.returncode == 2, r.stderr[-2000:]
  line, = r.stderr.strip().splitlines()
  assert "attn_logit_softcapping=50.0 is not supported" in line, line
  assert not (tmp_path / "job").exists()
