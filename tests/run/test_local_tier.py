"""The local checkpoint tier: a SIGKILL loses at most the local interval and the resumed
losses equal an uninterrupted run's bitwise; a damaged local step falls back to an earlier
one; a local step of another job or another layout is never restored; SIGTERM saves to the
local tier only; bad input is a ConfigError naming the field."""
import json
import logging
import os
import signal
import socket

from absl import logging as absl_logging
import fiddle as fdl
import jax
from jax.experimental.compilation_cache import compilation_cache
import numpy as np
import pytest

from tests import subproc as h
from spmdtask import main
from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_io as io, checkpoints, local_tier, loop
from spmdtask.run.hooks import Hook

# Local saves every 2 steps, the kill after step 3 (a step lost), 5 steps in all: each step
# costs CPU three times (the killed run, the resumed one and the reference).
LOCAL = 2
KILL_AT = 3
STEPS = 5
TIERS = ("task.model.num_layers=1", f"task.train.num_train_steps={STEPS}",
         "task.train.save_interval_steps=50", f"task.train.local_save_interval_steps={LOCAL}",
         "task.train.log_interval_steps=4", "task.train.summary_interval_steps=100")


def _local_steps(tier_root: str) -> list[int]:
  (job_key,) = os.listdir(tier_root)
  first = local_tier.slot_name([socket.gethostname()], 0)  # process 0's
  return sorted(int(n) for n in os.listdir(os.path.join(tier_root, job_key, first))
                if n.isdigit())


def _persistent_steps(job: str) -> list[int]:
  return io.complete_steps(io.checkpoint_dir(job))


def _run(*overrides):
  return fdl.build(main.resolved_config("TinyLm", list(TIERS) + list(overrides)))


class _Records(logging.Handler):
  def __init__(self):
    super().__init__(logging.INFO)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@pytest.fixture(scope="module", autouse=True)
def xla_cache():
  """This module's in-process runs read the compiles its subprocess wrote to the tests' XLA
  cache (the same programs), in a process that may have compiled without a cache before."""
  cache = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", h.CACHE)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", cache)
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
  """1-layer TinyLm, local tier every LOCAL steps, persistent every 50: SIGKILLed after step
  KILL_AT (a subprocess), resumed in this process to step STEPS; and an uninterrupted
  reference run."""
  root = tmp_path_factory.mktemp("tiers")
  job, local = str(root / "job"), str(root / "local")
  cmd = h.main_cmd("TinyLm", job, *TIERS, f"task.train.local_checkpoint_dir='{local}'")
  killed = h.run([cmd[0], "-c", h.KILL_AFTER_STEP] + cmd[3:], KILL_AFTER_STEP=str(KILL_AT))
  at_kill = (_local_steps(local), _persistent_steps(job))
  records, verbosity = _Records(), absl_logging.get_verbosity()
  logging.getLogger().addHandler(records)
  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    _, _, resumed = loop.train(_run(f"task.train.local_checkpoint_dir='{local}'"),
                               job_log_dir=job)
    logging.getLogger().removeHandler(records)
    reference = loop.train(_run())[2]
  finally:
    logging.getLogger().removeHandler(records)
    absl_logging.set_verbosity(verbosity)
  return dict(killed=killed, at_kill=at_kill, lines=records.lines, resumed=resumed,
              reference=reference, job=job, local=local)


@pytest.mark.slow
def test_a_kill_loses_at_most_the_local_interval_and_resumes_bitwise(killed_and_resumed):
  r = killed_and_resumed
  assert r["killed"].returncode == -signal.SIGKILL, r["killed"].stderr[-3000:]
  assert r["at_kill"] == ([2], [])  # the persistent tier (every 50) holds nothing yet
  restored = [l for l in r["lines"] if l.startswith("Restored step")]
  assert len(restored) == 1 and restored[0].startswith("Restored step 2 from the local tier")
  resumed_from = STEPS - len(r["resumed"])
  assert resumed_from == 2 and KILL_AT - resumed_from <= LOCAL  # steps lost
  assert r["resumed"] == r["reference"][resumed_from:]  # bitwise
  assert _persistent_steps(r["job"]) == [STEPS] and _local_steps(r["local"]) == [2, 4]


