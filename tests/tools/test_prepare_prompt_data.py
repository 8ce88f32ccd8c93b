"""tools/prepare_prompt_data.py end to end on the chat fixtures: prompt ids equal
transformers' apply_chat_template(..., add_generation_prompt=True), read back through
PromptData with their answers and stop ids; an import's job dir as --tokenizer; overlong
prompts dropped and counted; every bad input exit 2 with one paragraph, nothing written."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from spmdtask.inputs import prompt_data
from spmdtask.inputs.answers import PromptData
from tools import prepare_prompt_data

CHAT = "tests/inputs/data/chat"
LLAMA3 = f"{CHAT}/llama3"
HEAD = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
GEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _run(capsys, *argv):
  """(exit code, stdout, stderr) of the tool's main."""
  try:
    prepare_prompt_data.main(list(argv))
    code = 0
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def _lines(tmp_path, *records, name="in.jsonl"):
  p = tmp_path / name
  p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
  return str(p)


def _expected():
  """(prompt messages, transformers' prompt ids) of the llama3 fixture's conversations."""
  with open(f"{CHAT}/conversations.jsonl") as f:
    lines = f.read().splitlines()
  with open(f"{CHAT}/llama3_expected.json") as f:
    for e in json.load(f):
      messages = json.loads(lines[e["line"] - 1])["messages"]
      last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
      yield messages[:last], e["prompt_ids"]


def test_prompts_equal_transformers_and_read_back_with_answers_and_stop_ids(tmp_path, capsys):
  expected = list(_expected())
  parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]
  records = ([{"prompt": m, "answer": i} for i, (m, _) in enumerate(expected)] +
             [{"prompt": "What is 2 + 3?", "answer": {"sum": 5}},
              {"prompt": [{"role": "user", "content": parts}], "answer": [5]},
              {"prompt": "x " * 100}])  # over --max_prompt_len: dropped
  model = tmp_path / "model"  # the fixture with a config.json naming two eos ids
  shutil.copytree(LLAMA3, model)
  (model / "config.json").write_text(json.dumps({"eos_token_id": [0, 6]}))
  out = tmp_path / "out"
  code, stdout, err = _run(capsys, f"--input={_lines(tmp_path, *records)}",
                           f"--tokenizer={model}", f"--output_dir={out}", "--max_prompt_len=100")
  assert code == 0 and not err, err
  assert stdout == (f"{out}: 5 prompts, the longest 100 tokens; 1 over --max_prompt_len=100 "
                    "dropped; 2 plain-string prompts rendered as one user message each; 1 "
                    "without an answer (null); vocab_size=300, stop ids [6, 0]\n")
  data = PromptData(data_dir=str(out), batch_size=5, process_index=0, process_count=1)
  for ids, (_, want) in zip(data.token_ids, expected):
    assert ids == want  # transformers' own ids, generation prompt on
  text = HEAD + "What is 2 + 3?<|eot_id|>" + GEN
  assert data.tokenizer.decode(data.token_ids[3]) == text
  assert data.token_ids[4] == data.token_ids[3]  # text parts joined
  assert data.stop_ids == (6, 0)  # the end-of-turn (= the tokenizer's eos), config's 0
  batch = data.batch_at(0)
  assert batch["prompt_lens"].tolist() == list(map(len, data.token_ids))
  assert batch["prompts"][3, :len(data.token_ids[3])].tolist() == data.token_ids[3]
  assert list(batch["answers"]) == [0, 1, 2, {"sum": 5}, [5]]
  with open(out / "meta.json") as f:
    meta = json.load(f)
  assert meta["chat"]["end_of_turn_id"] == 6 and meta["kind"] == "prompts"
  assert sorted(os.listdir(out)) == ["chat_template.jinja", "meta.json", "prompts.jsonl",
                                     "tokenizer.json"]
  # --raw: a string prompt encoded as is; --overwrite replaces the dir
  code, stdout, _ = _run(capsys, f"--input={_lines(tmp_path, {'prompt': 'hi', 'answer': 1})}",
                         f"--tokenizer={model}", f"--output_dir={out}", "--raw", "--overwrite")
  assert code == 0 and "1 plain-string prompts encoded as is (--raw)" in stdout
  assert PromptData(data_dir=str(out), batch_size=1).token_ids == [[78, 79]]


