"""Where a conversion writes: an import refuses a dir that holds a job, an export a
non-empty dir or the job's own, unless --overwrite (which lists what it replaces)."""
import pytest

from spmdtask.errors import ConfigError
from spmdtask.hf.jobs import targets


def test_a_job_or_files_there_are_refused_unless_overwrite(tmp_path):
  job = tmp_path / "job"
  assert targets.job_dir(str(job), False) == []  # new
  job.mkdir()
  (job / "notes.txt").write_text("x")
  assert targets.job_dir(str(job), False) == []  # no job there
  (job / "checkpoints").mkdir()
  (job / "tokenizer.json").write_text("{}")
  with pytest.raises(ConfigError, match=r"already holds a job \(checkpoints, tokenizer.json\)"):
    targets.job_dir(str(job), False)
  assert targets.job_dir(str(job), True) == ["checkpoints", "tokenizer.json"]
  out = tmp_path / "hf"
  assert targets.export_dir(str(out), False, [str(job)]) == []
  out.mkdir()
  for name in ("README.md", "config.json", "model-00001-of-00002.safetensors",
               "model.safetensors.index.json", "adapter_model.safetensors"):
    (out / name).write_text("x")
  with pytest.raises(ConfigError, match=r"is not empty \(README.md, adapter_model"):
    targets.export_dir(str(out), False, [str(job)])
  assert targets.export_dir(str(out), True, [str(job)]) == [
      "adapter_model.safetensors", "config.json", "model-00001-of-00002.safetensors",
      "model.safetensors.index.json"]
  with pytest.raises(ConfigError, match="is the job dir being exported"):
    targets.export_dir(str(job) + "/", True, [str(job)])
  targets.clear(str(job), ["checkpoints", "tokenizer.json"])
  assert [p.name for p in job.iterdir()] == ["notes.txt"]
