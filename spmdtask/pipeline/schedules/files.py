"""Reads a schedule file: spmdtask's text form (`schedule.loads`) or, for a `.csv` name,
torch.distributed.pipelining's compute_only CSV (`torch_csv.loads`). Not validated. Paths go
through `spmdtask.fs` (local or gs://)."""
from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import schedule as schedule_lib
from spmdtask.pipeline.schedules import torch_csv
from spmdtask.pipeline.schedules.schedule import Schedule


def is_csv(path: str) -> bool:
  return str(path).lower().endswith(".csv")


def load(path: str, source: str | None = None) -> Schedule:
  """The schedule in `path`; ConfigError naming `source` (default: the path) when unreadable
  or malformed."""
  source = source or f"schedule file {path!r}"
  try:
    text = fs.read_text(path)
  except OSError as e:
    raise ConfigError(f"{source}: cannot read {path!r} ({e.strerror or e}); give a generator "
                      "name or the path of a schedule file (spmdtask text form, or a torch "
                      "compute_only .csv).") from None
  return torch_csv.loads(text, source) if is_csv(path) else schedule_lib.loads(text, source)


def dump(schedule: Schedule, path: str) -> None:
  """Writes `schedule` in the form `path`'s suffix names (.csv: torch's, else the text form)."""
  text = torch_csv.dumps(schedule) if is_csv(path) else schedule_lib.dumps(schedule)
  fs.write_text(path, text)
