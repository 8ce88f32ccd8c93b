"""--to_hf of a QLoRA job (layers/qlora.py, hf/merge.py): the PEFT adapter it writes holds
the job's adapter tensors; --merge_lora merges them into the dequantized base. The job is
the PEFT fixture's adapter (tests/tools/data/peft/, random nonzero A and B) over the fixture
Llama's base stored in nf4, written as a step-0 checkpoint of a job started from the import.
And a trained QLoRA job's PEFT adapter, loaded by PEFT onto the bf16 HF model
(tests/hf/data/qlora_peft, made with torch offline), gives spmdtask's logits of that export."""
import os

import jax
import numpy as np
import pytest

from spmdtask.core import train_state
from spmdtask.hf import families, files, model_overrides, peft
from spmdtask.hf.jobs import checkpoints, exports, imports
from tests import util
from tests.hf import checks
from tests.subproc import REPO

BASE, PEFT = os.path.join(checks.DATA, "llama"), os.path.join(checks.DATA, "peft")
NF4 = {"base_quantization": "nf4", "group_size": 8}  # head_dim 8: o's group dim
QLORA_PEFT = os.path.join(REPO, "tests", "hf", "data", "qlora_peft")


@pytest.fixture(scope="module")
def qlora_job(tmp_path_factory):
  """(QLoRA job dir, its params): the import's adapters beside its base in nf4."""
  root = tmp_path_factory.mktemp("qlora_export")
  start, job = str(root / "import"), str(root / "job")
  lines = imports.from_hf(BASE, start, PEFT)
  src = imports.source(start)
  cfg, lora = src["config"], {**src["lora"], **NF4}
  params = checkpoints.read_checkpoint(start, lines, families.lora_experiment(cfg))
  qlines = model_overrides.overrides(cfg, lora=lora)
  prog = checkpoints.program(qlines, families.experiment(cfg, lora))
  model_params = prog.canonical_targets().params
  quantized = train_state.base_storage(prog.model).quantized(params, model_params)
  quantized = jax.device_get(quantized)
  checkpoints.write_checkpoint(job, qlines, quantized, prog)
  config = [f"task.train.init_checkpoint_dir = {start!r}"] + [
      f"task.model.lora.{k} = {tuple(v) if k == 'targets' else v!r}" for k, v in lora.items()]
  with open(os.path.join(job, exports.CONFIG_TXT), "w") as f:
    f.write("\n".join(config) + "\n")
  return job, quantized, lora


@pytest.mark.slow
def test_the_peft_export_of_a_qlora_job_holds_its_adapters(qlora_job, tmp_path):
  job, params, _ = qlora_job
  out = str(tmp_path / "adapter")
  assert exports.to_hf(job, out) == [peft.CONFIG_FILE, peft.ADAPTER_FILE]
  _, want = peft.read(PEFT)  # the adapter the job holds (imported from it)
  got_cfg, got = peft.read(out)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
  assert got_cfg["r"] == 4 and params["layers"]["block"]["attn"]["q_qvalue"].dtype == np.uint8


@pytest.mark.slow
def test_a_merged_export_of_a_qlora_job_is_its_dequantized_base_plus_the_adapters(qlora_job,
                                                                                   tmp_path):
  """Against the float-base LoRA import's merged export: the targets' weights moved by nf4's
  rounding alone (<= 0.152 x a group's absmax: its widest half-gap, -1 to -0.696), nonzero;
  every other tensor (embedding, head, norms) the same."""
  job, _, _ = qlora_job
  exports.to_hf(job, str(tmp_path / "q"), merge_lora=True)
  exports.to_hf(os.path.join(os.path.dirname(job), "import"), str(tmp_path / "f"),
                merge_lora=True)
  got, want = (files.read_hf(str(tmp_path / n))[1] for n in ("q", "f"))
  assert sorted(got) == sorted(want)
  targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
  for k in want:
    err = np.abs(got[k].astype(np.float32) - want[k].astype(np.float32)).max()
    if any(t in k for t in targets):
      assert 0 < err <= 0.152 * np.abs(want[k]).max() * 1.01, k
    else:
      assert err == 0, k


def test_pefts_load_of_a_qlora_jobs_adapter_onto_the_bf16_hf_model_gives_our_logits(tmp_path):
  """tests/hf/data/qlora_peft: the --to_hf adapter of a QLoRA job (nf4 base, 20 steps), and
  PEFT 0.21's logits of it on the fixture Llama (PeftModel.from_pretrained) in float32 and
  in bfloat16. spmdtask's logits of the same export (--from_hf with --adapter: the adapter
  on the float base) equal PEFT's float32 ones to float32 rounding, and PEFT's on the bf16
  model within bf16's noise: bf16 alone moves the base's logits by up to 0.076 (PEFT's
  base, bf16 vs float32); the bound, 0.2 at most and 0.02 on average, is 1/20 of what the
  adapter moves them by (4.0), so a dropped or transposed adapter fails it."""
  lines = imports.from_hf(BASE, str(tmp_path / "job"), os.path.join(QLORA_PEFT, "adapter"))
  exp = "finetune.LlamaLoraImport"
  params = checkpoints.read_checkpoint(str(tmp_path / "job"), lines, exp)
  model = util.build_run(exp, lines).task.model
  tokens = np.load(os.path.join(PEFT, "tokens.npy"))
  ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
  want = {n: np.load(os.path.join(QLORA_PEFT, f"logits_{n}.npy"))
          for n in ("peft_f32", "peft_bf16", "base_f32")}
  assert np.abs(want["peft_f32"] - want["base_f32"]).max() > 3.9  # the adapter's effect
  assert np.abs(ours - want["peft_f32"]).max() <= 1e-4
  err = np.abs(ours - want["peft_bf16"])
  assert err.max() <= 0.2 and err.mean() <= 0.02, (err.max(), err.mean())
