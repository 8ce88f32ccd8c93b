"""tools/prepare_chat_data.py end to end on the chat fixtures: the files, masks read back
through PackedLmInput equal transformers' (markers) and the prefix method's, overlong
conversations dropped or cut, and every bad input exit 2 with one paragraph, nothing written."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from spmdtask.inputs import chat, records
from spmdtask.inputs.text import PackedLmInput
from tools import prepare_chat_data

CHAT = "tests/inputs/data/chat"
JSONL = f"{CHAT}/conversations.jsonl"


def _run(capsys, *argv):
  """(exit code, stdout, stderr) of the tool's main."""
  try:
    prepare_chat_data.main(list(argv))
    code = 0
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def _segments(data_dir, split):
  """{document tokens: weights of its predictions} of every packed segment of a split."""
  inp = PackedLmInput(data_dir=data_dir, split=split, batch_size=8, seq_len=128, repeat=False,
                      process_index=0, process_count=1)
  b = inp.batch_at(0)
  got = {}
  for r in range(b["inputs"].shape[0]):
    for s in set(b["segment_ids"][r].tolist()) - {0}:
      at = np.flatnonzero(b["segment_ids"][r] == s)
      got[tuple(b["inputs"][r, at].tolist())] = b["weights"][r, at][:-1].tolist()
  return got


@pytest.mark.parametrize("model", ["chatml", "llama3"])
def test_prepared_masks_read_back_packed_equal_the_expected(model, tmp_path, capsys):
  out = str(tmp_path / "data")
  code, stdout, err = _run(capsys, f"--input={JSONL}", f"--tokenizer={CHAT}/{model}",
                           f"--output_dir={out}", "--max_len=128", "--eval_fraction=0.2")
  assert code == 0, err
  assert sorted(os.listdir(out)) == [
      "chat_template.jinja", "eval-00000-of-00001.tfrecord", "eval_index.npz", "meta.json",
      "tokenizer.json", "train-00000-of-00004.tfrecord", "train-00001-of-00004.tfrecord",
      "train-00002-of-00004.tfrecord", "train-00003-of-00004.tfrecord", "train_index.npz"]
  with open(os.path.join(out, "meta.json")) as f:
    meta = json.load(f)
  eot = {"chatml": 2, "llama3": 6}[model]
  assert meta["target_mask"] and meta["chat"]["end_of_turn_id"] == eot
  assert meta["splits"]["train"]["num_documents"] == 4
  assert meta["splits"]["eval"]["num_documents"] == 1
  assert (f"--exp=stages.Sft --job_log_dir={out}_sft --init_from=IMPORT_DIR --data_dir={out}"
          f"\n  (IMPORT_DIR: your model's job dir, from python tools/convert_hf.py "
          f"--from_hf={os.path.abspath(CHAT)}/{model} --job_log_dir=IMPORT_DIR") in stdout
  assert ("5 conversations read; vocab_size=300, end_of_turn_id=" f"{eot}; ") in stdout
  assert "0 over --max_len=128 dropped" in stdout
  # Expected masks, made independently of the data dir: transformers' for the marker
  # template (conversations), the library's own for the rest (tested in tests/inputs).
  c = chat.Chat.from_model_dir(f"{CHAT}/{model}")
  want = {}
  for where, record in records.read(JSONL):
    ids, mask = chat.example(record, where).encode(c, where)
    want[tuple(ids.tolist())] = mask[1:].tolist()
  if model == "chatml":
    with open(f"{CHAT}/chatml_expected.json") as f:
      for e in json.load(f):
        assert want[tuple(e["input_ids"])] == e["assistant_masks"][1:]
  got = {**_segments(out, "train"), **_segments(out, "eval")}
  assert got == want
  assert sum(map(sum, got.values())) == sum(
      s["num_target_tokens"] for s in meta["splits"].values())


