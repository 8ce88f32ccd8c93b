"""Elastic slices: a 2-slice job (tools/launch_local.py --slices=2, 2 processes x 4 CPU
devices, DCN data 2) whose slice 1 is SIGKILLed at a seeded random step goes on, unattended,
on slice 0 alone (4 devices, twice the microbatches), grows back to 2 slices when the slice
returns, and trains exactly what an uninterrupted 2-slice run trains: per-step losses and
final params within 1e-5. Also: the shrink's config (`run.elastic.shrink`) and the
launcher's policy (`run.elastic_launch`) on their own, and their mistakes (exit 2)."""
import glob
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from spmdtask import main
from spmdtask.errors import ConfigError
from spmdtask.run import elastic, elastic_launch, goodput, local_tier, peers
from tests import subproc as h

STEPS = 12
JOB = ("task.dcn_mesh_shape=(2, 1, 1)", "task.model.num_layers=1",
       f"task.train.num_train_steps={STEPS}", "task.train.save_interval_steps=2",
       "task.train.max_to_keep=None",  # the tests read the shrunk runs' checkpoints
       "task.train.log_interval_steps=1", "task.train.summary_interval_steps=1")


def _start(job: str, log: str, *flags: str, processes: int = 2,
           overrides: tuple[str, ...] = ()) -> subprocess.Popen:
  """The launcher (tools/launch_local.py) of the job (JOB, then `overrides`) on `processes`
  x 8/`processes` devices, its output and process 0's in `log`."""
  python, env = h.python(4)  # the fork server: the launcher's processes are forked too
  cmd = [python, os.path.join(h.REPO, "tools", "launch_local.py"),
         f"--num_processes={processes}", f"--devices_per_process={8 // processes}", *flags,
         "--", *h.main_cmd("lm.TinyLm", job, *JOB, *overrides)[3:]]
  with open(log, "w") as out:
    return subprocess.Popen(cmd, env=env, cwd=h.REPO, stdout=out, stderr=subprocess.STDOUT)


