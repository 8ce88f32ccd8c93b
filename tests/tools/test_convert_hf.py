"""tools/convert_hf.py, the command: never over a user's files (an import into a dir that
holds a job, an export into a non-empty dir, the job's own dir: exit 2, one paragraph, every
file there byte-identical; --overwrite replaces and says what), and a console of
spmdtask's lines only (a line per weights file, the step exported; C++ libraries' output in
JOB/logs/native.log).
"""
import json
import os
import re
import shutil
import sys

import pytest

from spmdtask.hf import files
from tests import subproc as h
from tools import convert_hf

MODEL = os.path.join(h.REPO, "examples", "tiny_chat", "model")
ADAPTER = os.path.join(h.REPO, "tests", "hf", "data", "chat_export", "adapter")


def _run(monkeypatch, capsys, *flags) -> tuple[int, str, str]:
  """(exit code, stdout, stderr) of convert_hf's main in this process."""
  monkeypatch.setattr(sys, "argv", ["convert_hf.py", *flags])
  code = 0
  try:
    convert_hf.main()
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def _snapshot(directory: str) -> dict[str, bytes]:
  return {os.path.relpath(os.path.join(d, f), directory): open(os.path.join(d, f), "rb").read()
          for d, _, fs in os.walk(directory) for f in fs}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """(plain import, LoRA import) of the tiny chat model (the LoRA: its PEFT adapter)."""
  root = tmp_path_factory.mktemp("convert")
  plain, lora = str(root / "plain"), str(root / "lora")
  from spmdtask.hf.jobs import imports  # pylint: disable=import-outside-toplevel
  imports.from_hf(MODEL, plain)
  imports.from_hf(MODEL, lora, ADAPTER)
  return plain, lora


def _refused(monkeypatch, capsys, target: str, *flags) -> str:
  before = _snapshot(target)
  code, out, err = _run(monkeypatch, capsys, *flags)
  assert code == 2 and not out, (code, out, err)
  paragraph, = err.strip().splitlines()  # one paragraph, nothing else
  assert paragraph.startswith("convert_hf: config error: "), paragraph
  assert _snapshot(target) == before  # nothing written, nothing removed
  return paragraph


def test_no_conversion_writes_over_a_job_or_a_model(jobs, tmp_path, monkeypatch, capsys):
  plain, lora = jobs
  base = str(tmp_path / "base_model")  # the base model's own dir (a copy)
  shutil.copytree(MODEL, base)
  said = _refused(monkeypatch, capsys, plain, f"--from_hf={MODEL}", f"--job_log_dir={plain}")
  assert "already holds a job (checkpoints, model_overrides.txt, hf_source.json" in said
  assert "add --overwrite to replace that job" in said
  for job, extra in ((plain, ()), (lora, ("--merge_lora",)), (lora, ())):  # full, merged, PEFT
    said = _refused(monkeypatch, capsys, base, f"--job_log_dir={job}", f"--to_hf={base}",
                    *extra)
    assert f"--to_hf={base!r} is not empty (chat_template.jinja, config.json" in said
    assert "add --overwrite to replace the model files there" in said
  for flags in ((), ("--overwrite",)):  # the job's own dir: never, even with --overwrite
    said = _refused(monkeypatch, capsys, plain, f"--job_log_dir={plain}", f"--to_hf={plain}",
                    *flags)
    assert "is the job dir being exported" in said


def test_overwrite_replaces_and_says_what(jobs, tmp_path, monkeypatch, capsys):
  plain, _ = jobs
  target = tmp_path / "old_model"
  shutil.copytree(MODEL, target)
  (target / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # an old shard
  (target / "notes.txt").write_text("mine")
  code, out, err = _run(monkeypatch, capsys, f"--job_log_dir={plain}", f"--to_hf={target}",
                        "--overwrite")
  assert code == 0 and not err, err
  assert f"--overwrite: replaced in {target}: chat_template.jinja, config.json, " \
         "model-00001-of-00002.safetensors, model.safetensors" in out
  assert sorted(os.listdir(target)) == sorted(
      ["notes.txt", "config.json", "model.safetensors", files.GENERATION_FILE,
       "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"])
  job = str(tmp_path / "job")
  shutil.copytree(plain, job)
  os.rename(os.path.join(job, "checkpoints", "0"), os.path.join(job, "checkpoints", "7"))
  code, out, err = _run(monkeypatch, capsys, f"--from_hf={target}", f"--job_log_dir={job}",
                        "--overwrite")
  assert code == 0 and not err, err
  assert re.search(rf"--overwrite: replaced in {re.escape(job)}: checkpoints, "
                   r"model_overrides.txt, hf_source.json", out), out
  assert sorted(os.listdir(os.path.join(job, "checkpoints"))) == ["0"]


@pytest.mark.slow
def test_a_conversion_prints_only_spmdtasks_lines(tmp_path):
  """In a fresh process (C++ libraries print as they load): import and export print the
  lines below and nothing else; what the libraries printed is in the job's logs/."""
  job, out = str(tmp_path / "job"), str(tmp_path / "hf")
  ours = [r"opened model\.safetensors \(shard 1/1\): 21 tensors, 439\.2 KiB",
          rf"wrote {re.escape(job)}: checkpoint step 0, model_overrides\.txt \(--exp="
          r"llama\.LlamaImport --flagfile=.*\)",
          r"Fine-tune it \(stages\.Dpo and stages\.Grpo take --init_from the same way; or one "
          r"recipe: docs/fine_tuning\.md\):",
          rf"  python -m spmdtask\.main --exp=stages\.Sft --init_from={re.escape(job)} "
          rf"--job_log_dir={re.escape(job)}_sft --data_dir=CHAT_DATA",
          rf"read {re.escape(job)}: checkpoint step 0",
          r"wrote model\.safetensors: 21 tensors, 439\.2 KiB, [\d.]+ (s|ms|µs)",
          rf"wrote {re.escape(out)}: chat_template\.jinja, config\.json, "
          r"generation_config\.json, model\.safetensors, tokenizer\.json, "
          r"tokenizer_config\.json"]
  lines = []
  for flags in ([f"--from_hf={MODEL}", f"--job_log_dir={job}"],
                [f"--job_log_dir={job}", f"--to_hf={out}"]):
    r = h.run([sys.executable, "tools/convert_hf.py", *flags], num_devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not r.stderr, r.stderr
    lines += r.stdout.splitlines()
  assert len(lines) == len(ours), lines
  for line, pattern in zip(lines, ours):
    assert re.fullmatch(pattern, line), (line, pattern)
  assert os.path.isfile(os.path.join(job, "logs", "native.log"))
  with open(os.path.join(out, files.GENERATION_FILE)) as f:
    assert json.load(f)["eos_token_id"] == 6
