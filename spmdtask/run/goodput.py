"""Goodput: what share of a job's wall time, across all its runs, trained the model.

`attribute` is a pure function of the runs' event lines (`run.goodput_events`): every second
from the first run's start to the last run's last event goes to one part, and the parts sum
to that wall time. The vocabulary is that of Google's `ml-goodput-measurement` (MaxText's):
goodput is the productive step time; the rest is badput, by kind:
  productive    steps trained for the first time (goodput)
  compile       tracing, lowering and XLA compiles (its "program startup")
  data          waiting for the train input's next batch ("data loading")
  save          the blocking part of checkpoint saves ("unproductive checkpoint save")
  restore       restoring the checkpoint a run resumes from ("... checkpoint restore")
  eval          periodic evaluation during training (a "custom badput event" there)
  recomputed    steps trained again after a restart, because the checkpoint it resumed
                from was older than the step reached before (and the unfinished step a
                run was in when it ended) ("wasted progress from disruption")
  between_runs  from the last event of one run to the start of the next: the failure's
                unrecorded tail, rescheduling, the restart ("infrastructure recovery")
  startup       imports, config, program setup and init before the loop
  other         after the loop: the run's last lines
A step's time is its window's step-phase seconds shared evenly among the steps completed
in the window; a window that completes none passes its seconds on to the next.
"""
import dataclasses
import time

from absl import logging

from spmdtask import console
from spmdtask.errors import ConfigError
from spmdtask.run import goodput_events, summaries

PARTS = ("productive", "compile", "data", "save", "restore", "eval", "recomputed",
         "between_runs", "startup", "other")
WORDS = {"productive": "productive steps", "compile": "compilation", "data": "data waits",
         "save": "checkpoint saves", "restore": "checkpoint restores", "eval": "eval",
         "recomputed": "recomputed steps", "between_runs": "between runs",
         "startup": "startup", "other": "other"}

@dataclasses.dataclass
class Run:
  """One run (one start of the train command) as its events tell it."""
  run_id: str
  start: float
  last: float                 # its last event's time
  begin: int | None           # the step its loop started after (None: it never got there)
  reached: int | None         # the last step it completed (None: none)
  recomputed_steps: int
  ended: str                  # done, preempted, interrupted, error, lost process, or no end
  processes: int | None = None  # the job's process count in this run (an elastic restart's
                                # fewer), None where its events do not say


@dataclasses.dataclass
class Report:
  seconds: dict[str, float]   # part -> seconds; sums to `wall`
  wall: float                 # first run's start to the last run's last event
  runs: list[Run]

  @property
  def goodput(self) -> float:
    return self.seconds["productive"] / self.wall if self.wall > 0 else 0.0

  @property
  def recomputed_steps(self) -> int:
    return sum(r.recomputed_steps for r in self.runs)

  def badput(self) -> list[tuple[str, float]]:
    """(part, seconds) of every badput part with time, largest first."""
    return sorted(((k, v) for k, v in self.seconds.items() if k != "productive" and v > 0),
                  key=lambda kv: -kv[1])


def attribute(runs: list[list[dict]]) -> Report:
  """The parts of the wall time of `runs` (each a run's event lines, in start order)."""
  seconds = dict.fromkeys(PARTS, 0.0)
  out, reached_before, previous_last = [], None, None
  for lines in runs:
    head = lines[0]
    start = last = head["start"]
    if previous_last is not None:
      seconds["between_runs"] += max(0.0, start - previous_last)
    begin = reached = ended = None
    recomputed, pending = 0, 0.0
    for line in lines[1:]:
      if "begin" in line:
        begin = line["begin"]
      elif "end" in line and "seconds" not in line:
        ended = line["end"]
        last = max(last, line["t"])
      elif "seconds" in line:
        seconds["other"] += max(0.0, line["start"] - last)  # a window never written: a hole
        last = max(last, line["end"])
        for phase, s in line["seconds"].items():
          if phase == "step":
            pending += s
          else:
            seconds[phase if phase in seconds else "other"] += s  # the phases are parts
        if "steps" in line:
          a, b = line["steps"]
          redone = 0 if reached_before is None else max(0, min(b, reached_before) - a + 1)
          seconds["recomputed"] += pending * redone / (b - a + 1)
          seconds["productive"] += pending * (b - a + 1 - redone) / (b - a + 1)
          recomputed, pending, reached = recomputed + redone, 0.0, b
    seconds["recomputed"] += pending  # an unfinished step: its work is lost
    out.append(Run(head["run"], start, last, begin, reached, recomputed,
                   ended or "no end recorded (running, or killed)", head.get("processes")))
    if reached is not None:
      reached_before = max(reached, reached_before or 0)
    previous_last = max(last, previous_last or last)
  wall = (previous_last - runs[0][0]["start"]) if runs else 0.0
  return Report(seconds, wall, out)


