"""Checkpoints: bitwise resume after SIGKILL, other meshes, incomplete saves, SIGTERM,
warm start, bad input, damage (cut short, bytes flipped: fingerprints) and checkpoints
written without fingerprints. Process-level tests run `spmdtask.main` in subprocesses."""
import dataclasses
import functools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys

import fiddle as fdl
import jax
import numpy as np
import pytest

from tests import subproc as h
from tests import util
from spmdtask.run import checkpoint_check, checkpoints, loop
from spmdtask import main
from spmdtask.core import program as program_lib
from spmdtask.errors import CheckpointUnreadable, ConfigError, TrainingError

# 6 steps saving every 2 (each step costs ~1 s of CPU at -O0 on 8 devices): three steps
# saved, and a resume from step 4 still trains two steps past the warmup's first (lr 0).
BASE = ("task.train.num_train_steps=6", "task.train.save_interval_steps=2",
        "task.train.summary_interval_steps=1", "task.train.log_interval_steps=2")


@functools.lru_cache(maxsize=None)
def _program(exp="TinyLm", *overrides):
  """The program of `exp` (set up once per process: the tests only read it)."""
  run = fdl.build(main.resolved_config(exp, list(overrides)))
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def _steps(job):
  return sorted(int(n) for n in os.listdir(os.path.join(job, "checkpoints")) if n.isdigit())


def _snapshot(job):
  """path -> (size, mtime) of every regular file (logs/ symlinks to the newest log move)."""
  out = {}
  for root, _, files in os.walk(job):
    for f in files:
      p = os.path.join(root, f)
      if os.path.islink(p):
        continue
      st = os.stat(p)
      out[p] = (st.st_size, st.st_mtime_ns)
  return out


@pytest.fixture(scope="session")
def reference_job(tmp_path_factory):
  """TinyLm, 6 uninterrupted steps on 8-way data parallel, saving every 2."""
  job = str(tmp_path_factory.mktemp("ref"))
  r = h.run(h.main_cmd("TinyLm", job, *BASE))
  assert r.returncode == 0, r.stderr[-3000:]
  assert _steps(job) == [2, 4, 6]
  return job


@pytest.mark.slow
def test_bitwise_resume_after_sigkill(reference_job, tmp_path):
  job = str(tmp_path / "killed")
  cmd = h.main_cmd("TinyLm", job, *BASE)
  killed = h.run([cmd[0], "-c", h.KILL_AFTER_SAVE] + cmd[3:], KILL_AFTER_COMMITTED_STEP="4")
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  assert _steps(job) == [2, 4]
  # A partly written later step dir (no commit marker) must be skipped, not restored.
  shutil.copytree(os.path.join(job, "checkpoints", "4"), os.path.join(job, "checkpoints", "6"))
  os.remove(os.path.join(job, "checkpoints", "6", checkpoints.COMMIT_FILE))
  resumed = h.run(cmd)  # the same command again
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "incomplete" in resumed.stderr
  assert "Resuming from the checkpoint at step 4" in resumed.stdout
  assert _steps(job) == [2, 4, 6]

  program = _program()
  ref, ref_step = checkpoints.restore_state(reference_job, program)
  got, got_step = checkpoints.restore_state(job, program)
  assert ref_step == got_step == 6
  for a, b in zip(jax.tree.leaves(jax.device_get(ref)), jax.tree.leaves(jax.device_get(got))):
    np.testing.assert_array_equal(a, b)  # bitwise: params and optimizer state
  ref_loss = h.scalars(os.path.join(reference_job, "summaries", "train"))["loss"]
  got_loss = h.scalars(os.path.join(job, "summaries", "train"))["loss"]
  for step in range(5, 7):
    assert got_loss[step] == ref_loss[step], step


def test_incomplete_checkpoints_are_never_restored(reference_job, tmp_path, caplog):
  job = str(tmp_path / "job")
  shutil.copytree(os.path.join(reference_job, "checkpoints"), os.path.join(job, "checkpoints"))
  ck = os.path.join(job, "checkpoints")
  shutil.rmtree(os.path.join(ck, "6"))
  # Killed mid-async-save: orbax's tmp dir. Partly written: a step dir without its commit.
  shutil.copytree(os.path.join(ck, "4"), os.path.join(ck, "8.orbax-checkpoint-tmp-123"))
  shutil.copytree(os.path.join(ck, "4"), os.path.join(ck, "6"))
  os.remove(os.path.join(ck, "6", checkpoints.COMMIT_FILE))
  shutil.rmtree(os.path.join(ck, "6", "opt_state"))
  program = _program()
  with caplog.at_level(logging.WARNING):
    state, step = checkpoints.restore_state(job, program)
  assert step == 4 and int(jax.device_get(state.step)) == 4
  assert any("incomplete" in r.getMessage() for r in caplog.records)
  with pytest.raises(ConfigError, match=r"Available steps: \[2, 4\]"):
    checkpoints.restore_state(job, program, step=6)


