"""Goodput: the attribution of a job's wall time over its runs (a pure function of event
lines: fast), and one end-to-end job killed twice and preempted once."""
import os
import re
import signal
import sys
import time

import pytest

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.run import goodput, goodput_events
from tests import subproc as h


def _run(run_id, start, windows, begin=None, end=None):
  """One run's lines: windows are (seconds per phase, steps or None), contiguous from start."""
  lines, t = [{"run": run_id, "start": start}], start
  if begin is not None:
    lines.append({"begin": begin, "t": start})
  for seconds, steps in windows:
    line = {"start": t, "end": t + sum(seconds.values()), "seconds": seconds}
    if steps:
      line["steps"] = list(steps)
    lines.append(line)
    t = line["end"]
  if end:
    lines.append({"end": end, "t": t})
  return lines


# Run 1 reaches step 6 and is killed; run 2 resumes from 4 (steps 5, 6 again), reaches 10 and
# is preempted; run 3 resumes from 10 and finishes at 12.
RUNS = [
    _run("a", 1000.0, [({"startup": 3.0, "compile": 2.0}, None),
                       ({"step": 6.0, "data": 0.5, "save": 0.5}, (1, 6)),
                       ({"step": 0.4}, None)], begin=0),
    _run("b", 1020.0, [({"startup": 2.0, "restore": 1.0, "compile": 1.0}, None),
                       ({"step": 8.0, "eval": 1.0}, (5, 10)),
                       ({"save": 0.5, "other": 0.1}, None)], begin=4, end="preempted"),
    _run("c", 1040.0, [({"startup": 1.0, "restore": 1.0}, None),
                       ({"step": 2.0, "compile": 3.0}, (11, 12))], begin=10, end="done"),
]


def test_parts_sum_to_the_wall_time_and_each_is_what_its_phases_say():
  report = goodput.attribute(RUNS)
  s = report.seconds
  assert report.wall == pytest.approx(1047.0 - 1000.0, abs=1e-9)
  assert sum(s.values()) == pytest.approx(report.wall, abs=1e-9)
  # Run 1's 0.4 s in a step it never finished is lost; run 2's 8 s over steps 5..10 are
  # 2/6 recomputed (5, 6) and 4/6 new.
  assert s["recomputed"] == pytest.approx(0.4 + 8.0 * 2 / 6, abs=1e-9)
  assert s["productive"] == pytest.approx(6.0 + 8.0 * 4 / 6 + 2.0, abs=1e-9)
  assert report.recomputed_steps == 2
  # The gaps: run 1's last event at 1012.4, run 2 from 1020; run 2's last at 1033.6, run 3
  # from 1040.
  assert s["between_runs"] == pytest.approx((1020 - 1012.4) + (1040 - 1033.6), abs=1e-9)
  assert (s["compile"], s["restore"], s["save"], s["data"], s["eval"], s["startup"],
          s["other"]) == pytest.approx((6.0, 2.0, 1.0, 0.5, 1.0, 6.0, 0.1), abs=1e-9)
  assert [(r.begin, r.reached, r.recomputed_steps, r.ended) for r in report.runs] == [
      (0, 6, 0, "no end recorded (running, or killed)"), (4, 10, 2, "preempted"), (10, 12, 0, "done")]
  assert report.goodput == pytest.approx(s["productive"] / 47.0)


def test_a_window_without_a_finished_step_passes_its_time_to_the_next():
  # A slow step spread over three windows: all its time belongs to step 1.
  runs = [_run("a", 0.0, [({"step": 5.0}, None), ({"step": 5.0}, None),
                          ({"step": 2.0}, (1, 1))], begin=0, end="done")]
  report = goodput.attribute(runs)
  assert report.seconds["productive"] == 12.0 and report.seconds["recomputed"] == 0.0
  # Resumed from 0 after reaching 1: the same step again, recomputed.
  runs.append(_run("b", 20.0, [({"step": 3.0}, (1, 2))], begin=0, end="done"))
  report = goodput.attribute(runs)
  assert report.seconds["recomputed"] == 1.5 and report.seconds["productive"] == 13.5
  assert report.seconds["between_runs"] == 8.0
  # A window that was never written (a failed write) leaves a hole: other, and the sum holds.
  runs[1][2]["start"] += 0.5
  runs[1][2]["seconds"]["step"] -= 0.5
  report = goodput.attribute(runs)
  assert report.seconds["other"] == 0.5 and report.seconds["recomputed"] == 1.25
  assert sum(report.seconds.values()) == report.wall == 23.0


