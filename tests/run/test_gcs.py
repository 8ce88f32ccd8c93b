"""A whole job in a GCS bucket (a local emulator): train, SIGKILL, resume on the
uninterrupted losses, eval, decode, TensorBoard summaries, nothing on the local disk; and
an unreachable gs:// job dir fails fast with exit 2, creating nothing; damaged checkpoints in
a bucket (cut short; bytes flipped: fingerprints) are refused as on a local disk, nothing in
the bucket changed, and restoring the intact step moves them aside."""
import json
import os
import signal
import subprocess
import tempfile
import time

import pytest

from tests import gcs_emulator
from tests import subproc as h

# 4 steps saving every 2 (each step and each save to the emulator costs CPU): the killed run
# resumes at step 2 and trains two steps.
BASE = ("task.train.num_train_steps=4", "task.train.save_interval_steps=2",
        "task.train.summary_interval_steps=1", "task.train.log_interval_steps=2")


@pytest.fixture(scope="session")
def emulator():
  with gcs_emulator.Emulator("bucket") as emu:
    yield emu


def _files(root: str) -> list[str]:
  """Files under `root`, but Keras's own settings file (TensorFlow's import writes it to
  $HOME/.keras/keras.json on first use; it is no part of a job)."""
  return sorted(p for p in (os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs)
                if not p.endswith(os.path.join(".keras", "keras.json")))


def _start(cmd, local, emu_env, script=None, **extra):
  """Starts `cmd` (a main_cmd) with cwd, HOME and TMPDIR in the watched local dirs."""
  python, env = h.python(**emu_env, HOME=local["home"], TMPDIR=local["tmp"], **extra)
  cmd = [python, *cmd[1:]] if script is None else [python, "-c", script, *cmd[3:]]
  # Output to unnamed files of the test process (no pipe fills while another run is awaited).
  files = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
  return subprocess.Popen(cmd, env=env, cwd=local["cwd"], stdout=files[0], stderr=files[1]), files


def _wait(*started) -> list[subprocess.CompletedProcess]:
  out = []
  for proc, files in started:
    proc.wait(timeout=300)
    text = []
    for f in files:
      f.seek(0)
      text.append(f.read().decode(errors="replace"))
      f.close()
    out.append(subprocess.CompletedProcess(proc.args, proc.returncode, *text))
  return out


def _run(cmd, local, emu_env, **extra) -> subprocess.CompletedProcess:
  return _wait(_start(cmd, local, emu_env, **extra))[0]


def _why(r) -> str:
  """A failed run's stderr: its start (the first error) and its end."""
  return r.stderr if len(r.stderr) < 8000 else r.stderr[:5000] + "\n...\n" + r.stderr[-3000:]


def _losses(gcs, run_dir: str, dest: str) -> dict[int, float]:
  """step -> loss of the TensorBoard run dir `run_dir` in the bucket, read with tensorboard."""
  os.makedirs(dest)
  for name in gcs.ls(run_dir, detail=False):
    gcs.get(name, os.path.join(dest, os.path.basename(name)))
  return h.scalars(dest)["loss"]