def test_restore_state_errors(reference_job, tmp_path):
  program = _program()
  with pytest.raises(ConfigError, match="no complete checkpoint.*" + str(tmp_path)):
    checkpoints.restore_state(str(tmp_path), program)
  with pytest.raises(ConfigError, match=r"Available steps: \[2, 4, 6\]"):
    checkpoints.restore_state(reference_job, program, step=5)


@pytest.mark.parametrize("target", ["2x2x2", "1 device"])
@pytest.mark.slow
def test_resume_on_other_mesh(tmp_path_factory, target):
  """Uneven dims: 8-way data parallel (no padding) -> data2 x fsdp2 x model2 (padded) / 1 device."""
  # Resumed at step 2 of 4: step 3's loss checks the params, step 4's the optimizer state.
  small = ("task.model.num_layers=2", "task.train.num_train_steps=4",
           "task.train.save_interval_steps=2", "task.train.summary_interval_steps=1")
  dp = "task.ici_mesh_shape=(-1, 1, 1)"
  ref = os.path.join(str(tmp_path_factory.getbasetemp()), "uneven_dp_ref")
  if not os.path.isdir(os.path.join(ref, "checkpoints", "4")):
    r = h.run(h.main_cmd("TinyLmUneven", ref, *small, dp))
    assert r.returncode == 0, r.stderr[-3000:]
  job = str(tmp_path_factory.mktemp("resumed"))
  shutil.copytree(os.path.join(ref, "checkpoints", "2"), os.path.join(job, "checkpoints", "2"))
  mesh, devices = ("task.ici_mesh_shape=(2, 2, 2)", 8) if target == "2x2x2" else (dp, 1)
  r = h.run(h.main_cmd("TinyLmUneven", job, *small, mesh), num_devices=devices)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Resuming from the checkpoint at step 2" in r.stdout
  want = h.scalars(os.path.join(ref, "summaries", "train"))["loss"]
  got = h.scalars(os.path.join(job, "summaries", "train"))["loss"]
  assert sorted(got) == [3, 4]
  for step in (3, 4):
    np.testing.assert_allclose(got[step], want[step], rtol=1e-5)


def test_sigterm_saves_at_current_step_and_exits_zero(tmp_path):
  job = str(tmp_path / "job")
  cmd = h.main_cmd("TinyLm", job, "task.train.num_train_steps=100000",
                   "task.train.save_interval_steps=100000", "task.train.log_interval_steps=1")
  # Signalled once step 1 is done (mid-run all the same: 100000 steps to go).
  assert h.signal_once_printed(cmd, tmp_path / "stderr.txt", "step 1/", signal.SIGTERM,
                               timeout=180) == 0
  text = open(tmp_path / "stderr.txt").read()
  (step,) = _steps(job)
  assert step >= 1 and f"Preempted: saved a checkpoint at step {step}" in text
  program = _program()
  state, restored = checkpoints.restore_state(job, program)
  assert restored == step == int(jax.device_get(state.step))


def _no_init():
  raise AssertionError("a full-parameter warm start ran the random init")


def test_warm_start_loads_params_with_fresh_optimizer(reference_job):
  program = _program()
  fresh_opt = jax.device_get(program.init().opt_state)
  # Every weight comes from the start: no random init is built or run for it.
  warm = checkpoints.warm_start(reference_job, dataclasses.replace(program, _init=_no_init))
  ref, _ = checkpoints.restore_state(reference_job, program)
  for a, b in zip(jax.tree.leaves(jax.device_get(warm.params)),
                  jax.tree.leaves(jax.device_get(ref.params))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(jax.device_get(warm.opt_state)), jax.tree.leaves(fresh_opt)):
    np.testing.assert_array_equal(a, b)
  assert int(jax.device_get(warm.step)) == 0


def test_warm_start_shape_mismatch_lists_variables(reference_job):
  program = _program("TinyLm", "task.model.d_ff=256")
  want = (r"is not a start for this model.*3 differ: .*layers/block/mlp/wi: checkpoint "
          r"\(4, 128, 512\), model \(4, 128, 256\)")
  with pytest.raises(ConfigError, match=want):
    checkpoints.warm_start(reference_job, program)