def test_an_imports_job_dir_gives_the_tokenizer_template_and_eos(tmp_path):
  """convert_hf --from_hf's job dir: tokenizer files and hf_source.json (the model's config
  and the dir it came from, whose chat template renders)."""
  job = tmp_path / "import"
  job.mkdir()
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{LLAMA3}/{f}", job)
  (job / "hf_source.json").write_text(json.dumps(
      {"config": {"eos_token_id": 1}, "base_model_name_or_path": os.path.abspath(LLAMA3)}))
  conv, tok, eos = prompt_data.model_chat(str(job))
  assert eos == [1] and prompt_data.stop_ids(conv, tok, eos) == [6, 1]
  messages, want = next(_expected())
  assert conv.prompt_ids(messages) == want
  # the next command: the GRPO stage from the import (or a stage), on the prompts
  assert prepare_prompt_data.train_command("/d/prompts", str(job)) is None
  (job / "model_overrides.txt").write_text("--fdl_set=task.model.vocab_size=300\n")
  assert prepare_prompt_data.train_command("/d/prompts", str(job)) == (
      f"python -m spmdtask.main --exp=stages.Grpo --job_log_dir=/d/prompts_grpo "
      f"--init_from={job} --data_dir=/d/prompts --reward=PATH.py:FN")


def _no_template(tmp_path):
  d = tmp_path / "bare"
  d.mkdir()
  shutil.copy(f"{LLAMA3}/tokenizer.json", d)
  return str(d)


