"""Test helpers that run `spmdtask.main` in subprocesses, sharing one persistent XLA cache."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A persistent XLA cache shared by the test subprocesses: the same program compiles once.
CACHE = os.path.join(tempfile.gettempdir(), "spmdtask_test_jax_cache")
# LLVM at -O0 for every test process: the tests' tiny programs spend their time compiling, not
# running (a third less CPU for the suite). The HLO passes are XLA's usual ones; float results
# may differ from -O2's in the last bits, and every comparison runs both sides with this flag.
# XLA:CPU's older elemental emitter instead of its fusion emitters: a third less compile time
# (measured on tests/layers/test_lora.py: 20.2 -> 13.4 s of backend compile in one test).
# LLVM codegen in one piece: XLA:CPU splits a program's LLVM module to compile the parts on
# several threads, which buys no time when every core is busy (2 test workers on 2 cores)
# and costs CPU (the split, each part's fixed cost): 7 to 25% less CPU per program built
# (TinyLmFsdpTp on 8 devices: 12.4 -> 10.6 s for a build and 4 steps; the MLA LoRA step
# of tests/layers/test_lora.py on one device: 16.3 -> 13.7 s of compile).
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")
# More XLA flags for every test process, e.g. --xla_cpu_max_isa=SSE4_2: the suite on another
# XLA:CPU code path (128-bit vectors: float sums in another order), as on another machine.
EXTRA_XLA_FLAGS = os.environ.get("SPMDTASK_TEST_XLA_FLAGS", "")

KILL_AFTER_SAVE = """
import os, signal, sys
from absl import app
from spmdtask import main
from spmdtask.run import checkpoints
kill_step = int(os.environ["KILL_AFTER_COMMITTED_STEP"])
original = checkpoints.Checkpointer.save
def save(self, step, state, input_state, **tiers):
  original(self, step, state, input_state, **tiers)
  if step == kill_step:
    self.wait()  # the step is committed
    os.kill(os.getpid(), signal.SIGKILL)
checkpoints.Checkpointer.save = save
sys.argv = ["spmdtask.main"] + sys.argv[1:]
app.run(main.main)
"""

# SIGKILL right after step KILL_AFTER_STEP, its goodput events flushed (as the recorder's timer
# would have by then) and every save committed as it is made (so the resumed step is known).
KILL_AFTER_STEP = """
import os, signal, sys
from absl import app
from spmdtask import main
from spmdtask.run import checkpoints, goodput_events
kill_step = int(os.environ["KILL_AFTER_STEP"])
save, step_done = checkpoints.Checkpointer.save, goodput_events.Recorder.step_done
def committed_save(self, step, state, input_state, **tiers):
  save(self, step, state, input_state, **tiers)
  self.wait()
def killing_step_done(self, step):
  step_done(self, step)
  if step == kill_step:
    self.flush()
    os.kill(os.getpid(), signal.SIGKILL)
checkpoints.Checkpointer.save = committed_save
goodput_events.Recorder.step_done = killing_step_done
sys.argv = ["spmdtask.main"] + sys.argv[1:]
app.run(main.main)
"""


def env(num_devices: int = 8, **extra) -> dict:
  e = dict(os.environ)
  e.update(PYTHONPATH=REPO + os.pathsep + e.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
           XLA_FLAGS=(f"{FAST_COMPILE} {EXTRA_XLA_FLAGS} "
                      f"--xla_force_host_platform_device_count={num_devices}"),
           JAX_COMPILATION_CACHE_DIR=CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
           TF_CPP_MIN_LOG_LEVEL="3", **extra)
  return e


def signal_once_printed(cmd, log_path, text: str, sig: int, num_devices: int = 8,
                        timeout: float = 240) -> int:
  """Runs `cmd` (stdout and stderr into the file `log_path`); once `text` is in that log,
  sends it `sig` and returns its exit code. The process is killed on any other way out."""
  cmd, e = _command(cmd, num_devices)
  with open(log_path, "w") as out:
    proc = subprocess.Popen(cmd, env=e, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
  try:
    deadline = time.time() + timeout
    while text not in open(log_path).read():
      assert proc.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
      time.sleep(0.05)
    proc.send_signal(sig)
    return proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()


def main_cmd(exp: str, job_log_dir: str, *overrides: str, flags=()) -> list[str]:
  return ([sys.executable, "-m", "spmdtask.main", f"--exp={exp}", f"--job_log_dir={job_log_dir}"]
          + [f"--fdl_set={o}" for o in overrides] + list(flags))


_SERVER: list = []  # this process's fork server: its `python` and routing variable


def python(num_devices: int = 8, **extra) -> tuple[str, dict]:
  """A `python` that forks spmdtask's command lines from one process that imported spmdtask
  once (tests/forkserver.py; started on first use, one per test process), and the environment
  (`env(num_devices, **extra)`) that routes a command to it. SPMDTASK_TEST_NO_FORKSERVER=1:
  the real interpreter."""
  if os.environ.get("SPMDTASK_TEST_NO_FORKSERVER") == "1":
    return sys.executable, env(num_devices, **extra)
  if not _SERVER:
    wrapper, routing = forkserver.start(env(8))
    atexit.register(shutil.rmtree, os.path.dirname(os.path.dirname(wrapper)), True)
    _SERVER.extend((wrapper, routing))
  return _SERVER[0], env(num_devices, **_SERVER[1], **extra)


def _command(cmd, num_devices: int, forked: bool = True, **extra) -> tuple[list, dict]:
  """`cmd` and its environment: a `sys.executable` command through the fork server (`python`)
  unless not `forked` (a command that checks what it imports)."""
  if cmd[0] == sys.executable and forked:
    exe, e = python(num_devices, **extra)
    return [exe, *cmd[1:]], e
  return cmd, env(num_devices, **extra)


def run(cmd, num_devices: int = 8, timeout: int = 240, forked: bool = True,
        **extra) -> subprocess.CompletedProcess:
  """Runs `cmd` to its end (stdout and stderr captured), as `_command` gives it."""
  cmd, e = _command(cmd, num_devices, forked, **extra)
  return subprocess.run(cmd, env=e, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                        check=False)


def run_mains(cmds, num_devices: int = 8, timeout: int = 600) -> list[subprocess.CompletedProcess]:
  """Runs each command of `cmds` in order: their CompletedProcess, as `run` gives them."""
  return [run(c, num_devices, timeout) for c in cmds]


def scalars(directory: str) -> dict[str, dict[int, float]]:
  """tag -> {step: value}, read with tensorboard's own EventAccumulator."""
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboard.util import tensor_util
  acc = event_accumulator.EventAccumulator(directory, size_guidance={"tensors": 0, "scalars": 0})
  acc.Reload()
  out = {}
  for tag in acc.Tags()["tensors"]:
    out[tag] = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
  for tag in acc.Tags()["scalars"]:
    out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
  return out


def train_losses(job_log_dir: str) -> dict[int, float]:
  """step -> train loss, from the job's TensorBoard summaries."""
  return scalars(f"{job_log_dir}/summaries/train")["loss"]