def test_bad_input_is_a_config_error_and_overwrites_nothing(reference_job, tmp_path):
  before = _snapshot(reference_job)
  (tmp_path / "file").write_text("x")
  mismatch, no_step, unwritable = h.run_mains([
      # A checkpoint of a different model.
      h.main_cmd("TinyLm", reference_job, *BASE, "task.model.d_ff=256"),
      # A restore step that does not exist.
      h.main_cmd("TinyLm", reference_job, *BASE, flags=["--restore_step=5"]),
      # A job_log_dir that cannot be written (its parent is a file).
      h.main_cmd("TinyLm", str(tmp_path / "file" / "job"), *BASE)])
  assert mismatch.returncode == 2 and "mismatched variable" in mismatch.stderr, mismatch.stderr
  assert ("layers/block/mlp/wi: checkpoint (4, 128, 512) float32, model (4, 128, 256)"
          in mismatch.stderr)
  assert no_step.returncode == 2 and "Available steps: [2, 4, 6]" in no_step.stderr, no_step.stderr
  after = _snapshot(reference_job)
  # Nothing changed or removed but the logs, which only grow (logs/native.log is appended).
  assert {p: after.get(p) for p in before if "/logs/" not in p} == {
      p: v for p, v in before.items() if "/logs/" not in p}
  assert all(after[p][0] >= before[p][0] for p in before if "/logs/" in p)
  assert all("/logs/" in p for p in after.keys() - before.keys())  # only new log files
  assert unwritable.returncode == 2 and "--job_log_dir" in unwritable.stderr
  assert "not a writable" in unwritable.stderr


def _largest_file(directory):
  files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


def _flip_bytes(path):
  data = bytearray(open(path, "rb").read())
  data[::97] = bytes(b ^ 0x5A for b in data[::97])
  open(path, "wb").write(data)