GOOD = {"prompt": "What is 1 + 2?", "answer": 3}
MSGS = [{"role": "user", "content": "hi"}]
BAD = {  # case: (records or bytes, extra flags, what stderr's paragraph says)
    "non_utf8": (b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', [],
                 r"in.jsonl:2: byte 16 of the line \(0xe9\) is not UTF-8"),
    "bad_json": (['{"prompt": "a",', GOOD], [], r"in.jsonl:1: is not JSON"),
    "no_prompt": ([GOOD, {"question": "a"}], [], r'in.jsonl:2: has no "prompt" \(it has '
                  r"\['question'\]\)"),
    "prompt_null": ([{"prompt": None}], [], r'in.jsonl:1: "prompt" is null'),
    "content_null": ([{"prompt": [{"role": "user", "content": None}]}], [],
                     r"in.jsonl:1: message 0 of prompt \(user\) has content null"),
    "content_number": ([{"prompt": [{"role": "user", "content": 5}]}], [],
                       r"in.jsonl:1: message 0 of prompt \(user\) has content of type int"),
    "image_part": ([{"prompt": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}], [],
                   r"in.jsonl:1: content part 0 of message 0 of prompt \(user\) has type 'image_url'"),
    "ends_with_assistant": ([{"prompt": MSGS + [{"role": "assistant", "content": "a"}]}], [],
                            r"in.jsonl:1: the prompt ends with an assistant message"),
    "unknown_role": ([{"prompt": [{"role": "bot", "content": "a"}]}], [],
                     r"in.jsonl:1: message 0 of prompt has role 'bot'"),
    "no_template": ([GOOD], ["bare"], r"--tokenizer='.*bare' has no chat template"),
    "messages_raw_no_template": ([GOOD, {"prompt": MSGS}], ["bare", "--raw"],
                                r"in.jsonl:2: the prompt is a list of messages, and "
                                "--tokenizer has no chat template"),
    "all_too_long": ([GOOD, GOOD], ["--max_prompt_len=3"],
                     r"all 2 prompts are longer than --max_prompt_len=3 tokens"),
    "bad_limit": ([GOOD], ["--max_prompt_len=0"], r"--max_prompt_len=0: give a positive"),
    "no_input": (None, [], r"--input='.*missing.jsonl' matches no file"),
    "non_empty_dir": ([GOOD], ["occupied", "--overwrite"],
                      r"--output_dir='.*out' is not empty \(notes.txt\) and is no prepared data "
                      r"dir .* \(--overwrite only replaces a prepared data dir\)"),
    "prepared_dir": ([GOOD], ["prepared"], r"--output_dir='.*out' already holds a prepared data "
                     r"dir \(meta.json\); give a new dir, or pass --overwrite"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_input_exits_2_with_one_paragraph_and_writes_nothing(case, tmp_path, capsys):
  records, extra, match = BAD[case]
  if records is None:
    path = str(tmp_path / "missing.jsonl")
  elif isinstance(records, bytes):
    path = str(tmp_path / "in.jsonl")
    (tmp_path / "in.jsonl").write_bytes(records)
  else:
    path = _lines(tmp_path, *records)
  model = _no_template(tmp_path) if "bare" in extra else LLAMA3
  out = tmp_path / "out"
  if "occupied" in extra:
    out.mkdir()
    (out / "notes.txt").write_text("mine")
  if "prepared" in extra:
    assert _run(capsys, f"--input={path}", f"--tokenizer={model}", f"--output_dir={out}")[0] == 0
  flags = [f for f in extra if f.startswith("--")]
  before = sorted(os.listdir(out)) if out.exists() else None
  code, stdout, err = _run(capsys, f"--input={path}", f"--tokenizer={model}",
                           f"--output_dir={out}", *flags)
  assert code == 2 and not stdout
  assert err.startswith("prepare_prompt_data: config error: ") and err.count("\n") == 1, err
  assert re.search(match, err), err
  assert (sorted(os.listdir(out)) if out.exists() else None) == before
  if "occupied" in extra:
    assert (out / "notes.txt").read_text() == "mine"


def test_rows_repeat_over_epochs_with_each_processs_share(tmp_path, capsys):
  out = tmp_path / "out"
  records = [{"prompt": f"Q{i}", "answer": i} for i in range(3)]
  assert _run(capsys, f"--input={_lines(tmp_path, *records)}", f"--tokenizer={LLAMA3}",
              f"--output_dir={out}")[0] == 0
  second = PromptData(data_dir=str(out), batch_size=4, process_index=1, process_count=2)
  batch = second.batch_at(1)  # global rows 6, 7: examples 0, 1 of the third epoch
  assert batch["ids"].tolist() == [6, 7] and list(batch["answers"]) == [0, 1]
  assert np.array_equal(batch["prompts"][0, :batch["prompt_lens"][0]], second.token_ids[0])


def test_another_kind_of_data_dir_is_refused_naming_its_tool(tmp_path):
  d = tmp_path / "chat"
  d.mkdir()
  (d / "meta.json").write_text(json.dumps({"tokenizer": "hf", "vocab_size": 300, "eod_id": 6,
                                           "chat": {"end_of_turn_id": 6}}))
  with pytest.raises(prompt_data.ConfigError,
                     match=r"datasets\['train'\].data_dir='.*chat' \(--data_dir\) holds "
                     r"conversations .* this input reads prompts with answers \(GRPO samples "
                     r"completions of prompts\). Give it a dir written by "
                     r"tools/prepare_prompt_data.py"):
    PromptData(data_dir=str(d))


def test_raw_prompts_of_a_model_without_a_template(tmp_path, capsys):
  out = tmp_path / "out"
  code, stdout, _ = _run(capsys, f"--input={_lines(tmp_path, {'prompt': 'hi', 'answer': 1})}",
                         f"--tokenizer={_no_template(tmp_path)}", f"--output_dir={out}", "--raw")
  assert code == 0 and stdout.endswith("vocab_size=300, stop ids []\n"), stdout
  data = PromptData(data_dir=str(out), batch_size=1)
  assert data.token_ids == [[78, 79]] and data.stop_ids == ()  # runs to max_new_tokens
  assert "chat" not in json.loads((out / "meta.json").read_text())
