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
from tests import subproc as h
from tests import util
from tools import convert_hf

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _fixture(family):
  hf = os.path.join(DATA, family)
  with open(os.path.join(hf, "config.json")) as f:
    cfg = json.load(f)
  tokens, want = (np.load(os.path.join(hf, n)) for n in ("tokens.npy", "logits.npy"))
  return hf, cfg, tokens, want


def _assert_hf_logits(model, params, tokens, want):
  ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
  # float32 both sides, 2 layers of width 64, |logits| <= 8.5: a few ulps of 8.5 per
  # matmul; a token routed to another expert would differ by O(1).
  err = float(np.abs(ours - want).max())
  assert err <= 1e-4, err


def _assert_bit_identical(got, want):
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


def test_tiny_hf_mixtral_gives_hf_logits_and_round_trips_bit_identically(tmp_path):
  hf, cfg, tokens, want = _fixture("mixtral")
  out, back = str(tmp_path / "job"), str(tmp_path / "back")
  exp = convert_hf.experiment(cfg)
  assert exp == "moe.MoeImport"
  lines = convert_hf.from_hf(hf, out)
  model = util.build_run(exp, lines).task.model
  params = convert_hf.read_checkpoint(out, lines, exp)  # through the step-0 checkpoint
  assert params["layers"]["block"]["moe"]["wg"].shape == (2, 4, 64, 96)  # [L, E, d, f]
  _assert_hf_logits(model, params, tokens, want)
  convert_hf.to_hf(out, back)
  got_cfg, got = convert_hf.read_hf(back)
  assert got_cfg == cfg
  _assert_bit_identical(got, convert_hf.read_hf(hf)[1])
  # Restored by a Llama experiment (the same dims, no experts): a config error naming them.
  dense = [l for l in lines if not l.startswith(("task.model.moe.", "task.model.qk_norm"))]
  with pytest.raises(ConfigError, match=r"(?s)does not match this model's params.*"
                     r"layers/block/moe/router: in the checkpoint, not in the model"):
    convert_hf.read_checkpoint(out, dense, convert_hf.EXP)


@pytest.mark.slow
def test_a_mixtral_checkpoint_run_by_a_llama_experiment_exits_2_naming_its_experts(tmp_path):
  """The same mistake from the command line: one paragraph, exit 2, the checkpoint intact."""
  hf, cfg, _, _ = _fixture("mixtral")
  out = str(tmp_path / "job")
  lines = convert_hf.from_hf(hf, out)
  dense = [l for l in lines if not l.startswith(("task.model.moe.", "task.model.qk_norm"))]
  flagfile = tmp_path / "dense_overrides.txt"
  flagfile.write_text("".join(f"--fdl_set={l}\n" for l in dense))
  before = {p: os.path.getsize(os.path.join(d, p)) for d, _, ps in os.walk(out) for p in ps}
  r = h.run(h.main_cmd(convert_hf.EXP, out, flags=["--mode=decode", f"--flagfile={flagfile}"]),
            num_devices=1)
  assert r.returncode == 2, r.stderr[-3000:]
  paragraph, = r.stderr.strip().splitlines()  # one paragraph, nothing else
  assert paragraph.startswith("spmdtask: config error: The checkpoint at"), paragraph
  assert "layers/block/moe/router: in the checkpoint, not in the model" in paragraph
  assert not r.stdout
  after = {p: os.path.getsize(os.path.join(d, p)) for d, _, ps in os.walk(out) for p in ps}
  assert {p: after[p] for p in before} == before  # nothing of the checkpoint rewritten


def test_tiny_hf_qwen3_moe_gives_hf_logits():
  """QK-norm and renormalized top-k (norm_topk_prob) map onto TransformerLm's fields."""
  hf, cfg, tokens, want = _fixture("qwen3_moe")
  lines = convert_hf.overrides(cfg)
  assert "task.model.qk_norm=True" in lines and "task.model.moe.renormalize=True" in lines
  model = util.build_run(convert_hf.experiment(cfg), lines).task.model
  tensors = convert_hf.read_hf(hf)[1]
  params = convert_hf.to_params(cfg, tensors)
  _assert_hf_logits(model, params, tokens, want)
  dtypes = {k: str(v.dtype) for k, v in tensors.items()}
  _assert_bit_identical(convert_hf.from_params(cfg, params, dtypes), tensors)


def test_tiny_hf_qwen3_gives_hf_logits_and_round_trips_bit_identically():
  """Qwen3 dense: Llama's layer with QK-norm, tied (unscaled) embeddings."""
  hf, cfg, tokens, want = _fixture("qwen3")
  lines = convert_hf.overrides(cfg)
  assert convert_hf.experiment(cfg) == "qwen3.Qwen3Import"
  assert {"task.model.qk_norm=True", "task.model.tie_embeddings=True",
          "task.model.scale_tied_logits=False"} <= set(lines)
  model = util.build_run(convert_hf.experiment(cfg), lines).task.model
  tensors = convert_hf.read_hf(hf)[1]
  params = convert_hf.to_params(cfg, tensors)
  assert "unembed" not in params
  _assert_hf_logits(model, params, tokens, want)
  dtypes = {k: str(v.dtype) for k, v in tensors.items()}
  _assert_bit_identical(convert_hf.from_params(cfg, params, dtypes), tensors)