@pytest.mark.slow
def test_job_in_a_bucket(emulator, tmp_path):
  local = {k: str(tmp_path / k) for k in ("cwd", "home", "tmp")}
  for d in local.values():
    os.makedirs(d)
  gcs, env = emulator.filesystem(), emulator.env()
  ref, job = "gs://bucket/ref", "gs://bucket/job"

  # The uninterrupted reference and the run killed after its step-2 checkpoint, side by side.
  # (The reference saves only at its end: its losses are what is compared.)
  r, killed = _wait(_start(h.main_cmd("TinyLm", ref, *BASE, "task.train.save_interval_steps=4"),
                           local, env),
                    _start(h.main_cmd("TinyLm", job, *BASE), local, env,
                           script=h.KILL_AFTER_SAVE, KILL_AFTER_COMMITTED_STEP="2"))
  assert r.returncode == 0, _why(r)
  assert f"job dir {ref} " in r.stdout  # never ./gs:/bucket/...
  assert killed.returncode == -signal.SIGKILL, _why(killed)
  assert sorted(n.rsplit("/", 1)[1] for n in gcs.ls("bucket/job/checkpoints")
                if n.rsplit("/", 1)[1].isdigit()) == ["2"]
  resumed = _run(h.main_cmd("TinyLm", job, *BASE), local, env)
  assert resumed.returncode == 0, _why(resumed)
  assert "Resuming from the checkpoint at step 2" in resumed.stdout
  want = _losses(gcs, "bucket/ref/summaries/train", str(tmp_path / "ref_tb"))
  got = _losses(gcs, "bucket/job/summaries/train", str(tmp_path / "job_tb"))
  assert sorted(want) == sorted(got) == list(range(1, 5))
  for step in range(1, 5):
    assert got[step] == pytest.approx(want[step], rel=1e-6), step

  # Eval (of one batch: the eval dataset's 7 add nothing here) and decode read the job side
  # by side (they write different files).
  ev, dec = _wait(_start(h.main_cmd("TinyLm", job, *BASE, "task.train.eval_steps=1",
                                    flags=["--mode=eval"]), local, env),
                  _start(h.main_cmd("TinyLm", job, *BASE, flags=["--mode=decode"]), local, env))
  assert ev.returncode == 0, _why(ev)
  assert dec.returncode == 0, _why(dec)
  lines = [json.loads(x) for x in gcs.cat("bucket/job/eval_metrics.jsonl").decode().splitlines()]
  assert [(x["dataset"], x["step"]) for x in lines] == [("eval", 4)]
  assert 0 < lines[0]["loss"] < 10
  ev_tb = str(tmp_path / "eval_tb")
  os.makedirs(ev_tb)
  for name in gcs.ls("bucket/job/summaries/eval_eval", detail=False):
    gcs.get(name, os.path.join(ev_tb, os.path.basename(name)))
  assert h.scalars(ev_tb)["loss"] == {4: pytest.approx(lines[0]["loss"], rel=1e-6)}

  out = [n for n in gcs.ls("bucket/job/decoder_out", detail=False)]
  assert len(out) == 1 and out[0].endswith("_step4.jsonl"), out
  rows = [json.loads(x) for x in gcs.cat(out[0]).decode().splitlines()]
  assert len(rows) == 16 and all(len(r["output_ids"]) > 0 for r in rows)

  names = {n.split("/", 2)[2] for n in gcs.find("bucket/job")}
  assert {"config.txt", "config_eval.txt", "config_decode.txt"} <= names
  assert any(n.startswith("logs/") for n in names)
  assert not [n for n in names if n.startswith(".write_probe")]
  # The goodput account of both runs, read from the bucket (each run wrote its own file).
  assert len([n for n in names if n.startswith("goodput/") and n.endswith(".jsonl")]) == 2
  account = _run(h.main_cmd("TinyLm", job, flags=["--mode=goodput"]), local, env)
  assert account.returncode == 0, _why(account)
  runs = [l for l in account.stdout.splitlines() if l.startswith("  run ")]
  # (Run 1's last steps are there if its 5-s flush came before the kill.)
  assert len(runs) == 2 and "from step 0" in runs[0] and runs[0].endswith(
      "; no end recorded (running, or killed)") and runs[1].endswith("from step 2 to 4; done"), runs
  # Nothing of the job on the local disk: not in the working dir, HOME or TMPDIR.
  assert [_files(d) for d in local.values()] == [[], [], []]


@pytest.mark.parametrize("where", ["no_bucket", "nobody_listens"])
def test_unreachable_bucket_exits_2_fast_and_writes_nothing(emulator, tmp_path, where):
  local = {k: str(tmp_path / k) for k in ("cwd", "home", "tmp")}
  for d in local.values():
    os.makedirs(d)
  url = emulator.url if where == "no_bucket" else f"http://127.0.0.1:{gcs_emulator.free_port()}"
  t0 = time.perf_counter()
  r = _run(h.main_cmd("TinyLm", "gs://no-such-bucket/job", *BASE), local,
           gcs_emulator.env_for(url))
  seconds = time.perf_counter() - t0
  assert r.returncode == 2, _why(r)
  assert seconds < 60
  err = r.stderr.strip().splitlines()[-1]
  assert err.startswith("spmdtask: config error: --job_log_dir='gs://no-such-bucket/job' cannot "
                        "be reached"), _why(r)
  assert "Traceback" not in r.stderr
  assert [_files(d) for d in local.values()] == [[], [], []]
  print(f"{where}: exit 2 after {seconds:.1f} s: {err}")


@pytest.fixture
def in_bucket(emulator, monkeypatch):
  """This process on the emulator (gcsfs and tensorstore), and a checkpoint of TinyLm's fresh
  state at step 1 in gs://bucket/saved/checkpoints (saved once: orbax's save to the emulator
  takes ~6 s; tests copy it server-side). Gives (program, state, gcsfs filesystem)."""
  import gcsfs  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints  # pylint: disable=g-import-not-at-top
  from tests import util  # pylint: disable=g-import-not-at-top
  for k, v in emulator.env().items():
    monkeypatch.setenv(k, v)
  gcsfs.GCSFileSystem.clear_instance_cache()  # none made for another endpoint
  program, state = util.program_and_state("TinyLm", 8)
  gcs = emulator.filesystem()
  if not gcs.exists("bucket/saved/checkpoints/1"):
    saver = checkpoints.Checkpointer("gs://bucket/saved", program, 1, None)
    try:
      saver.save(1, state, {"step": 1})
    finally:
      saver.close()
  yield program, state, gcs
  gcsfs.GCSFileSystem.clear_instance_cache()


