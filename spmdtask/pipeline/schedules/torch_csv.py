"""torch.distributed.pipelining's `compute_only` CSV schedules <-> `schedule.Schedule`.

The CSV (what `PipelineScheduleMulti._load_csv` reads and torchtitan runs with
`pipeline_parallel_schedule_csv`) has one row per rank, one action per cell, run left to
right; an empty cell is an idle step. A cell is `<stage><type><microbatch>`: `0F0` is the
forward of microbatch 0 through model stage 0, `3B1` a full backward, `2I1` / `2W1` the
input-grad / weight-grad halves. Torch's "stage" is a model part (our virtual stage) and its
"rank" is our stage, so the part-to-rank placement the rows imply must be one that
`Schedule` names: 'loop' (part k on rank k % P) or 'v' (two parts per rank, part k on rank k
for k < P and on 2P-1-k after). Communication cells (SEND_F, RECV_B, ...) are torch's
lowering, not a compute_only schedule, and are refused.
"""
import csv
import io
import re

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules.schedule import Action, Schedule

_CELL = re.compile(r"^(\d+)([FBIW])(\d+)$")


def loads(text: str, source: str = "the CSV schedule") -> Schedule:
  """Parses a compute_only CSV; ConfigError naming `source`, the row and cell. Not validated."""
  cells = []  # (rank, column, part, kind, microbatch)
  rows = list(csv.reader(io.StringIO(text)))
  while rows and not any(c.strip() for c in rows[-1]):
    rows.pop()  # trailing blank lines
  if not rows:
    raise ConfigError(f"{source} has no rows: write one row per rank, one action a cell "
                      "(`0F0`, `1B3`, `2I1`, `2W1`), as torch.distributed.pipelining's "
                      "compute_only CSV.")
  for rank, row in enumerate(rows):
    for column, raw in enumerate(row):
      cell = raw.strip()
      if not cell:
        continue
      match = _CELL.match(cell)
      if not match:
        raise ConfigError(
            f"{source}, row {rank + 1} (rank {rank}), cell {column + 1}: {cell!r} is not a "
            "compute action. Write <stage><F|B|I|W><microbatch>, e.g. 0F0 or 2I1 (a "
            "compute_only schedule: no SEND/RECV/UNSHARD cells), or leave the cell empty.")
      cells.append((rank, column, int(match[1]), match[2], int(match[3])))
  p = len(rows)
  parts = 1 + max(c[2] for c in cells)
  placement = _placement(cells, p, parts, source)
  probe = Schedule(p, 1, ((),) * p, parts // p, placement)
  actions = [[] for _ in range(p)]
  for rank, column, part, kind, mb in cells:
    actions[rank].append(Action(kind, mb, probe.owner(part)[1]))
  return Schedule(p, 1 + max(c[4] for c in cells), tuple(map(tuple, actions)),
                  parts // p, placement)


def _placement(cells, p: int, parts: int, source: str) -> str:
  owners = {}
  for rank, column, part, *_ in cells:
    if owners.setdefault(part, (rank, column))[0] != rank:
      raise ConfigError(f"{source}, row {rank + 1}, cell {column + 1}: stage {part} also "
                        f"runs on rank {owners[part][0]} (row {owners[part][0] + 1}); each "
                        "model stage belongs to one rank.")
  missing = sorted(set(range(parts)) - set(owners))
  if missing or parts % p:
    raise ConfigError(f"{source}: the cells use stages 0..{parts - 1} on {p} ranks (rows), "
                      f"stages {missing} never appear; give every rank the same number of "
                      "stages and every stage at least one action.")
  if all(owners[k][0] == k % p for k in owners):
    return "loop"
  if parts == 2 * p and all(owners[k][0] == (k if k < p else 2 * p - 1 - k) for k in owners):
    return "v"
  where = ", ".join(f"stage {k} on rank {owners[k][0]}" for k in sorted(owners))
  raise ConfigError(f"{source}: the stage-to-rank placement ({where}) is neither 'loop' "
                    f"(stage k on rank k % {p}) nor 'v' (2 stages per rank, stage k on rank "
                    f"k, then back on rank {2 * p - 1} - k); move the cells to one of these.")


def dumps(schedule: Schedule) -> str:
  """The compute_only CSV of `schedule`: one row per stage, cells `<part><kind><mb>`."""
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  for s, row in enumerate(schedule.actions):
    writer.writerow([f"{schedule.virtual_stage(s, a.chunk)}{a.kind}{a.microbatch}" for a in row])
  return out.getvalue()