def test_console_line_account_and_scalars_name_the_biggest_losses():
  report = goodput.attribute(RUNS)
  text = goodput.line(report)
  pct = 100 * report.seconds["productive"] / report.wall
  assert text.startswith(f"Goodput {pct:.1f}% of this job's 0:47 wall time over 3 runs; ")
  # Largest badput first: between runs 14.0 s, compile 6.0, startup 6.0, recomputed 3.07.
  assert "the biggest losses: between runs 29.8%, compilation 12.8%, startup 12.8%" in text
  lines = goodput.account(report, "/j")
  assert lines[0].startswith(f"Goodput of /j: {pct:.1f}% of 0:47 (47.0 s)")
  assert any(re.fullmatch(r"  recomputed steps +3\.1 s +6\.5%  \(2 steps\)", l) for l in lines)
  assert lines[-1].endswith("from step 10 to 12; done") and "recomputed 2 steps" in lines[-2]
  sc = goodput.scalars(report)
  assert sc["goodput/percent"] == pytest.approx(pct)
  assert sum(sc[f"goodput/seconds/{p}"] for p in goodput.PARTS) == pytest.approx(47.0)


def test_recorder_writes_contiguous_windows_compiles_and_a_cut_line_is_dropped(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  job = str(tmp_path)
  started = time.time() - 1.0
  rec = goodput_events.Recorder(job, started, flush_s=3600)
  rec.begin(0)
  with rec.phase("data"):
    time.sleep(0.05)
  jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.123456)(jnp.ones(7)).block_until_ready()  # compiles
  rec.step_done(1)
  with rec.phase("save"):
    time.sleep(0.02)
  rec.flush()
  running = goodput.job_report(job)  # a running job's account: what it has written so far
  assert running.runs[0].ended == "no end recorded (running, or killed)"
  assert running.runs[0].reached == 1 and sum(running.seconds.values()) == pytest.approx(
      running.wall, abs=1e-5)
  rec.close("done")
  (run,) = goodput_events.read(job)
  windows = [l for l in run if "seconds" in l]
  assert windows[0]["start"] == started
  assert all(a["end"] == b["start"] for a, b in zip(windows, windows[1:]))
  for w in windows:
    assert sum(w["seconds"].values()) == pytest.approx(w["end"] - w["start"], abs=1e-5)
  total = lambda k: sum(w["seconds"].get(k, 0.0) for w in windows)
  assert total("startup") >= 1.0 and total("data") >= 0.05 and total("save") >= 0.02
  assert total("compile") > 0.0  # the jit's trace, lowering and compile
  assert run[-1]["end"] == "done"
  # A kill mid-write leaves a cut last line: dropped. Cut elsewhere: an error naming it.
  (path,) = [os.path.join(job, "goodput", f) for f in os.listdir(os.path.join(job, "goodput"))]
  with open(path, "a") as f:
    f.write('{"start": 1')
  assert goodput_events.read(job) == [run]
  with open(path, "a") as f:
    f.write('\n{"end": "x", "t": 1}\n')
  with pytest.raises(ConfigError, match=r"\.jsonl:\d+ is not a JSON line.*move that file"):
    goodput.job_report(job)


def test_an_object_store_gets_whole_parts_rewritten_and_new_ones_past_their_size():
  job = f"memory://goodput_test_{os.getpid()}/job"  # no append there, as on GCS
  rec = goodput_events.Recorder(job, flush_s=3600, part_bytes=400)
  rec.begin(0)
  for step in range(1, 9):
    rec.step_done(step)
    rec.flush()
  rec.close("done")
  parts = fs.glob(fs.join(job, "goodput", "*.jsonl"))
  assert len(parts) >= 3 and all(p.endswith(f".{i}.jsonl") for i, p in enumerate(parts))
  (run,) = goodput_events.read(job)
  assert [l["steps"] for l in run if "steps" in l] == [[s, s] for s in range(1, 9)]
  assert goodput.attribute([run]).runs[0].reached == 8 and run[-1]["end"] == "done"


def test_a_run_not_kept_leaves_nothing(tmp_path):
  # A config error, or a rerun of a finished job: its file and the dir it made go.
  rec = goodput_events.Recorder(str(tmp_path))
  rec.begin(0)
  rec.flush()
  assert len(goodput_events.read(str(tmp_path))) == 1
  rec.close("config error", keep=False)
  assert os.listdir(tmp_path) == []


def test_an_inactive_recorder_writes_nothing(tmp_path):
  rec = goodput_events.Recorder(None)
  with rec.phase("save"):
    rec.step_done(1)
  rec.close("done")
  assert not rec.active and goodput_events.read(str(tmp_path)) == []


def test_goodput_mode_without_events_exits_2_in_one_paragraph(tmp_path):
  cases = ((["--job_log_dir={dir}"], "has no goodput events"),
           ([], "--mode=goodput needs --job_log_dir"))
  runs = h.run_mains([[sys.executable, "-m", "spmdtask.main", "--mode=goodput"]
                      + [f.format(dir=tmp_path) for f in flags] for flags, _ in cases], 1)
  for (_, message), r in zip(cases, runs):
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0
    assert message in r.stderr and "Traceback" not in r.stderr
  assert not os.listdir(tmp_path)


# Two layers: the account is of the job's time, whatever its steps compute (each step, save and
# restore half the work of TinyLm's four).
STEPS = ("task.train.num_train_steps=20", "task.train.save_interval_steps=4",
         "task.train.log_interval_steps=1", "task.train.summary_interval_steps=100",
         "task.model.num_layers=2")
