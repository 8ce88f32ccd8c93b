"""Qwen3 dense checkpoints in the Hugging Face layout (spmdtask/hf/qwen3.py): a tiny random
Qwen3 (tests/tools/data/qwen3/, written by transformers' Qwen3ForCausalLM) gives HF's own
logits and goes back out bit-identically; this test needs no torch.
"""
from spmdtask.hf import convert, families, files, model_overrides
from tests import util
from tests.hf import checks


def test_tiny_hf_qwen3_gives_hf_logits_and_round_trips_bit_identically():
  """Qwen3 dense: Llama's layer with QK-norm, tied (unscaled) embeddings."""
  hf, cfg, tokens, want = checks.fixture("qwen3")
  lines = model_overrides.overrides(cfg)
  assert families.experiment(cfg) == "qwen3.Qwen3Import"
  assert {"task.model.qk_norm=True", "task.model.tie_embeddings=True",
          "task.model.scale_tied_logits=False"} <= set(lines)
  model = util.build_run(families.experiment(cfg), lines).task.model
  tensors = files.read_hf(hf)[1]
  params = convert.to_params(cfg, tensors)
  assert "unembed" not in params
  checks.assert_hf_logits(model, params, tokens, want)
  dtypes = {k: str(v.dtype) for k, v in tensors.items()}
  checks.assert_bit_identical(convert.from_params(cfg, params, dtypes), tensors)
