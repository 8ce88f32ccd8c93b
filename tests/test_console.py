"""What a person reads: the default run's console (every line spmdtask's), a finished job's
rerun, an error with the checkpoint manager open, a diverged run; eval and decode lines."""
import pytest
import json
import logging as py_logging
import math
import os
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp

from spmdtask.run import checkpoints, decoding, evaluation
from spmdtask import console
from tests import subproc
from tools import prepare_text_data


# Every line the binary prints in these runs is one of these (spmdtask's own formats).
SPMDTASK_LINES = re.compile("|".join([
    r"lm\.TinyLm: [\d.]+[KMB]? params on mesh .+ devices?\); train state .+ tokens/step\); "
    r"MFU against .+ per device \(.+\)",
    r"job dir \S+ \(config\.txt, checkpoints/, summaries/, logs/\)",
    r"strategy scan \(one program, layers scanned\)",
    r"(Starting|Resuming from the checkpoint) at step \d+; training to step \d+\.",
    r"step \d+/\d+  loss \S+  .+ tokens/s  MFU .+ ETA \S+",
    r"Done at step \d+ \(loss \S+\) in \S+; checkpoint in \S+\.",
    r"Goodput [\d.]+% of this job's \S+ wall time( over \d+ runs)?(; the biggest losses: .+)? "
    r"\(--mode=goodput for the whole account\)\.",
    r"Nothing to do: .+", r"spmdtask: (config error|training stopped): .+"]))


def user_env(**extra) -> dict:
  """A user's environment: no TF / JAX log or platform settings (libtpu probes for a TPU,
  TensorFlow prints its oneDNN notice) and no emulated devices but --cpu_devices."""
  env = subproc.env(**extra)
  for key in ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS", "XLA_FLAGS"):
    env.pop(key, None)
  return env


def run_as_user(cmd, **extra) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, env=user_env(**extra), cwd=subproc.REPO, capture_output=True,
                        text=True, timeout=300, check=False)


@pytest.mark.slow
def test_default_run_console_rerun_and_nan_stop(tmp_path):
  job = str(tmp_path)
  out = run_as_user(subproc.main_cmd("lm.TinyLm", job, flags=["--cpu_devices=8"]))
  assert out.returncode == 0, out.stderr[-3000:]
  lines = (out.stdout + out.stderr).splitlines()
  assert len(lines) <= 25, "\n".join(lines)
  for line in lines:
    assert SPMDTASK_LINES.fullmatch(line), f"not spmdtask's: {line!r}\n" + "\n".join(lines)
  assert lines[0].startswith("lm.TinyLm: 1.05M params on mesh data=8 fsdp=1 model=1 (8 cpu "
                             "devices)")
  assert "per device" in lines[0] and job in lines[1]
  progress = [l for l in lines if l.startswith("step ")]
  assert [l.split()[1] for l in progress] == ["5/20", "10/20", "15/20", "20/20"]
  for l in progress:
    assert "tokens/s" in l and "MFU" in l and "of 130 GFLOP/s" in l and "ETA" in l
    assert math.isfinite(float(l.split("loss ")[1].split()[0]))
  assert "Saving checkpoint" in open(os.path.join(job, "logs", "spmdtask.INFO")).read()
  assert os.path.isfile(os.path.join(job, "logs", "native.log"))

  # An error while the checkpoint manager is open: one paragraph, exit 2, and none of
  # orbax's background-thread tracebacks at interpreter shutdown.
  missing = subproc.run(subproc.main_cmd("lm.TinyLm", job, flags=["--restore_step=7"]))
  assert missing.returncode == 2, missing.stderr[-3000:]
  assert "Traceback" not in missing.stderr and "cannot schedule" not in missing.stderr
  (error,) = [l for l in missing.stderr.splitlines() if l.strip()]
  assert error.startswith("spmdtask: config error: --restore_step=7") and "[20]" in error

  again = subproc.run(subproc.main_cmd("lm.TinyLm", job), timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  finished = [l for l in again.stdout.splitlines() if "Nothing to do" in l]
  assert len(finished) == 1 and "step 20" in finished[0] and "num_train_steps=20" in finished[0]

  # Resumed at 20 with an absurd learning rate: stops at the first non-finite step, exit 3,
  # nothing non-finite saved although every step would be.
  diverged = subproc.run(subproc.main_cmd(
      "lm.TinyLm", job, "task.train.learning_rate=1e30", "task.train.num_train_steps=30",
      "task.train.save_interval_steps=1"), timeout=300)
  assert diverged.returncode == 3, diverged.stderr[-3000:]
  for line in (again.stdout + again.stderr + diverged.stdout + diverged.stderr).splitlines():
    assert SPMDTASK_LINES.fullmatch(line), f"not spmdtask's: {line!r}"
  assert "Resuming from the checkpoint at step 20" in diverged.stdout
  assert "Traceback" not in diverged.stderr
  (msg,) = [l for l in diverged.stderr.splitlines() if l.startswith("spmdtask: training stopped")]
  step = int(msg.split("Training stopped at step ")[1].split(":")[0])
  assert 21 <= step <= 30 and "task.train.learning_rate=1e+30" in msg
  assert "task.train.clip_grad_norm" in msg
  steps = checkpoints.complete_steps(checkpoints.checkpoint_dir(job))
  assert max(steps) == step - 1
  with ocp.StandardCheckpointer() as reader:
    saved = reader.restore(os.path.join(checkpoints.checkpoint_dir(job), str(max(steps)),
                                        "params"))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved))


