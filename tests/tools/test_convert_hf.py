"""Mixture-of-Experts checkpoints in the Hugging Face layout (tools/convert_hf.py): a tiny
random Mixtral and Qwen3-MoE convert, give HF's own logits, and go back out bit-identically;
a Mixtral checkpoint restored by a Llama experiment is a config error naming its experts.

The fixtures (tests/tools/data/{mixtral,qwen3_moe}/: config.json, model.safetensors, HF's
logits.npy of tokens.npy) were written by transformers' MixtralForCausalLM and
Qwen3MoeForCausalLM (tests/tools/data/README.md says how); this test needs no torch.
"""
import json
import os

import jax
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from tests import util
from tools import convert_hf

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_tiny_hf_moe_gives_hf_logits_and_round_trips_bit_identically(tmp_path, family):
  hf, out, back = os.path.join(DATA, family), str(tmp_path / "job"), str(tmp_path / "back")
  with open(os.path.join(hf, "config.json")) as f:
    cfg = json.load(f)
  exp = convert_hf.experiment(cfg)
  assert exp == "moe.MoeImport"
  lines = convert_hf.from_hf(hf, out)
  assert ("task.model.qk_norm=True" in lines) == (family == "qwen3_moe")
  model = util.build_run(exp, lines).task.model
  params = convert_hf.read_checkpoint(out, lines, exp)
  assert params["layers"]["block"]["moe"]["wg"].shape == (
      2, model.moe.num_experts, 64, model.moe.d_ff)
  tokens = np.load(os.path.join(hf, "tokens.npy"))
  ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
  want = np.load(os.path.join(hf, "logits.npy"))
  # float32 both sides, 2 layers of width 64, |logits| <= 8.5: a few ulps of 8.5 each
  # matmul; a token routed to another expert would differ by O(1).
  err = float(np.abs(ours - want).max())
  assert err <= 1e-4, err
  convert_hf.to_hf(out, back)
  got_cfg, got = convert_hf.read_hf(back)
  assert got_cfg == cfg
  _, src = convert_hf.read_hf(hf)
  assert sorted(got) == sorted(src)
  for k in src:
    assert got[k].dtype == src[k].dtype and got[k].tobytes() == src[k].tobytes(), k
  if family == "mixtral":  # restored by a Llama experiment: its experts are named
    dense = [l for l in lines if not l.startswith(("task.model.moe.", "task.model.qk_norm"))]
    with pytest.raises(ConfigError, match=r"(?s)does not match this model's params.*"
                       r"layers/block/moe/router: in the checkpoint, not in the model"):
      convert_hf.read_checkpoint(out, dense, convert_hf.EXP)