def _program(*overrides):
  run = _run(*overrides)
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def test_damaged_foreign_and_moved_local_steps_are_not_restored(tmp_path):
  program = _program()
  job, local = str(tmp_path / "job"), str(tmp_path / "local")
  state = program.init()

  def checkpointer():
    return checkpoints.Checkpointer(job, program, 50, None, local=local_tier.LocalTier(
        local, job, 5, 3))

  ckpt = checkpointer()
  for step in (5, 10, 15):
    ckpt.save(step, state, {"step": step})
  ckpt.close()
  assert _local_steps(local) == [5, 10, 15] and _persistent_steps(job) == []
  tier_dir = ckpt.local.directory
  # Step 15 cut short: the restore falls back to 10 and deletes 15.
  item = os.path.join(tier_dir, "15", "params")
  victim = max((os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs),
               key=os.path.getsize)  # the arrays' data file
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  ckpt = checkpointer()
  try:
    assert ckpt.latest_step() == 15
    _, step, inputs = ckpt.restore()
    assert step == 10 and inputs == {"step": 10} and _local_steps(local) == [5, 10]
    meta = io.read_meta(ckpt.local.mngr, 10)
    assert ckpt.local.usable(meta, program) is None
    # Saved on another layout: usable where this process wrote every block its devices
    # need here (a shrunk job's survivors: `run.elastic`), else not.
    other = {**meta, "mesh_shape": [1, 1, 1, 1, 8], "process_count": 2}
    assert ckpt.local.usable(other, program) is None
    why = ckpt.local.usable({**other, local_tier.HELD_KEY: {}}, program)
    assert why.startswith("it was saved with another mesh_shape, process_count; a local "
                          "step restores onto another layout only where each process's "
                          "devices need only blocks it wrote")
  finally:
    ckpt.close()
  # Restored on another mesh: this one process wrote every block, so the step restores.
  fsdp = _program("task.ici_mesh_shape=(1, 8, 1)")
  moved = checkpoints.Checkpointer(job, fsdp, 50, None,
                                  local=local_tier.LocalTier(local, job, 5, 3))
  try:
    got, step, _ = moved.restore()
    assert step == 10
    for want, have in zip(jax.tree.leaves(state.params), jax.tree.leaves(got.params)):
      np.testing.assert_array_equal(np.asarray(want), np.asarray(have))
  finally:
    moved.close()
  # Where its meta says the process wrote no block, with no persistent step to fall back
  # to: exit 2, nothing deleted.
  for s in (5, 10):
    path = os.path.join(tier_dir, str(s), "meta", "metadata")
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
      json.dump({**meta, local_tier.HELD_KEY: {}}, f)
  moved = checkpoints.Checkpointer(job, fsdp, 50, None,
                                  local=local_tier.LocalTier(local, job, 5, 3))
  try:
    with pytest.raises(ConfigError, match=r"local_checkpoint_dir=.* holds this job's only "
                       r"checkpoints.*step 10: it was saved with another mesh_shape"):
      moved.restore()
  finally:
    moved.close()
  assert _local_steps(local) == [5, 10]
  # The job dir deleted and made anew: its new token disowns the old local steps.
  os.remove(os.path.join(io.checkpoint_dir(job), local_tier.JOB_ID_FILE))
  ckpt = checkpointer()
  try:
    assert ckpt.latest_step() is None and _local_steps(local) == []
  finally:
    ckpt.close()


class _Sigterm(Hook):
  """SIGTERM during step 3's hooks: the loop sees it after step 4."""

  def after_step(self, step, state, last):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_to_the_local_tier_only(tmp_path):
  job, local = str(tmp_path / "job"), str(tmp_path / "local")
  # Local saves every 5: step 4, where the loop stops, is no interval step.
  run = _run(f"task.train.local_checkpoint_dir='{local}'",
             "task.train.local_save_interval_steps=5")
  state, _, losses = loop.train(run, job_log_dir=job, hooks=[_Sigterm()])
  assert int(jax.device_get(state.step)) == 4 and len(losses) == 4
  assert _local_steps(local) == [4] and _persistent_steps(job) == []


@pytest.mark.parametrize("override, message", [
    ("task.train.local_save_interval_steps=0",
     "task.train.local_save_interval_steps=0 must be a positive integer"),
    ("task.train.local_max_to_keep=1.5", "task.train.local_max_to_keep=1.5 must be a positive"),
])
def test_bad_intervals_are_config_errors(override, message):
  with pytest.raises(ConfigError, match=message):
    _run("task.train.local_checkpoint_dir='/tmp/x'", override).task.train.validate()


def test_an_unwritable_local_dir_is_a_config_error(tmp_path):
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("")
  with pytest.raises(ConfigError, match=r"task.train.local_checkpoint_dir='.*file/x' is not a "
                     r"writable directory on this host \(.*\)\. Give a directory"):
    local_tier.ensure_writable(str(not_a_dir / "x"))
  with pytest.raises(ConfigError, match="is a URL, not a path on this host's disk"):
    local_tier.ensure_writable("gs://bucket/local")
  np.testing.assert_equal(os.listdir(tmp_path), ["file"])


def test_a_stop_to_grow_back_saves_to_the_job_dir(tmp_path):
  """A stop (SIGTERM) saves to the local tier, but while a launcher stops a shrunk job to
  grow it back (`elastic.GROW_STOP_FILE` in its checkpoint dir) to the job dir: the grown
  job's new processes hold no local copy."""
  from spmdtask.run import elastic  # pylint: disable=g-import-not-at-top
  program = _program()
  job, local = str(tmp_path / "job"), str(tmp_path / "local")
  state = program.init()
  ckpt = checkpoints.Checkpointer(job, program, 50, None,
                                  local=local_tier.LocalTier(local, job, 5, 3))
  try:
    ckpt.save(7, state, {"step": 7}, last=True, stop=True)
    ckpt.wait()
    assert _local_steps(local) == [7] and _persistent_steps(job) == []
    with open(os.path.join(job, "checkpoints", elastic.GROW_STOP_FILE), "w") as f:
      f.write("stop\n")
    ckpt.save(8, state, {"step": 8}, last=True, stop=True)
    ckpt.wait()
    assert _local_steps(local) == [7] and _persistent_steps(job) == [8]
  finally:
    ckpt.close()


def test_a_hosts_local_directory_survives_a_renumbering():
  # Slice 0 (hosts a, b) lost: slice 1's hosts c, d, once processes 2 and 3, are 0 and 1
  # now, and keep the directories they wrote. Several processes on a host: its ranks.
  before = [local_tier.slot_name(["a", "b", "c", "d"], i) for i in range(4)]
  after = [local_tier.slot_name(["c", "d"], i) for i in range(2)]
  assert before == ["a_0", "b_0", "c_0", "d_0"] and after == before[2:]
  assert [local_tier.slot_name(["vm", "vm", "x/y"], i) for i in range(3)] == [
      "vm_0", "vm_1", "x-y_0"]
