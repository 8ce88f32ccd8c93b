"""Where a conversion writes, checked before anything is read or written: an import never
writes over a job, an export never over files, unless --overwrite; then they replace what
the new job or model would be mixed with, and say what that was.
"""
from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.hf import files

# What makes a dir a job's (checkpoints/, config.txt: spmdtask.main's; the rest an import's).
JOB_MARKERS = ("checkpoints", "config.txt", "model_overrides.txt", "hf_source.json")
# A job's entries an import with --overwrite removes (contracts: job_log_dir's layout).
JOB_ENTRIES = JOB_MARKERS + ("summaries", "eval_metrics.jsonl", "decoder_out", "plan.json",
                             "profile", "logs", files.GENERATION_FILE) + files.TOKENIZER_FILES


def _listed(names: list[str], most: int = 6) -> str:
  return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                    else "")


def job_dir(job_log_dir: str, overwrite: bool) -> list[str]:
  """The entries of an existing job in `job_log_dir` that an import replaces ([] for a
  new dir, or one without a job); ConfigError where there is a job and not `overwrite`."""
  names = fs.listdir(job_log_dir)
  if not [n for n in JOB_MARKERS if n in names]:
    return []
  job = [n for n in JOB_ENTRIES if n in names]
  if not overwrite:
    raise ConfigError(f"--job_log_dir={job_log_dir!r} already holds a job ({_listed(job)}); "
                      "an import writes a new job and never over one, so nothing was written. "
                      "Give a new --job_log_dir, or add --overwrite to replace that job "
                      "(its checkpoints included).")
  return job


def export_dir(hf_dir: str, overwrite: bool, jobs: list[str]) -> list[str]:
  """The files in `hf_dir` that an export replaces ([] for a new or empty dir);
  ConfigError where it is not empty and not `overwrite`, or where it is one of `jobs`
  (the job exported and the jobs it started from: never a target)."""
  if any(fs.absolute(hf_dir).rstrip("/") == fs.absolute(j).rstrip("/") for j in jobs):
    raise ConfigError(f"--to_hf={hf_dir!r} is the job dir being exported (or one it started "
                      "from); an export goes into a dir of its own, so nothing was written. "
                      "Give a new --to_hf dir.")
  names = fs.listdir(hf_dir)
  if not names:
    return []
  if not overwrite:
    raise ConfigError(f"--to_hf={hf_dir!r} is not empty ({_listed(names)}); an export never "
                      "writes over files, so nothing was written. Give a new or empty "
                      "--to_hf dir, or add --overwrite to replace the model files there.")
  return files.model_files(names)


def clear(directory: str, names: list[str]) -> None:
  """Removes `names` (files or trees) from `directory`."""
  for name in names:
    path = fs.join(directory, name)
    fs.rm(path, recursive=fs.isdir(path))


def replaced_line(directory: str, names: list[str]) -> str:
  return f"--overwrite: replaced in {directory}: {_listed(names, 12)}"
