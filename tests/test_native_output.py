"""native_output: C++ libraries' fd output goes to a log file; nothing outlives the process."""
import os
import subprocess
import sys
import tempfile

from tests import subproc

SCRIPT = """
import os, sys
from spmdtask import native_output
native_output.capture()
os.write(2, b"a C++ library's line\\n")
print("spmdtask's own line", file=sys.stderr)
if sys.argv[1] != "none":
  native_output.log_to(sys.argv[1])
os.write(1, b"after the switch\\n")
print(native_output._filter.pid)  # pylint: disable=protected-access
"""


def _run(tmp_path, target: str):
  temp = tmp_path / "tmp"
  temp.mkdir()
  # Output to unnamed files, not pipes: waiting for the process is not waiting for the filter.
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, target], cwd=subproc.REPO,
                          env=subproc.env(1, TMPDIR=str(temp)), stdout=out, stderr=err,
                          timeout=60, check=False)
    left = sorted(os.listdir(temp))
    out.seek(0)
    filter_pid = int(out.read().decode().split()[-1])
    assert not os.path.exists(f"/proc/{filter_pid}"), "the filter outlived the process"
    err.seek(0)
    return proc.returncode, err.read().decode(), left


def test_native_lines_go_to_the_log_and_the_temp_file_is_gone_at_exit(tmp_path):
  log = tmp_path / "native.log"
  code, err, left = _run(tmp_path, str(log))
  assert code == 0 and left == []
  assert err.strip() == "spmdtask's own line"
  assert log.read_text() == "a C++ library's line\nafter the switch\n"


def test_an_exit_before_the_log_dir_is_known_leaves_nothing_behind(tmp_path):
  for i in range(3):  # the race it guards against: the filter outliving the process
    (tmp_path / str(i)).mkdir()
    code, err, left = _run(tmp_path / str(i), "none")
    assert code == 0 and left == [], left
    assert err.strip() == "spmdtask's own line"