def percent(report: Report, part: str) -> float:
  return 100 * report.seconds[part] / report.wall if report.wall > 0 else 0.0


def line(report: Report, biggest: int = 3) -> str:
  """The console line a train run ends with."""
  bad = report.badput()[:biggest]
  losses = ", ".join(f"{WORDS[k]} {percent(report, k):.1f}%"
                     + (f" ({console.count(report.recomputed_steps, 'step')})"
                        if k == "recomputed" else "") for k, _ in bad)
  runs = len(report.runs)
  return (f"Goodput {100 * report.goodput:.1f}% of this job's "
          f"{console.duration(report.wall)} wall time"
          + (f" over {runs} runs" if runs > 1 else "")
          + (f"; the biggest losses: {losses}" if losses else "")
          + " (--mode=goodput for the whole account).")


def scalars(report: Report) -> dict[str, float]:
  """TensorBoard scalars: the goodput %, and each part's seconds and %."""
  out = {"goodput/percent": 100 * report.goodput, "goodput/wall_seconds": report.wall}
  for part in PARTS:
    out[f"goodput/seconds/{part}"] = report.seconds[part]
    out[f"goodput/percent/{part}"] = percent(report, part)
  return out


def _clock(t: float) -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def account(report: Report, job_log_dir: str) -> list[str]:
  """The lines of `--mode=goodput`: the parts, then one line per run."""
  total = sum(report.seconds.values())
  out = [f"Goodput of {job_log_dir}: {100 * report.goodput:.1f}% of "
         f"{console.duration(report.wall)} ({report.wall:.1f} s) from "
         f"{_clock(report.runs[0].start)} to {_clock(report.runs[-1].last)} UTC, "
         f"{console.count(len(report.runs), 'run')}."]
  for part in PARTS:
    extra = (f"  ({console.count(report.recomputed_steps, 'step')})"
             if part == "recomputed" else "")
    out.append(f"  {WORDS[part]:<20} {report.seconds[part]:10.1f} s  "
               f"{percent(report, part):5.1f}%{extra}")
  out.append(f"  {'sum':<20} {total:10.1f} s  (wall {report.wall:.1f} s)")
  for i, r in enumerate(report.runs, 1):
    where = ("never reached the loop" if r.begin is None else
             f"from step {r.begin}" + (f" to {r.reached}" if r.reached is not None else ""))
    redo = f", recomputed {console.count(r.recomputed_steps, 'step')}" if r.recomputed_steps else ""
    on = f"{console.count(r.processes, 'process')}, " if r.processes else ""
    out.append(f"  run {i}: {_clock(r.start)} UTC, {console.duration(r.last - r.start)}, "
               f"{on}{where}{redo}; {r.ended}")
  return out


def job_report(job_log_dir: str) -> Report:
  """The report of every run in `job_log_dir`; ConfigError where it has no events."""
  try:
    runs = goodput_events.read(job_log_dir)
  except ValueError as e:
    raise ConfigError(f"{e}: the goodput events of --job_log_dir={job_log_dir!r} were "
                      "changed by hand or damaged; move that file aside and rerun.") from None
  if not runs:
    raise ConfigError(
        f"--job_log_dir={job_log_dir!r} has no goodput events "
        f"({goodput_events.events_dir(job_log_dir)}/*.jsonl): --mode=goodput accounts for "
        "the runs of --mode=train, which write them there as they train. Give the job dir of "
        "a training (one trained before goodput events existed has none).")
  return attribute(runs)


def finish(record: goodput_events.Recorder, job_log_dir: str, reason: str, step: int) -> None:
  """Ends a train run: prints the job's goodput line and writes its parts as TensorBoard
  scalars at `step` (`summaries/goodput`), then records how the run ended (process 0)."""
  if not record.active:
    return
  record.flush()
  try:
    report = job_report(job_log_dir)
  except ConfigError as e:  # damaged events: the run itself went well
    logging.warning("No goodput line: %s", e)
  else:
    console.say("%s", line(report))
    writer = summaries.SummaryWriter(summaries.summary_dir(job_log_dir, "goodput"))
    writer.scalars(step, scalars(report))
    writer.close()
  record.close(reason)
