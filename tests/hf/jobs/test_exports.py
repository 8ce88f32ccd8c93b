"""A full or merged export is a chat model: transformers loads it from its dir alone, renders
the prompts with its chat template and generates (checked offline:
tests/hf/data/chat_export/make_chat_export.py; its greedy tokens are expected.json), and
spmdtask's decode of the export, imported back, gives the same tokens. Files 0644 in a 0755
dir; generation_config.json's eos is the end-of-turn token. A job started from an import
(through stages) exports with the import's config and tokenizer.
"""
import json
import os
import shutil
import stat

import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.hf import files, llama
from spmdtask.hf.jobs import exports, imports
from tests import subproc as h
from tools import prepare_chat_data

MODEL = os.path.join(h.REPO, "examples", "tiny_chat", "model")
DATA = os.path.join(h.REPO, "tests", "hf", "data", "chat_export")
PROMPTS = os.path.join(h.REPO, "examples", "tiny_chat", "prompts.jsonl")
CHAT_FILES = ["chat_template.jinja", "config.json", "generation_config.json",
              "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def decode_export(out: str, work: str, new_tokens: int) -> list[dict]:
  """spmdtask's greedy decode of the chat prompts on the export `out`: imported back (into
  WORK/again), the prompts rendered with its tokenizer and template (WORK/data)."""
  again, data = os.path.join(work, "again"), os.path.join(work, "data")
  imports.from_hf(out, again)
  prepare_chat_data.prepare(os.path.join(h.REPO, "examples", "tiny_chat", "conversations.jsonl"),
                            out, data, max_len=128)
  return _decode(again, data, new_tokens)


def _decode(job: str, data: str, new_tokens: int) -> list[dict]:
  """spmdtask's greedy decode of the chat prompts, rendered with the template of `data` (a
  chat data dir prepared with the export's tokenizer and template)."""
  r = h.run(h.main_cmd(llama.FAMILY.experiment, job,
                       f"task.decode.max_decode_len={28 + new_tokens}",
                       flags=["--mode=decode", f"--flagfile={job}/model_overrides.txt",
                              f"--data_dir={data}", f"--chat_prompts={PROMPTS}"]),
            num_devices=1)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(job, "decoder_out", "own_prompts_step0.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["base", "merged"])
def test_an_export_is_a_chat_model_whose_greedy_tokens_spmdtask_decodes(tmp_path, case):
  with open(os.path.join(DATA, "expected.json")) as f:
    want = json.load(f)[case]
  job, out = str(tmp_path / "job"), str(tmp_path / "hf")
  imports.from_hf(MODEL, job, os.path.join(DATA, "adapter") if case == "merged" else None)
  assert sorted(exports.to_hf(job, out, merge_lora=case == "merged")) == CHAT_FILES
  assert sorted(os.listdir(out)) == CHAT_FILES
  assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
  for name in CHAT_FILES:
    assert stat.S_IMODE(os.stat(os.path.join(out, name)).st_mode) == 0o644, name
    if name.startswith(("tokenizer", "chat_template")):
      with open(os.path.join(out, name), "rb") as a, open(os.path.join(MODEL, name), "rb") as b:
        assert a.read() == b.read(), name
  with open(os.path.join(out, files.GENERATION_FILE)) as f:
    assert json.load(f) == {"eos_token_id": 6, "bos_token_id": 3}  # <|eot_id|>, <|begin...
  rows = decode_export(out, str(tmp_path), len(want[0]["output_ids"]))
  for row, hf in zip(rows, want, strict=True):
    assert hf["min_margin"] > 1e-4  # no near-tie: float32 rounding cannot flip a token
    assert row["prompt_ids"] == hf["prompt_ids"]  # the template renders as transformers'
    n = len(hf["output_ids"])  # the cache holds 52 tokens: 24 or 25 after the prompt
    assert len(row["output_ids"]) >= n and row["output_ids"][:n] == hf["output_ids"], (row, hf)


def test_a_job_started_from_an_import_exports_through_it(tmp_path):
  """A stage's job dir holds no hf_source.json: its config.txt's init_checkpoint_dir leads
  (through an earlier stage) to the import, whose config and tokenizer the export takes."""
  imported, sft, dpo = (str(tmp_path / n) for n in ("import", "sft", "dpo"))
  imports.from_hf(MODEL, imported)
  for job, start in ((sft, imported), (dpo, sft)):
    os.makedirs(job)
    with open(os.path.join(job, "config.txt"), "w") as f:
      f.write(f"task.train.init_checkpoint_dir = {start!r}\n")
  assert exports.source_job(dpo) == imported
  shutil.copytree(os.path.join(imported, "checkpoints"), os.path.join(dpo, "checkpoints"))
  out = str(tmp_path / "hf")
  assert sorted(exports.to_hf(dpo, out)) == CHAT_FILES
  got = files.read_hf(out)[1]
  want = files.read_hf(MODEL)[1]
  assert all(np.array_equal(got[k], want[k]) for k in want)
  with open(os.path.join(dpo, "config.txt"), "w") as f:
    f.write("task.train.init_checkpoint_dir = None\n")
  with pytest.raises(ConfigError, match="nor does a job it started from"):
    exports.to_hf(dpo, str(tmp_path / "none"))
  assert not os.path.exists(tmp_path / "none")

