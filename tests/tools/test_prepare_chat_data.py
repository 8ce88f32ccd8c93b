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


BAD = {  # case: what stderr's paragraph says
    "no_assistant": r"in.jsonl:2: has no assistant turn",
    "unknown_role": r"in.jsonl:1: message 1 of messages has role 'bot'",
    "no_template": r"--tokenizer='.*model' has no chat template",
    "not_prefixes": r"in.jsonl:2: the chat template .* does not tokenize as a prefix",
    "no_target": r"in.jsonl:1: the chat template .* gives this conversation no target token",
    "existing_dir": r"--output_dir='.*' already holds a prepared data dir",
}


@pytest.mark.parametrize("case,match", BAD.items(), ids=list(BAD))
def test_each_bad_input_exits_2_with_one_paragraph_and_writes_nothing(case, match, tmp_path,
                                                                      capsys):
  model = f"{CHAT}/llama3"
  records = [GOOD, GOOD]
  out = tmp_path / "out"
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
  before = sorted(os.listdir(out)) if out.exists() else None
  code, stdout, err = _run(capsys, f"--input={_lines(tmp_path, *records)}", f"--tokenizer={model}",
                           f"--output_dir={out}", "--max_len=64")
  assert code == 2 and not stdout
  assert err.startswith("prepare_chat_data: config error: ") and err.count("\n") == 1, err
  assert re.search(match, err), err
  assert (sorted(os.listdir(out)) if out.exists() else None) == before