def test_prepare_text_data_prints_only_its_own_lines(tmp_path):
  """With whatever is installed (TensorFlow prints its oneDNN notice from C++ when it loads,
  JAX's CUDA plugin of the gpu_plan extra its driver probe): the tool's lines and no other."""
  for i in range(3):
    (tmp_path / f"{i}.txt").write_text(f"document {i}: a few words\n")
  data = str(tmp_path / "data")
  out = run_as_user([sys.executable, os.path.join("tools", "prepare_text_data.py"),
                     f"--input={tmp_path}/*.txt", f"--output_dir={data}"])
  assert out.returncode == 0, out.stderr[-3000:]
  meta = json.loads(open(os.path.join(data, "meta.json")).read())
  # Its progress lines come where the run is slow (TensorFlow's import): every 5 s.
  progress = re.compile(r"^prepare_text_data: train: \d of \d shards written \(\d+:\d\d\)$")
  assert [line for line in (out.stdout + out.stderr).splitlines()
          if not progress.match(line)] == [
      f"{data}: bytes tokenizer, vocab_size=257, eod_id=256; train: 2 documents, "
      f"{meta['splits']['train']['num_tokens']} tokens, eval: 1 documents, "
      f"{meta['splits']['eval']['num_tokens']} tokens",
      "Train on it:", "  " + prepare_text_data.train_command(data, meta)]


def test_eval_line_is_readable():
  line = evaluation.readable("eval", 20, {"loss": 1.57732, "accuracy": 0.5, "weight": 6400.0,
                                          "num_batches": 7.0})
  assert line == ("eval dataset 'eval', step 20: loss 1.5773  accuracy 0.5000  (7 batches, "
                  "weight 6400)")
  assert evaluation.readable("eval", 20, {"loss": 1.0, "weight": 8.0, "num_batches": 1.0}) == (
      "eval dataset 'eval', step 20: loss 1.0000  (1 batch, weight 8)")
  assert [console.count(n, w) for n, w in ((1, "cpu device"), (8, "cpu device"), (2, "pass"))
          ] == ["1 cpu device", "8 cpu devices", "2 passes"]


def test_times_read_in_their_unit():
  assert [console.human_seconds(s) for s in (2541.7e-3, 0.0123, 4.56e-5, 12345.6, 0.0)] == [
      "2.54 s", "12.3 ms", "45.6 µs", "12346 s", "0 µs"]


def test_a_second_decode_never_overwrites_the_first(tmp_path):
  rows = [{"id": 0, "prompt_ids": [1, 2], "output_ids": [3, 4, 5]},
          {"id": 1, "prompt_ids": [6], "output_ids": [7]}]
  first = decoding.write_outputs(str(tmp_path), "prompts", 20, rows, None, 1.0)
  changed = [dict(r, output_ids=[9]) for r in rows]
  second = decoding.write_outputs(str(tmp_path), "prompts", 20, changed, None, 1.0)
  assert os.path.basename(first) == "prompts_step20.jsonl"
  assert os.path.basename(second) == "prompts_step20_2.jsonl"
  assert [json.loads(l)["output_ids"] for l in open(first)] == [[3, 4, 5], [7]]
  assert [json.loads(l)["output_ids"] for l in open(second)] == [[9], [9]]


def test_library_records_that_matter_become_spmdtask_lines(capsys):
  records = console._ConsoleRecords()  # pylint: disable=protected-access
  def record(name, level, msg, path):
    return py_logging.LogRecord(name, level, path, 1, msg, None, None)
  here = os.path.join(os.path.dirname(console.__file__), "loop.py")
  records.handle(record("orbax", py_logging.WARNING, "Given directory is read only", "/x/o.py"))
  records.handle(record("jax._src.xla_bridge", py_logging.WARNING,
                        "A Google TPU may be present on this machine, but ...", "/x/b.py"))
  records.handle(record("absl", py_logging.WARNING, "Removing incomplete checkpoint", here))
  assert capsys.readouterr().err == ""  # held until setup
  records.let_through(show=True)
  records.handle(record("tensorstore", py_logging.ERROR, "write failed", "/x/t.py"))
  assert capsys.readouterr().err.splitlines() == [
      "spmdtask: jax warning: A Google TPU may be present on this machine, but ...",
      "spmdtask: warning: Removing incomplete checkpoint",
      "spmdtask: tensorstore error: write failed"]


