"""Mixture-of-Experts checkpoints in the Hugging Face layout (spmdtask/hf/moe.py): a tiny
random Mixtral and Qwen3-MoE convert, give HF's own logits, and go back out bit-identically;
a Mixtral checkpoint restored by a Llama experiment is a config error naming its experts.

The fixtures (tests/tools/data/{mixtral,qwen3_moe}/: config.json, model.safetensors, HF's
logits.npy of tokens.npy) were written by transformers' MixtralForCausalLM and
Qwen3MoeForCausalLM (tests/tools/data/README.md says how); this test needs no torch.
"""
import os

import pytest

from spmdtask.errors import ConfigError
from spmdtask.hf import convert, families, files, llama, model_overrides
from spmdtask.hf.jobs import checkpoints, exports, imports
from tests import subproc as h
from tests import util
from tests.hf import checks

LLAMA = llama.FAMILY.experiment


@pytest.fixture(scope="module")
def mixtral_job(tmp_path_factory):
  """(job dir, override lines) of the mixtral fixture through --from_hf (read, never
  written, by the tests that share it)."""
  out = str(tmp_path_factory.mktemp("mixtral") / "job")
  return out, imports.from_hf(checks.fixture("mixtral")[0], out)


def test_tiny_hf_mixtral_gives_hf_logits_and_round_trips_bit_identically(mixtral_job,
                                                                           tmp_path):
  hf, cfg, tokens, want = checks.fixture("mixtral")
  (out, lines), back = mixtral_job, str(tmp_path / "back")
  exp = families.experiment(cfg)
  assert exp == "moe.MoeImport"
  model = util.build_run(exp, lines).task.model
  params = checkpoints.read_checkpoint(out, lines, exp)  # through the step-0 checkpoint
  assert params["layers"]["block"]["moe"]["wg"].shape == (2, 4, 64, 96)  # [L, E, d, f]
  checks.assert_hf_logits(model, params, tokens, want)
  exports.to_hf(out, back)
  got_cfg, got = files.read_hf(back)
  assert got_cfg == cfg
  checks.assert_bit_identical(got, files.read_hf(hf)[1])
  # Restored by a Llama experiment (the same dims, no experts): a config error naming them.
  dense = [l for l in lines if not l.startswith(("task.model.moe.", "task.model.qk_norm"))]
  with pytest.raises(ConfigError, match=r"(?s)does not match this model's params.*"
                     r"layers/block/moe/router: in the checkpoint, not in the model"):
    checkpoints.read_checkpoint(out, dense, LLAMA)


@pytest.mark.slow
def test_a_mixtral_checkpoint_run_by_a_llama_experiment_exits_2_naming_its_experts(
    mixtral_job, tmp_path):
  """The same mistake from the command line: one paragraph, exit 2, the checkpoint intact."""
  out, lines = mixtral_job
  dense = [l for l in lines if not l.startswith(("task.model.moe.", "task.model.qk_norm"))]
  flagfile = tmp_path / "dense_overrides.txt"
  flagfile.write_text("".join(f"--fdl_set={l}\n" for l in dense))
  before = {p: os.path.getsize(os.path.join(d, p)) for d, _, ps in os.walk(out) for p in ps}
  r = h.run(h.main_cmd(LLAMA, out, flags=["--mode=decode", f"--flagfile={flagfile}"]),
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
  hf, cfg, tokens, want = checks.fixture("qwen3_moe")
  lines = model_overrides.overrides(cfg)
  assert "task.model.qk_norm=True" in lines and "task.model.moe.renormalize=True" in lines
  model = util.build_run(families.experiment(cfg), lines).task.model
  tensors = files.read_hf(hf)[1]
  params = convert.to_params(cfg, tensors)
  checks.assert_hf_logits(model, params, tokens, want)
  dtypes = {k: str(v.dtype) for k, v in tensors.items()}
  checks.assert_bit_identical(convert.from_params(cfg, params, dtypes), tensors)