def test_overlong_conversations_are_dropped_or_cut_and_counted(tmp_path, capsys):
  code, stdout, _ = _run(capsys, f"--input={JSONL}", f"--tokenizer={CHAT}/llama3",
                         f"--output_dir={tmp_path / 'drop'}", "--max_len=80")
  assert code == 0 and "2 over --max_len=80 dropped" in stdout  # 112, 88
  with open(tmp_path / "drop" / "meta.json") as f:
    assert sum(s["num_documents"] for s in json.load(f)["splits"].values()) == 3
  code, stdout, _ = _run(capsys, f"--input={JSONL}", f"--tokenizer={CHAT}/llama3",
                         f"--output_dir={tmp_path / 'cut'}", "--max_len=40",
                         "--overlong=truncate")
  # 112, 88, 63, 71 tokens are cut to 40; lines 1 and 4 (first target at 62, 58) keep none.
  assert code == 0 and "4 cut to 40 tokens (2 of them left without a target: dropped)" in stdout
  with open(tmp_path / "cut" / "meta.json") as f:
    meta = json.load(f)
  assert meta["truncated"] == 4 and meta["no_target_after_cut"] == 2
  assert max(_lengths(tmp_path / "cut")) == 40


def _lengths(d):
  return [n for s in ("train", "eval") for n in np.load(os.path.join(d, f"{s}_index.npz"))["length"]]


def _bad_model(tmp_path, template=None):
  d = tmp_path / "model"
  d.mkdir()
  shutil.copy(f"{CHAT}/llama3/tokenizer.json", d)
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
  if template:
    (d / "chat_template.jinja").write_text(template)
  return str(d)


def _lines(tmp_path, *records):
  p = tmp_path / "in.jsonl"
  p.write_text("\n".join([json.dumps(r) for r in records]) + "\n")
  return str(p)


def _msg(role, content="text"):
  return {"role": role, "content": content}


GOOD = {"messages": [_msg("user"), _msg("assistant")]}
# Earlier assistant turns lose their text: messages[:2] is no prefix of the whole.
DROPS_EARLIER = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
                 "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}"
                 "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>"
                 "assistant<|end_header_id|>{% endif %}")
EMPTY_MARKERS = ("{% for m in messages %}{{ m.content }}<|eot_id|>{% if m.role == 'assistant' %}"
                 "{% generation %}{% endgeneration %}{% endif %}{% endfor %}")


def _tree(d) -> dict[str, bytes] | None:
  """Every file under `d` by relative path, with its bytes (None: no dir)."""
  if not os.path.isdir(d):
    return None
  return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
          for r, _, fs in os.walk(d) for f in fs}


BAD = {  # case: what stderr's paragraph says
    "no_assistant": r"in.jsonl:2: has no assistant turn",
    "unknown_role": r"in.jsonl:1: message 1 of messages has role 'bot'",
    "no_template": r"--tokenizer='.*model' has no chat template",
    "not_prefixes": r"in.jsonl:2: the chat template .* does not tokenize as a prefix",
    "no_target": r"in.jsonl:1: the chat template .* gives this conversation no target token",
    "existing_dir": r"--output_dir='.*' already holds a prepared data dir \(meta.json\); give "
                    r"a new dir, or pass --overwrite to replace it",
    "foreign_dir": r"--output_dir='.*' is not empty \(notes.txt\) and is no prepared data dir",
    "foreign_dir_overwrite": r"is not empty \(notes.txt\) .*\(--overwrite only replaces a "
                             r"prepared data dir\)",
    "latin1": r"in.jsonl:2: byte 47 of the line \(0xe9\) is not UTF-8",
    "content_null": r"in.jsonl:2: message 1 of messages \(assistant\) has content null",
    "image_part": r"in.jsonl:1: content part 0 of message 0 of messages \(user\) has type "
                  r"'image_url'",
    "from_unknown": r"in.jsonl:2: message 0 of conversations is from 'bot'",
}