def test_libraries_to_log_scoped_kept_on_failure_and_alone(capsys, caplog, monkeypatch):
  """One way to send other libraries' errors to the log: a `with` block puts the hooks back;
  in the binary an exception leaving the block, or a lone call, keeps them."""
  for name in ("unraisablehook", "excepthook"):
    monkeypatch.setattr(sys, name, getattr(sys, name))
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  monkeypatch.setattr(py_logging, "raiseExceptions", True)
  monkeypatch.setattr(console, "_library_errors_muted", 0)  # what a kept call leaves is undone
  records = console._ConsoleRecords()  # pylint: disable=protected-access
  records.let_through(show=True)
  def library_error(msg):
    records.handle(py_logging.LogRecord("tensorstore", py_logging.ERROR, "/x/t.py", 1, msg,
                                        None, None))
  before = sys.unraisablehook, sys.excepthook, threading.excepthook

  caplog.set_level(py_logging.INFO)
  caplog.set_level(py_logging.INFO, logger="absl")  # whatever verbosity an earlier test left
  with console.libraries_to_log():
    library_error("muted read failed")
    thread = threading.Thread(target=lambda: 1 / 0)  # a library's thread failing
    thread.start()
    thread.join()
  assert capsys.readouterr().err == ""
  assert "Exception in thread" in caplog.text and "ZeroDivisionError" in caplog.text
  hooks = lambda: (sys.unraisablehook, sys.excepthook, threading.excepthook)
  assert hooks() == before  # library use: put back
  library_error("shown again")
  assert capsys.readouterr().err == "spmdtask: tensorstore error: shown again\n"

  with pytest.raises(ValueError):  # library use: put back after a failure too
    with console.libraries_to_log():
      raise ValueError("x")
  assert hooks() == before

  monkeypatch.setattr(console, "_records", records)  # the binary, after `start`
  with pytest.raises(ValueError):
    with console.libraries_to_log():
      raise ValueError("the run ends with spmdtask's message")
  library_error("after the failed call")
  assert capsys.readouterr().err == ""  # kept: the run is ending
  assert threading.excepthook is not before[2] and py_logging.raiseExceptions is False
  console._library_errors_muted = 0  # pylint: disable=protected-access
  threading.excepthook = before[2]
  console.libraries_to_log()  # alone, as the run ends
  library_error("while the process ends")
  assert capsys.readouterr().err == "" and threading.excepthook is not before[2]
  assert console._library_errors_muted == 1  # pylint: disable=protected-access


def test_elapsed_says_the_seconds_while_a_block_runs(monkeypatch):
  said = []
  monkeypatch.setattr(console, "say", lambda fmt, *args: said.append(fmt % args))
  with console.elapsed("compiling the train step for v5e:2x4", every=0.2) as took:
    threading.Event().wait(0.5)
  # At 0.2 s and 0.4 s (one may come late on a loaded machine), the seconds rounded.
  assert said[:1] == ["compiling the train step for v5e:2x4 ... 0:00"] and len(said) <= 2
  assert all(re.fullmatch(r"compiling the train step for v5e:2x4 \.\.\. 0:0[01]", s) for s in said)
  assert 0.5 <= took.seconds < 2.0
  count = len(said)
  with console.elapsed("quick", every=10.0) as took:
    pass
  assert len(said) == count and took.seconds < 1.0  # nothing said for a block under a period


def test_progress_prints_a_line_every_few_seconds_and_none_for_a_short_loop(capsys):
  now = [100.0]
  progress = console.Progress("tool", every_s=5, clock=lambda: now[0])
  for t in (1, 4.9, 5.0, 7, 10.5, 12, 75):
    now[0] = 100 + t
    progress.update(lambda: f"{t} records read")
  progress.next_phase("writing")
  assert capsys.readouterr().out == ("tool: 5.0 records read (0:05)\n"
                                     "tool: 10.5 records read (0:10)\n"
                                     "tool: 75 records read (1:15)\n"
                                     "tool: writing (1:15)\n")
  quiet = console.Progress("tool", every_s=5, clock=lambda: now[0])
  quiet.update(lambda: "never")
  quiet.next_phase("nor this")
  assert not capsys.readouterr().out
