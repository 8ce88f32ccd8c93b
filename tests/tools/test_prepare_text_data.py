"""tools/prepare_text_data.py: a file that is not UTF-8 exits 2 naming FILE:LINE, nothing
written; a prepared --output_dir is replaced only with --overwrite, another non-empty one never."""
import json
import os

from tools import prepare_text_data


def _run(capsys, *argv):
  try:
    prepare_text_data.main(list(argv))
    code = 0
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def _tree(d):
  return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
          for r, _, fs in os.walk(d) for f in fs}


def test_bad_bytes_and_occupied_dirs_exit_2_and_overwrite_replaces(tmp_path, capsys):
  docs = tmp_path / "docs"
  docs.mkdir()
  (docs / "a.txt").write_text("one document\n")
  (docs / "b.txt").write_bytes(b"another\nna\xefve one\n")  # Latin-1: not UTF-8
  out = tmp_path / "out"
  code, stdout, err = _run(capsys, f"--input={docs}/*.txt", f"--output_dir={out}")
  assert code == 2 and not stdout and not out.exists()
  assert err == (f"prepare_text_data: config error: {docs}/b.txt:2: byte 3 of the line (0xef) "
                 "is not UTF-8 (invalid continuation byte), so its text cannot be read without "
                 "guessing the encoding. Save the file as UTF-8 (e.g. `iconv -f LATIN1 -t UTF-8 "
                 "IN > OUT` for Latin-1 text) or fix that line.\n")
  (docs / "b.txt").write_text("another\nnaïve one\n")
  assert _run(capsys, f"--input={docs}/*.txt", f"--output_dir={out}")[0] == 0
  before = _tree(out)
  code, _, err = _run(capsys, f"--input={docs}/*.txt", f"--output_dir={out}", "--seed=1")
  assert code == 2 and "pass --overwrite to replace it" in err and _tree(out) == before
  code, _, err = _run(capsys, f"--input={docs}/*.txt", f"--output_dir={out}", "--seed=1",
                      "--overwrite")
  assert code == 0, err
  with open(out / "meta.json") as f:
    meta = json.load(f)
  assert meta["seed"] == 1 and meta["kind"] == "text" and meta["vocab_size"] == 257
  # A refusal while writing (the SentencePiece vocabulary, checked in the staged dir) leaves
  # the old dir as it was, and no staged dir behind.
  before = _tree(out)
  code, _, err = _run(capsys, f"--input={docs}/*.txt", f"--output_dir={out}", "--overwrite",
                      "--tokenizer=sentencepiece", "--vocab_size=10")
  assert code == 2 and "--vocab_size=10 is too small" in err and _tree(out) == before
  assert sorted(os.listdir(tmp_path)) == ["docs", "out"]
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "keep.txt").write_text("x")
  code, _, err = _run(capsys, f"--input={docs}/*.txt", f"--output_dir={mine}", "--overwrite")
  assert code == 2 and "is not empty (keep.txt)" in err and _tree(mine) == {"keep.txt": b"x"}
