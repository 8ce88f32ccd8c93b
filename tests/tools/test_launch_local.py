"""tools/launch_local.py on the console: process 0's output on this terminal, every other
process's in the job dir's logs/process_<i>.log."""
import re

from spmdtask import registry
from tools import launch_local


def test_process_0_on_the_console_the_others_in_their_logs(tmp_path, capfd):
  job = tmp_path / "job"
  status = launch_local.run_on_console(
      2, 1, ["--list_experiments", f"--job_log_dir={job}"])
  out, err = capfd.readouterr()
  assert status == 0
  # What a fresh process registers (other tests may have registered tests.* experiments here).
  names = {n.removeprefix("configs.") for n in registry.names() if not n.startswith("tests.")}
  listed = {line.split()[0] for line in out.splitlines()  # a row: "  NAME  purpose"
            if line.startswith("  ") and not line.startswith("   ")
            and line.split()[0] in names | {n.split(".")[-1] for n in names}}
  assert listed == names  # once: process 0's (--list_experiments, grouped)
  assert len(err.splitlines()) == 1 and re.fullmatch(
      rf"launch_local: 2 processes \(pids \d+, \d+\); process 0 below, the others log to "
      rf"{job}/logs/process_<i>\.log", err.strip()), err
  for i in (1,):
    assert (job / "logs" / f"process_{i}.log").read_text().splitlines() == out.splitlines()