def test_a_damaged_checkpoint_is_told_from_its_metadata_and_sizes(reference_job, tmp_path):
  ck = str(tmp_path / "job" / "checkpoints")
  shutil.copytree(os.path.join(reference_job, "checkpoints"), ck)
  assert [checkpoint_check.problem(os.path.join(ck, s)) for s in ("2", "4", "6")] == [None] * 3
  data = _largest_file(os.path.join(ck, "6", "params"))  # an OCDBT data file
  size = os.path.getsize(data)
  os.truncate(data, 1000)
  why = checkpoint_check.problem(os.path.join(ck, "6"))
  rel = os.path.relpath(data, os.path.join(ck, "6"))
  assert why.startswith(f"{rel} is 1000 bytes long, but the checkpoint's index "
                        "(params/manifest.ocdbt) records data up to byte "), why
  assert 1000 < int(re.search(r"up to byte (\d+)", why).group(1)) <= size
  (node,) = os.listdir(os.path.join(ck, "4", "opt_state", "d"))  # the B-tree root node
  os.remove(os.path.join(ck, "4", "opt_state", "d", node))
  assert checkpoint_check.problem(os.path.join(ck, "4")).startswith(
      f"opt_state/d/{node} is missing")
  program = _program()
  with pytest.raises(CheckpointUnreadable) as e:
    checkpoints.restore_state(str(tmp_path / "job"), program)
  assert (e.value.step, e.value.intact_step) == (6, 2) and rel in str(e.value)
  assert "newest intact checkpoint is step 2." in str(e.value)
  meta = os.path.join(ck, "2", "meta", "metadata")
  os.truncate(meta, os.path.getsize(meta) // 2)
  assert checkpoint_check.problem(os.path.join(ck, "2")).startswith("meta/metadata (")
  with pytest.raises(CheckpointUnreadable, match="no intact earlier checkpoint") as e:
    checkpoints.restore_state(str(tmp_path / "job"), program, 2)
  assert e.value.intact_step is None
  assert _steps(str(tmp_path / "job")) == [2, 4, 6]  # nothing moved or removed


def test_bytes_changed_in_place_fail_the_restore_in_one_paragraph(reference_job, tmp_path):
  """Sizes intact, contents not: the restore itself fails; the error names the array and
  the step to restore, without orbax's wrapper (a pybind repr)."""
  job = str(tmp_path / "job")
  shutil.copytree(os.path.join(reference_job, "checkpoints"), os.path.join(job, "checkpoints"))
  _flip_bytes(_largest_file(os.path.join(job, "checkpoints", "6", "params")))
  assert checkpoint_check.problem(os.path.join(job, "checkpoints", "6")) is None
  with pytest.raises(CheckpointUnreadable,
                     match=r"cannot be read: the array params/\S+ cannot be decoded") as e:
    checkpoints.restore_state(job, _program())
  assert e.value.intact_step == 4 and "<" not in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_without_fingerprints_restores_and_is_called_unchecked(reference_job,
                                                                           tmp_path):
  """A checkpoint written before fingerprints existed (its meta without them) restores as
  before; the non-finite guard then calls it unchecked, never good. With them: checked."""
  job = str(tmp_path / "job")
  for step in ("4", "6"):
    shutil.copytree(os.path.join(reference_job, "checkpoints", step),
                    os.path.join(job, "checkpoints", step))
  run, program = fdl.build(main.resolved_config("TinyLm", [])), _program()
  guard_messages = []
  for fingerprinted in (True, False):
    ckpt = checkpoints.Checkpointer(job, program, 2, None)
    try:
      state, step, _ = ckpt.restore()
      assert step == int(jax.device_get(state.step)) == 6
      assert ckpt.latest_checked() == (6, fingerprinted)
      guard = loop.NonFiniteGuard(1, ckpt.should_save, run.task, ckpt.latest_checked)
      with pytest.raises(TrainingError) as e:
        guard.on_metrics(loop.Fetched(7, [{"loss": float("nan")}], {}), last=False)
      guard_messages.append(str(e.value))
      if not fingerprinted:  # a later step that restores (unchecked) is not moved aside
        with pytest.raises(ConfigError, match="has a later intact checkpoint, step 6;"):
          ckpt.restore(4)
    finally:
      ckpt.close()
    if fingerprinted:  # now as checkpoints were written before: their meta without them
      meta = os.path.join(job, "checkpoints", "6", "meta", "metadata")
      with open(meta) as f:
        saved = json.load(f)
      targets = program.canonical_targets()
      assert len(saved.pop("fingerprints")) == len(jax.tree.leaves((targets.params,
                                                                      targets.opt_state)))
      with open(meta, "w") as f:
        json.dump(saved, f)
  checked, unchecked = guard_messages
  assert "the latest checkpoint, step 6, is the last good one" in checked
  assert "resume from the last good checkpoint" in checked
  assert ("the latest checkpoint, step 6, has no fingerprints: its bytes are unchecked"
          in unchecked)
  assert "good" not in unchecked
  assert _steps(job) == [4, 6]


@pytest.mark.slow
def test_damaged_checkpoints_exit_2_naming_the_array_and_the_restore_command_resumes(
    reference_job, tmp_path):
  """Step 6: 256 bytes flipped mid-file, size kept (orbax restores it without a word; the
  fingerprints stored at the save do not match). Step 4: a data file cut short (told from
  the index before any read). The run exits 2 in <= 15 lines naming the array and step 2;
  the command it prints moves 4 and 6 aside and trains on to the reference's step 5."""
  job = str(tmp_path / "job")
  shutil.copytree(reference_job, job)
  five = BASE + ("task.train.num_train_steps=5",)
  ck = os.path.join(job, "checkpoints")
  _, array = util.flip_middle_of_largest(os.path.join(ck, "6", "params"), _read_bytes,
                                         _write_bytes)
  assert checkpoint_check.problem(os.path.join(ck, "6")) is None
  os.truncate(_largest_file(os.path.join(ck, "4", "params")), 1000)
  before = _snapshot(job)
  too_long, r = h.run_mains([
      # A sequence length above max_seq_len on this existing job: exit 2 before any restore.
      h.main_cmd("TinyLm", job, *five, "datasets['train'].seq_len=512"),
      h.main_cmd("TinyLm", job, *five)])
  assert too_long.returncode == 2 and "Traceback" not in too_long.stderr, too_long.stderr
  assert "task.model.max_seq_len=256" in too_long.stderr and "Resuming" not in too_long.stdout
  lines = (r.stdout + r.stderr).splitlines()
  assert r.returncode == 2 and len(lines) <= 15, r.stdout + r.stderr
  assert "Traceback" not in r.stderr and "pybind" not in r.stderr
  assert any(f"The checkpoint at step 6 in {ck} cannot be read: {why}." in r.stderr
             for why in util.flipped_array_reasons(f"params/{array}")), r.stderr
  assert "The newest intact checkpoint is step 2;" in r.stderr
  assert {p: v for p, v in _snapshot(job).items() if "/logs/" not in p} == {
      p: v for p, v in before.items() if "/logs/" not in p}
  command = shlex.split(lines[-1])
  assert command[:3] == ["python", "-m", "spmdtask.main"] and command[-1] == "--restore_step=2"
  r = h.run([sys.executable] + command[1:])
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Moved the unreadable checkpoints at step 4, 6 into" in r.stdout
  assert "Resuming from the checkpoint at step 2" in r.stdout
  assert _steps(job) == [2, 4, 5]
  assert sorted(os.listdir(os.path.join(job, "checkpoints_unreadable"))) == ["4", "6"]
  want = h.train_losses(reference_job)
  got = h.train_losses(job)
  assert [got[s] for s in range(3, 6)] == [want[s] for s in range(3, 6)]  # as uninterrupted


def _read_bytes(path):
  with open(path, "rb") as f:
    return f.read()


def _write_bytes(path, data):
  with open(path, "wb") as f:
    f.write(data)