@pytest.mark.parametrize("case,match", BAD.items(), ids=list(BAD))
def test_each_bad_input_exits_2_with_one_paragraph_and_writes_nothing(case, match, tmp_path,
                                                                      capsys):
  model = f"{CHAT}/llama3"
  records = [GOOD, GOOD]
  out = tmp_path / "out"
  flags = []
  if case == "no_assistant":
    records = [GOOD, {"messages": [_msg("system"), _msg("user")]}]
  elif case == "unknown_role":
    records = [{"messages": [_msg("user"), _msg("bot")]}, GOOD]
  elif case == "no_template":
    model = _bad_model(tmp_path)
  elif case == "not_prefixes":
    model = _bad_model(tmp_path, DROPS_EARLIER)
    records = [GOOD, {"messages": [_msg("user"), _msg("assistant"), _msg("user"),
                                   _msg("assistant")]}]
  elif case == "no_target":
    model = _bad_model(tmp_path, EMPTY_MARKERS)
  elif case == "existing_dir":
    assert _run(capsys, f"--input={_lines(tmp_path, *records)}", f"--tokenizer={model}",
                f"--output_dir={out}", "--max_len=64")[0] == 0
  elif case.startswith("foreign_dir"):
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    flags = ["--overwrite"] if case.endswith("overwrite") else []
  elif case == "content_null":
    records = [GOOD, {"messages": [_msg("user"), _msg("assistant", None)]}]
  elif case == "image_part":
    records = [{"messages": [_msg("user", [{"type": "image_url", "image_url": {"url": "x"}}]),
                             _msg("assistant")]}, GOOD]
  elif case == "from_unknown":
    records = [GOOD, {"conversations": [{"from": "bot", "value": "hi"}]}]
  path = _lines(tmp_path, *records)
  if case == "latin1":  # the second line's é in Latin-1
    with open(path, "ab") as f:
      f.write(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with open(path, "rb") as f:
      lines = f.read().split(b"\n")
    with open(path, "wb") as f:
      f.write(b"\n".join([lines[0], lines[2], lines[1], b""]))
  before = _tree(out)
  code, stdout, err = _run(capsys, f"--input={path}", f"--tokenizer={model}",
                           f"--output_dir={out}", "--max_len=64", *flags)
  assert code == 2 and not stdout
  assert err.startswith("prepare_chat_data: config error: ") and err.count("\n") == 1, err
  assert re.search(match, err), err
  assert _tree(out) == before  # byte for byte
  assert [p for p in os.listdir(tmp_path) if ".partial-" in p] == []


def _records(n):
  """Lines n of the fixture (its conversations), as records."""
  with open(JSONL) as f:
    return [json.loads(line) for line in f.read().splitlines()[:n]]


def test_parquet_and_datasets_inputs_give_the_jsonl_inputs_data_dir(tmp_path, capsys):
  import datasets  # pylint: disable=g-import-not-at-top
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  rows = _records(3)  # the three {"messages": ...} lines: one Arrow schema
  sources = {"jsonl": _lines(tmp_path, *rows), "parquet": str(tmp_path / "c.parquet"),
             "datasets": str(tmp_path / "ds")}
  pq.write_table(pa.Table.from_pylist(rows), sources["parquet"])
  datasets.Dataset.from_list(rows).save_to_disk(sources["datasets"])
  trees = {}
  for name, source in sources.items():
    out = tmp_path / f"out_{name}"
    code, stdout, err = _run(capsys, f"--input={source}", f"--tokenizer={CHAT}/llama3",
                             f"--output_dir={out}", "--max_len=128", "--eval_fraction=0.3")
    assert code == 0, err
    assert (f"{out}: 3 conversations read; vocab_size=300, end_of_turn_id=6; train: 2 "
            "documents") in stdout, stdout
    trees[name] = _tree(out)
    meta = json.loads(trees[name].pop("meta.json"))
    assert meta["input"] == source and meta["kind"] == "chat" and meta["records"] == 3
  assert trees["parquet"] == trees["jsonl"] and trees["datasets"] == trees["jsonl"]


def test_overwrite_replaces_a_prepared_dir_and_the_hint_continues_an_import(tmp_path, capsys):
  model = tmp_path / "import"  # an import's job dir: tokenizer files beside model_overrides.txt
  shutil.copytree(f"{CHAT}/llama3", model)
  (model / "model_overrides.txt").write_text("--fdl_set=task.model.vocab_size=300\n")
  out = tmp_path / "data"
  args = [f"--input={JSONL}", f"--tokenizer={model}", f"--output_dir={out}", "--max_len=128"]
  assert _run(capsys, *args, "--eval_fraction=0.2")[0] == 0
  code, _, err = _run(capsys, *args, "--eval_fraction=0.4")
  assert code == 2 and "pass --overwrite to replace it" in err
  (out / "stale.tfrecord").write_bytes(b"old")  # a file of the old dir: replaced with it
  code, stdout, err = _run(capsys, *args, "--eval_fraction=0.4", "--overwrite")
  assert code == 0, err
  with open(out / "meta.json") as f:
    meta = json.load(f)
  assert meta["eval_fraction"] == 0.4 and meta["splits"]["eval"]["num_documents"] == 2
  assert "stale.tfrecord" not in os.listdir(out)
  assert stdout.splitlines()[-2:] == [
      "Fine-tune your model on it:",
      f"  python -m spmdtask.main --exp=stages.Sft --job_log_dir={out}_sft --init_from={model} "
      f"--data_dir={out}"]