def test_damaged_checkpoints_in_a_bucket_are_refused_kept_and_restore_step_resumes(in_bucket):
  """In-process, through gcsfs and tensorstore on the emulator: a checkpoint saved to gs://
  and two server-side copies of it as steps 2 and 3. Step 2's array data is cut short (an
  interrupted upload): the metadata check names the file. Step 3 has 256 bytes flipped
  mid-file, its size kept: the resume names the array whose fingerprint no longer matches,
  and the intact step 1 (step 2 is skipped: cut short); no object in the bucket is deleted,
  added or rewritten. Restoring step 1 (what --restore_step=1 does) moves steps 2 and 3
  aside and gives the saved values, bitwise."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from spmdtask.errors import CheckpointUnreadable  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoint_check, checkpoints  # pylint: disable=g-import-not-at-top
  from tests import util  # pylint: disable=g-import-not-at-top
  program, state, gcs = in_bucket
  job, ck = "gs://bucket/damaged", "gs://bucket/damaged/checkpoints"
  for step in ("1", "2", "3"):
    gcs.copy("bucket/saved/checkpoints/1", f"bucket/damaged/checkpoints/{step}", recursive=True)
  data = max((n for n in gcs.find("bucket/damaged/checkpoints/2/params") if "/d/" in n),
             key=gcs.size)
  gcs.pipe(data, gcs.cat(data)[:1000])
  rel = data.split("/checkpoints/2/", 1)[1]
  why = checkpoint_check.problem(f"{ck}/2")
  assert why.startswith(f"{rel} is 1000 bytes long, but the checkpoint's index "
                        "(params/manifest.ocdbt) records data up to byte "), why
  _, array = util.flip_middle_of_largest(f"{ck}/3/params", gcs.cat, gcs.pipe)
  assert checkpoint_check.problem(f"{ck}/1") is checkpoint_check.problem(f"{ck}/3") is None
  before = {n: (i["size"], i["generation"]) for n, i in gcs.find("bucket", detail=True).items()}

  resume = checkpoints.Checkpointer(job, program, 1, None)
  try:
    with pytest.raises(CheckpointUnreadable) as e:
      resume.restore()
    assert (e.value.step, e.value.intact_step) == (3, 1)
    assert str(e.value) in [
        f"The checkpoint at step 3 in {ck} cannot be read: {why}. Nothing was changed. The "
        "newest intact checkpoint is step 1; resuming from it moves the steps after it into "
        "gs://bucket/damaged/checkpoints_unreadable/ (nothing is deleted)."
        for why in util.flipped_array_reasons(f"params/{array}")], str(e.value)
    after = {n: (i["size"], i["generation"]) for n, i in gcs.find("bucket", detail=True).items()}
    assert after == before
    restored, step, _ = resume.restore(1)
    assert step == 1 and resume.latest_checked() == (1, True)
  finally:
    resume.close()
  assert sorted(n.rsplit("/", 1)[1] for n in gcs.ls(
      "bucket/damaged/checkpoints_unreadable")) == ["2", "3"]
  for a, b in zip(jax.tree.leaves(jax.device_get(restored.params)),
                  jax.tree.leaves(jax.device_get(state.params))):
    np.testing.assert_array_equal(a, b)


def test_an_import_from_a_bucket_streams_its_shards(emulator, monkeypatch, tmp_path):
  """`--from_hf=gs://...`: each shard copied to a local temporary file (in pieces, deleted
  at the end), the tensors read one at a time: the same checkpoint as from a local dir."""
  import gcsfs  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from spmdtask.hf.jobs import checkpoints as hf_checkpoints, imports
  from tests.hf.test_llama import CONFIG, LLAMA, _hf_tensors, _write_hf
  for k, v in emulator.env().items():
    monkeypatch.setenv(k, v)
  staged, mkstemp = [], tempfile.mkstemp

  def recorded(*args, **kwargs):
    fd, path = mkstemp(*args, **kwargs)
    staged.append(path)
    return fd, path
  monkeypatch.setattr(tempfile, "mkstemp", recorded)
  gcsfs.GCSFileSystem.clear_instance_cache()
  try:
    local = str(tmp_path / "hf")
    _write_hf(local, CONFIG, _hf_tensors(CONFIG, np.float32), shards=2)
    emulator.filesystem().put(local, "bucket/hf_import", recursive=True)
    lines = imports.from_hf("gs://bucket/hf_import", str(tmp_path / "from_bucket"))
    imports.from_hf(local, str(tmp_path / "from_disk"))
    got, want = (hf_checkpoints.read_checkpoint(str(tmp_path / j), lines, LLAMA)
                 for j in ("from_bucket", "from_disk"))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    shards = [p for p in staged if p.endswith(".safetensors")]
    assert len(shards) == 2 and not any(os.path.exists(p) for p in shards), staged
  finally:
    gcsfs.GCSFileSystem.clear_instance_cache()