GAP_S = 1.0  # the test waits this long between a run's end and the next start


@pytest.mark.slow
def test_a_job_killed_twice_and_preempted_once_is_accounted_to_the_second(tmp_path):
  job = str(tmp_path / "job")
  cmd = h.main_cmd("TinyLm", job, *STEPS)
  kill = [cmd[0], "-c", h.KILL_AFTER_STEP] + cmd[3:]
  launched, exited, outs = [], [], []
  h.python(1)  # the fork server up before the clock starts: its imports are no job's time

  def run(argv, **env):
    if exited:
      time.sleep(max(0.0, exited[-1] + GAP_S - time.time()))
    launched.append(time.time())
    r = h.run(argv, 1, **env)
    exited.append(time.time())
    outs.append(r.stdout)
    return r

  # Killed after step 6 (checkpoint 4), then after step 11 (checkpoint 8).
  assert run(kill, KILL_AFTER_STEP="6").returncode == -signal.SIGKILL
  r = run(kill, KILL_AFTER_STEP="11")
  assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
  # Preempted (SIGTERM) once it has printed step 13: saves the step it is at, exits 0.
  time.sleep(GAP_S)
  log = tmp_path / "run3.txt"
  launched.append(time.time())
  assert h.signal_once_printed(cmd, log, "step 13/", signal.SIGTERM, num_devices=1,
                               timeout=180) == 0, log.read_text()[-3000:]
  exited.append(time.time())
  outs.append(log.read_text())
  preempted = int(re.search(r"Preempted: saved a checkpoint at step (\d+)", outs[2]).group(1))
  r = run(cmd)  # resumes and finishes
  assert r.returncode == 0, r.stderr[-3000:]

  resumed = [int(m.group(1)) if m else 0 for m in
             (re.search(r"Resuming from the checkpoint at step (\d+)", o) for o in outs)]
  assert resumed == [0, 4, 8, preempted]
  report = goodput.job_report(job)
  s = report.seconds
  # The parts sum to the wall time; that wall time is the test's own, less the first
  # interpreter's start and the last process's exit after its last event.
  assert abs(sum(s.values()) - report.wall) <= 0.01 * report.wall
  measured = exited[-1] - launched[0]
  assert measured - 6.0 <= report.wall <= measured, (report.wall, measured)
  # Recomputed: steps 5, 6 (run 2) and 9, 10, 11 (run 3): the steps actually redone.
  assert report.recomputed_steps == (6 - 4) + (11 - 8) == 5
  assert [(r.begin, r.reached, r.recomputed_steps) for r in report.runs] == [
      (0, 6, 0), (4, 11, 2), (8, preempted, 3), (preempted, 20, 0)]
  killed = "no end recorded (running, or killed)"
  assert [r.ended for r in report.runs] == [killed, killed, "preempted", "done"]
  assert s["recomputed"] > 0 and s["productive"] > 0 and s["compile"] > 0
  assert s["restore"] > 0 and s["save"] > 0 and s["startup"] > 0
  # Each gap: at least the test's wait between a process's end and the next start, at most
  # that plus the interpreter's start and a preempted process's exit.
  gaps = [(report.runs[k + 1].start - report.runs[k].last, launched[k + 1] - exited[k])
          for k in range(3)]
  for k, (gap, waited) in enumerate(gaps):
    assert waited - 0.05 <= gap <= waited + 6.0, (k, gap, waited)
  assert s["between_runs"] == pytest.approx(
      sum(report.runs[k + 1].start - report.runs[k].last for k in range(3)), abs=1e-6)
  # The last run's line, and its TensorBoard scalars at step 20 (the job until then).
  line = re.search(r"Goodput (\d+\.\d)% of this job's \d+:\d\d wall time over 4 runs; "
                   r"the biggest losses: .*\n", outs[3])
  assert line, outs[3][-2000:]
  sc = {k: v[20] for k, v in h.scalars(os.path.join(job, "summaries", "goodput")).items()}
  assert sc["goodput/percent"] == pytest.approx(float(line.group(1)), abs=0.051)
  assert sc["goodput/seconds/recomputed"] == pytest.approx(s["recomputed"], rel=1e-5)
  assert sc["goodput/wall_seconds"] <= report.wall
  # --mode=goodput: the same account.
  r = h.run([sys.executable, "-m", "spmdtask.main", "--mode=goodput", f"--job_log_dir={job}"], 1,
            timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.splitlines() == goodput.account(report, job)
  print(f"wall {report.wall:.2f} s (the test's {measured:.2f} s), parts' sum - wall "
        f"{sum(s.values()) - report.wall:.2e} s; gaps (attributed, waited) "
        f"{[(round(g, 2), round(w, 2)) for g, w in gaps]}; recomputed "
        f"{report.recomputed_steps} steps, {s['recomputed']:.2f} s")
  print("\n".join(r.stdout.splitlines()))
