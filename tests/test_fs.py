"""spmdtask.fs on local paths and on a URL filesystem (fsspec's in-memory one; gs:// itself
is tested against an emulator in test_gcs.py)."""
import os

import pytest

from spmdtask import fs
from spmdtask.run import summaries
from spmdtask.errors import ConfigError
from tests import subproc as h


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
  if request.param == "local":
    yield str(tmp_path / "root")
    return
  url = f"memory:///fs_test/{os.getpid()}/{tmp_path.name}"
  yield url
  fs.rm(url, recursive=True)


def test_file_ops(root):
  a = fs.join(root, "d", "a.txt")
  fs.makedirs(fs.join(root, "d"))
  fs.write_text(a, "x")
  fs.append_text(a, "y\n")
  fs.append_text(fs.join(root, "d", "new.jsonl"), "1\n")
  fs.write_bytes(fs.join(root, "d", "sub", "b.bin"), b"\0\1")
  assert fs.read_text(a) == "xy\n" and fs.read_bytes(fs.join(root, "d", "sub", "b.bin")) == b"\0\1"
  assert fs.listdir(fs.join(root, "d")) == ["a.txt", "new.jsonl", "sub"]
  assert fs.listdir(fs.join(root, "missing")) == []
  assert fs.glob(fs.join(root, "d", "*.txt")) == [a]  # the same kind of path as the pattern
  assert fs.isdir(fs.join(root, "d")) and fs.isfile(a) and not fs.exists(fs.join(root, "no"))
  fs.rm(fs.join(root, "d"), recursive=True)
  fs.rm(fs.join(root, "d"), recursive=True)  # already gone: fine
  assert not fs.exists(a)


def test_urls_stay_urls(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert fs.absolute("gs://b/x/") == "gs://b/x"
  assert fs.join("gs://b/x", "checkpoints") == "gs://b/x/checkpoints"
  assert fs.absolute("rel") == str(tmp_path / "rel")
  fs.makedirs("gs://b/x")  # object stores have no directories: nothing local either
  assert os.listdir(tmp_path) == []


def test_staged_dir_uploads_and_deletes_its_local_copy(root):
  staged = fs.Staged(fs.join(root, "logs"))
  with open(os.path.join(staged.local, "x.log"), "w") as f:
    f.write("hello")
  staged.close()
  assert fs.read_text(fs.join(root, "logs", "x.log")) == "hello"
  assert staged.remote == (not os.path.exists(staged.local))


def test_summaries_through_the_layer(root, tmp_path):
  w = summaries.SummaryWriter(fs.join(root, "train"), max_file_bytes=1)  # a file per flush
  for step in (1, 2, 3):
    w.scalars(step, {"loss": 1.0 / step})
    w.flush()
  w.close()
  names = fs.listdir(fs.join(root, "train"))
  assert len(names) == 3 and all(n.startswith("events.out.tfevents.") for n in names)
  local = tmp_path / "tb"
  local.mkdir()
  for n in names:
    (local / n).write_bytes(fs.read_bytes(fs.join(root, "train", n)))
  assert h.scalars(str(local))["loss"] == {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3)}


def test_only_gs_urls_are_probed():
  assert fs.unreachable("/no/such/dir") is None and fs.unreachable("memory://x/y") is None
  fs.check_reachable("/tmp", "--job_log_dir")  # no error


def test_unreachable_gs_is_a_config_error(monkeypatch):
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nobody listens on 9
  with pytest.raises(ConfigError, match=r"--job_log_dir='gs://b/x' cannot be reached \(no "
                     r"connection to 127\.0\.0\.1:9\)"):
    fs.check_reachable("gs://b/x", "--job_log_dir")


def test_read_text_is_strict_utf8_naming_file_line_and_byte(tmp_path):
  f = tmp_path / "doc.txt"
  f.write_bytes(b"\xef\xbb\xbfline one\nline two\nthird \xff line\n")
  with pytest.raises(ConfigError, match=rf"^{f}:3: byte 7 of the line \(0xff\) is not UTF-8 "
                     r"\(invalid start byte\), so its text cannot be read without guessing"):
    fs.read_text(str(f))
  f.write_bytes(b"\xef\xbb\xbfline one\nzw\xc3\xb6lf\n")  # the byte-order mark dropped
  assert fs.read_text(str(f)) == "line one\nzw\u00f6lf\n"