def _params(job: str, step: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(job, "checkpoints", str(step), "params")
  with ocp.PyTreeCheckpointer() as c:
    meta = c.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    got = c.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(got)[0]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 2-slice run (the same launcher, --slices=2): its losses and params."""
  job = str(tmp_path_factory.mktemp("elastic_ref") / "job")
  log = job + ".log"
  t0 = time.time()
  proc = _start(job, log, "--slices=2")
  assert proc.wait(timeout=300) == 0, open(log).read()[-3000:]
  print(f"the reference 2-slice run took {time.time() - t0:.1f} s")
  return h.train_losses(job), _params(job, STEPS)


def _wait_for(log: str, proc, pattern: str, count: int = 1, timeout: float = 240) -> float:
  t0 = time.time()
  while len(re.findall(pattern, open(log).read(), re.MULTILINE)) < count:
    assert time.time() - t0 < timeout and proc.poll() is None, open(log).read()[-4000:]
    time.sleep(0.02)
  return time.time()


@pytest.mark.slow
def test_a_lost_slice_shrinks_the_job_and_its_return_grows_it_back_with_the_same_losses(
    tmp_path, reference):
  job, log = str(tmp_path / "job"), str(tmp_path / "launch.log")
  # The step after which slice 1 is killed: early enough that the return (a checkpoint 2
  # steps past the restart, committed asynchronously) comes well before the last step.
  kill_after = random.Random(56).randint(3, 5)
  proc = _start(job, log, "--slices=2", "--slice_returns_after_steps=2")
  try:
    _wait_for(log, proc, rf"^step {kill_after}/{STEPS} ")
    pid = int(re.search(r"launch_local: 2 processes \(pids \d+, (\d+)\)", open(log).read())[1])
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    t_restart = _wait_for(log, proc, r"^Resuming from the checkpoint at step", 1)
    t_step = _wait_for(log, proc, r"^Elastic restart .*\n(?:.*\n)*?step \d+/", 1)
    assert proc.wait(timeout=300) == 0, open(log).read()[-4000:]
  finally:
    if proc.poll() is None:
      proc.kill()
  out = open(log).read()
  restart_s, first_step_s = t_restart - t_kill, t_step - t_kill
  print(f"killed slice 1 after step {kill_after}; resumed on 1 slice {restart_s:.1f} s after "
        f"the kill, its first step done {first_step_s:.1f} s after it")
  assert restart_s <= 60, out[-4000:]
  # The survivor's one line, the launcher's, the shrunk run's.
  lost = re.search(r"^spmdtask: lost process 1 of 2 .* newest complete checkpoint is step "
                   r"(\d+) in .*$", out, re.MULTILINE)
  assert lost, out[-4000:]
  saved = int(lost[1])
  # Every 2 steps; the last one's asynchronous commit may not have finished at the kill.
  assert saved in (kill_after - kill_after % 2, kill_after - kill_after % 2 - 2), saved
  assert re.search(rf"^launch_local: slice 1 of 2 lost \(process 0 exited "
                   rf"{peers.EXIT_LOST_PEER}; process 1 killed by signal 9\); restarting on 1 "
                   rf"of 2 slices \(slice 0\) from the newest checkpoint \(step {saved}\)\.$",
                   out, re.MULTILINE), out[-4000:]
  assert re.search(r"^launch_local: 1 process \(pids \d+\) on 1 of 2 slices", out, re.M)
  assert ("Elastic restart on 1 of 2 slices (--live_slices=1): task.dcn_mesh_shape (2, 1, 1) "
          "-> (1, 1, 1), mesh data 4 x fsdp 1 x model 1 on 4 devices, 2 microbatches of 8 "
          "rows: the global batch kept (task.train.elastic_batch='global'; global batch 16)."
          in out), out[-4000:]
  resumed = [int(s) for s in re.findall(r"^Resuming from the checkpoint at step (\d+);", out,
                                        re.M)]
  assert resumed[0] == saved and len(resumed) == 2 and resumed[1] >= saved + 2, resumed
  assert "the lost slices are back" in out
  assert re.search(r"^launch_local: 2 processes \(pids \d+, \d+\) on 2 of 2 slices", out[
      out.index("the lost slices are back"):], re.M)
  assert out.count("Joined a 2-process job") == 2 and "Done at step 12" in out
  # The shrunk run saved on 4 devices, 1 process, 2 microbatches; the grown one on 8.
  from spmdtask.run import checkpoints  # pylint: disable=g-import-not-at-top
  shrunk = checkpoints.read_meta(job, resumed[1])
  assert (shrunk["device_count"], shrunk["process_count"], shrunk["mesh_shape"][:1],
          shrunk["grad_accumulation_microbatches"]) == (4, 1, [4], 2), shrunk
  assert checkpoints.read_meta(job, STEPS)["device_count"] == 8
  # The same losses at every step and the same final params as the uninterrupted run.
  loss_diff, param_diff = _same_as(reference, job)
  print(f"max relative difference: losses {loss_diff:.2e}, params {param_diff:.2e}")
  assert loss_diff <= 1e-5 and param_diff <= 1e-5
  assert len(os.listdir(os.path.join(job, "summaries", "train"))) == 3  # one file a run
  # Goodput: 3 runs; the parts sum to the wall time, the restart's gap counted between runs.
  report = goodput.job_report(job)
  assert [(r.processes, r.ended) for r in report.runs] == [
      (2, "lost process"), (1, "preempted"), (2, "done")]
  # The failed run's end is its survivor's line: the gap to the restart is the relaunch.
  assert report.runs[1].start - report.runs[0].last < restart_s
  # (each window's seconds are written to the microsecond: a few µs apart over its windows)
  assert sum(report.seconds.values()) == pytest.approx(report.wall, abs=1e-3)
  assert report.seconds["between_runs"] > 0 and report.seconds["recomputed"] > 0


def _run_killing_slice_1(job: str, log: str, local: str, after: int, committed: int,
                         overrides: tuple[str, ...], *flags: str) -> str:
  """The 2-slice job (JOB, then `overrides`, the local tier in `local`) through the launcher,
  its process 1 (slice 1) SIGKILLed once step `after` is logged and local step `committed`
  is committed by both processes (its commit is asynchronous); its log once it finished
  (exit 0)."""
  proc = _start(job, log, "--slices=2", *flags, overrides=(
      *overrides, f"task.train.local_checkpoint_dir={local!r}"))
  try:
    _wait_for(log, proc, rf"^step {after}/{STEPS} ")
    t0 = time.time()
    marks = os.path.join(local, "*", "*", str(committed), "commit_success.txt")
    while len(glob.glob(marks)) < 2:
      assert time.time() - t0 < 60 and proc.poll() is None, open(log).read()[-4000:]
      time.sleep(0.02)
    pid = int(re.search(r"launch_local: 2 processes \(pids \d+, (\d+)\)", open(log).read())[1])
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, open(log).read()[-4000:]
  finally:
    if proc.poll() is None:
      proc.kill()
  return open(log).read()


@pytest.mark.slow
def test_a_shrunk_job_resumes_from_the_survivors_local_tier_and_grows_back_from_its_stop(
    tmp_path, reference):
  # The local tier every 2 steps, the job dir every 3: slice 1 SIGKILLed after a seeded
  # step; slice 0 holds a whole copy of the state (it is replicated across the slices), so
  # the shrunk job resumes from its newest local step, newer than the job dir's. When the
  # slice is back, the stop to grow back saves to the job dir (the grown job's new
  # processes have no local copy), and the grown job resumes from that very step.
  job, log = str(tmp_path / "job"), str(tmp_path / "launch.log")
  kill_after = 5
  out = _run_killing_slice_1(
      job, log, str(tmp_path / "local"), kill_after, 4,
      ("task.train.save_interval_steps=3", "task.train.local_save_interval_steps=2"),
      "--slice_returns_after_steps=2")
  restored = re.search(r"^Restored step (\d+) from the local tier .*saved on mesh "
                       r"\{'data': 8, 'fsdp': 1, 'model': 1\}", out, re.M)
  assert restored, out[-4000:]
  step = int(restored[1])
  assert step == 4, (step, kill_after)  # the newest local step; the job dir's was 3
  stopped = int(re.search(r"^Preempted: saved a checkpoint at step (\d+);", out, re.M)[1])
  resumed = [int(s) for s in re.findall(r"^Resuming from the checkpoint at step (\d+);", out,
                                        re.M)]
  # (where the stop falls on a step the job dir saves anyway, this is no test of the stop)
  assert resumed == [step, stopped], (resumed, stopped)
  assert os.path.isdir(os.path.join(job, "checkpoints", str(stopped)))
  assert not os.path.exists(os.path.join(job, "checkpoints", elastic.GROW_STOP_FILE))
  print(f"killed slice 1 after step {kill_after}; the shrunk job resumed from local step "
        f"{step}, stopped at step {stopped} to grow back, and the grown job resumed there")
  loss_diff, param_diff = _same_as(reference, job)
  print(f"max relative difference: losses {loss_diff:.2e}, params {param_diff:.2e}")
  assert loss_diff <= 1e-5 and param_diff <= 1e-5


@pytest.mark.slow
def test_a_job_sharded_across_slices_resumes_from_the_survivors_peer_copies(tmp_path,
                                                                           reference):
  # FSDP over DCN (fsdp 2 across the slices): each slice holds half of every weight and of
  # its optimizer state, and its local steps hold its counterpart's half as a peer copy.
  # The local tier every 5 steps, the job dir every 50 (so only at the end): slice 1 is
  # SIGKILLed after step 6, once local step 5 is committed; slice 0 alone resumes from local
  # step 5, its missing halves read from its peer copies (1 step lost, the bar is 5).
  job, log = str(tmp_path / "job"), str(tmp_path / "launch.log")
  kill_after = 6
  out = _run_killing_slice_1(job, log, str(tmp_path / "local"), kill_after, 5, (
      "task.dcn_mesh_shape=(1, 2, 1)", "task.train.save_interval_steps=50",
      "task.train.local_save_interval_steps=5"))
  first = local_tier.slot_name([socket.gethostname()] * 2, 0)  # process 0's directory
  (meta_path,) = glob.glob(str(tmp_path / "local" / "*" / first / "5" / "meta" / "metadata"))
  with open(meta_path, encoding="utf-8") as f:
    meta = json.load(f)
  # process 0's own blocks are half of each sharded array; its peer copies the other half
  name = next(k for k, v in meta[local_tier.PEER_KEY].items() if k.startswith("params/"))
  assert meta[local_tier.HELD_KEY][name] != meta[local_tier.PEER_KEY][name], name
  assert "restarting on 1 of 2 slices (slice 0) from the newest checkpoint (none in the job " \
         "dir" in out, out[-4000:]
  restored = re.search(r"^Restored step (\d+) from the local tier .*saved on mesh "
                       r"\{'data': 4, 'fsdp': 2, 'model': 1\}; fingerprints checked", out, re.M)
  assert restored, out[-4000:]
  step = int(restored[1])
  print(f"killed slice 1 after step {kill_after}; the shrunk job resumed from local step "
        f"{step} through the peer copies ({kill_after - step} step(s) lost)")
  assert step == 5 and kill_after - step <= 5
  assert "mesh data 4 x fsdp 1 x model 1 on 4 devices, 2 microbatches of 8 rows" in out
  loss_diff, param_diff = _same_as(reference, job)
  print(f"max relative difference: losses {loss_diff:.2e}, params {param_diff:.2e}")
  assert loss_diff <= 1e-5 and param_diff <= 1e-5


def _same_as(reference, job: str) -> tuple[float, float]:
  """(max relative difference of the per-step losses, of the final params) from the
  uninterrupted run's."""
  ref_losses, ref_params = reference
  losses = h.train_losses(job)
  assert sorted(losses) == list(range(1, STEPS + 1))
  got, want = (np.asarray([d[s] for s in range(1, STEPS + 1)]) for d in (losses, ref_losses))
  params = _params(job, STEPS)
  return float(np.max(np.abs(got / want - 1))), max(
      float(np.max(np.abs(params[k] - ref_params[k]))
            / max(float(np.max(np.abs(ref_params[k]))), 1e-12)) for k in ref_params)


@pytest.mark.slow
def test_a_slice_of_two_processes_lost_stops_the_other_three_and_the_job_shrinks(
    tmp_path, reference):
  # 2 slices x 2 processes x 2 devices (the same 8-device mesh as the reference): process 3
  # (slice 1) SIGKILLed; processes 0-2 stop in one line each (exit 5), and the job goes on
  # on slice 0's 2 processes (4 devices, 2 microbatches) with the reference's losses.
  job, log = str(tmp_path / "job"), str(tmp_path / "launch.log")
  proc = _start(job, log, "--slices=2", processes=4)
  try:
    _wait_for(log, proc, rf"^step 3/{STEPS} ")
    pid = int(re.search(r"launch_local: 4 processes \(pids (?:\d+, ){3}(\d+)\)",
                        open(log).read())[1])
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    t_stopped = _wait_for(log, proc, r"^launch_local: slice 1 of 2 lost")
    assert proc.wait(timeout=300) == 0, open(log).read()[-4000:]
  finally:
    if proc.poll() is None:
      proc.kill()
  out = open(log).read()
  stopped_s = t_stopped - t_kill
  print(f"processes 0-2 stopped {stopped_s:.1f} s after process 3 was killed")
  assert stopped_s <= 60
  assert re.search(rf"^launch_local: slice 1 of 2 lost \(process 0 exited 5; process 1 exited "
                   rf"5; process 2 exited 5; process 3 killed by signal 9\); restarting on 1 "
                   rf"of 2 slices \(slice 0\)", out, re.M), out[-4000:]
  logs = [out] + [open(os.path.join(job, "logs", f"process_{i}.log")).read() for i in (1, 2)]
  for i, text in enumerate(logs):  # one line each (a survivor's log also holds its run's)
    assert len(re.findall(rf"^spmdtask: lost process 3 of 4 .* Process {i} stops here "
                          r"\(exit 5\);", text, re.M)) == 1, (i, text[-3000:])
    assert "Traceback" not in text, (i, text[-3000:])
  assert re.search(r"^launch_local: 2 processes \(pids \d+, \d+\) on 1 of 2 slices", out, re.M)
  assert ("mesh data 4 x fsdp 1 x model 1 on 4 devices, 2 microbatches of 8 rows" in out
          and "Done at step 12" in out)
  assert "Joined a 2-process job" in out.split("slice 1 of 2 lost")[1]
  loss_diff, param_diff = _same_as(reference, job)
  print(f"max relative difference: losses {loss_diff:.2e}, params {param_diff:.2e}")
  assert loss_diff <= 1e-5 and param_diff <= 1e-5


# ---------------------------------------------------------------- the parts alone

def _run_cfg(*overrides: str):
  return main.build(main.resolved_config("lm.TinyLm", list(overrides)))


def test_shrink_keeps_the_global_batch_or_the_per_slice_batch():
  run = _run_cfg("task.dcn_mesh_shape=(2, 1, 1)", "task.train.num_microbatches=2")
  same, line = elastic.shrink(run, 2, 8)
  assert same is run and line is None
  small, line = elastic.shrink(run, 1, 4)
  assert small.task.dcn_mesh_shape == (1, 1, 1) and small.task.train.num_microbatches == 4
  assert run.task.dcn_sizes() == {"data": 2, "fsdp": 1, "model": 1}  # the local tier's
  assert small.datasets["train"].batch_size == 16
  assert line.endswith("mesh data 4 x fsdp 1 x model 1 on 4 devices, 4 microbatches of 4 "
                       "rows: the global batch kept (task.train.elastic_batch='global'; "
                       "global batch 16).")
  per = _run_cfg("task.dcn_mesh_shape=(2, 1, 1)", "task.train.elastic_batch='per_slice'")
  small, line = elastic.shrink(per, 1, 4)
  assert (small.task.train.num_microbatches, small.datasets["train"].batch_size) == (1, 8)
  assert "1 microbatch of 8 rows: the per-slice batch kept" in line
  # The plan's form (no devices): no mesh in the line, no split check.
  assert "on 4 devices" not in elastic.shrink(run, 1)[1]


@pytest.mark.parametrize("overrides, live, words", [
    (("task.dcn_mesh_shape=(2, 1, 1)",), 3, "--live_slices=3, but task.dcn_mesh_shape=(2, 1, "
     "1) spans 2 slice(s): give a count from 1 to 2"),
    (("task.dcn_mesh_shape=(1, 2, 1)", "task.data_axes=('data',)"), 1, "has no batch axis"),
    (("task.dcn_mesh_shape=(4, 1, 1)",), 3, "needs 1 x 4/3 microbatches, not a whole number"),
    (("task.dcn_mesh_shape=(2, 1, 1)", "datasets['train'].batch_size=20"), 1,
     "the global batch of 20 rows in 2 microbatches does not divide over the shrunk mesh's "
     "4 batch shards (data 4 x fsdp 1). Make datasets['train'].batch_size a multiple of 8"),
])
def test_a_shrink_that_cannot_work_names_the_flag_or_field(overrides, live, words):
  with pytest.raises(ConfigError, match=re.escape(words)):
    elastic.shrink(_run_cfg(*overrides), live, 4)  # a slice's 4 devices


def test_elastic_batch_is_global_or_per_slice():
  with pytest.raises(ConfigError, match=re.escape(
      "task.train.elastic_batch='slice' is 'global' (keep the global batch on fewer slices, "
      "through more microbatches) or 'per_slice' (keep each slice's rows).")):
    _run_cfg("task.train.elastic_batch='slice'")


def test_the_launcher_tells_lost_slices_from_survivors():
  # 2 slices x 2 processes: process 3 killed, the others stopped as survivors.
  assert elastic_launch.lost_slices([5, 5, 5, -9], [0, 1], 2) == [1]
  # Process 0 lost: JAX aborts the others (SIGABRT) before spmdtask can say a word.
  assert elastic_launch.lost_slices([-9, -6], [0, 1], 1) == [0]
  assert elastic_launch.lost_slices([2, 2], [0, 1], 1) is None  # the job's own error
  assert elastic_launch.lost_slices([0, 0], [0, 1], 1) is None


def _exiting(*codes: int) -> list[subprocess.Popen]:
  """Real processes that end with `codes` (a negative one: killed by that signal)."""
  return [subprocess.Popen([sys.executable, "-c", "import os, sys\n" + (
      f"os.kill(os.getpid(), {-c})" if c < 0 else f"sys.exit({c})")]) for c in codes]


@pytest.mark.parametrize("min_slices, want", [(1, 0), (2, peers.EXIT_LOST_PEER)])
def test_the_supervisor_restarts_on_the_slices_left_down_to_min_slices(min_slices, want):
  # 2 slices x 2 processes: process 3 killed, 0-2 stopped as survivors; then slice 0 alone
  # finishes. With --min_slices=2 the job stops instead.
  runs, lines = [], []
  ends = iter([(5, 5, 5, -9), (0, 0)])

  def start(live):
    runs.append(list(live))
    return _exiting(*next(ends))

  t0 = time.time()
  got = elastic_launch.Supervisor(2, 2, start, lambda: 4, min_slices, wait_s=0.5,
                                  say=lines.append, poll_s=0.02).run()
  assert got == want
  lost = ("launch_local: slice 1 of 2 lost (process 0 exited 5; process 1 exited 5; process 2 "
          "exited 5; process 3 killed by signal 9); ")
  assert len(lines) == 1 and lines[0].startswith(lost), lines
  if min_slices == 1:
    assert runs == [[0, 1], [0]] and time.time() - t0 >= 0.5  # waited for the slice
    assert lines[0].endswith("restarting on 1 of 2 slices (slice 0) from the newest "
                             "checkpoint (step 4).")
  else:
    assert runs == [[0, 1]] and lines[0].endswith(
        "1 of 2 left, fewer than --min_slices=2: the job stops (rerun it when the slices "
        "are back).")


@pytest.mark.parametrize("flags, words", [
    (["--slices=3"], "--slices=3 does not split --num_processes=2 into equal slices"),
    (["--slices=2", "--min_slices=3"], "--min_slices=3: the fewest slices the job goes on "
     "with must be from 1 to --slices=2"),
    (["--slices=2", "--slice_returns_after_steps=0"], "--slice_returns_after_steps=0"),
])
def test_launcher_flags_that_cannot_work_exit_2_with_one_paragraph(tmp_path, flags, words):
  r = subprocess.run([sys.executable, os.path.join(h.REPO, "tools", "launch_local.py"),
                      "--num_processes=2", *flags, "--", "--exp=lm.TinyLm",
                      f"--job_log_dir={tmp_path}/job"], capture_output=True, text=True,
                     env=h.env(1), cwd=h.REPO, timeout=60, check=False)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("launch_local: config error: ")
  assert words in lines[0], lines[0]
  assert not os.path.exists(tmp_path / "job")  # nothing started
