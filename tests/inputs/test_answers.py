"""Prompts with answers: JSONL (plain and chat prompts), each process's share, bad lines."""
import json

import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs.answers import AnswerPrompts, SumPrompts, SumSft


def _write(tmp_path, rows):
  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_plain_prompts_with_answers_per_process(tmp_path):
  path = _write(tmp_path, [{"prompt": "1+1=", "answer": 2}, {"prompt": "10+3=", "answer": "13"},
                           {"prompt": "a", "answer": "x"}, {"prompt": "bb", "answer": "y"}])
  halves = [AnswerPrompts(path=path, batch_size=4, tokenizer="bytes", process_index=i,
                          process_count=2).batch_at(0) for i in range(2)]
  assert [list(h["answers"]) for h in halves] == [["2", "13"], ["x", "y"]]
  assert halves[0]["prompts"].shape == (2, 5) and list(halves[0]["prompt_lens"]) == [4, 5]
  assert bytes(halves[0]["prompts"][1].tolist()).decode() == "10+3="
  # the input repeats: batch 1 is the same examples with the next ids
  again = AnswerPrompts(path=path, batch_size=4, tokenizer="bytes", process_index=0,
                        process_count=1).batch_at(1)
  assert list(again["ids"]) == [4, 5, 6, 7] and list(again["answers"]) == ["2", "13", "x", "y"]


def test_chat_prompt_needs_a_template_and_bad_lines_say_where(tmp_path):
  path = _write(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
  with pytest.raises(ConfigError, match="p.jsonl:1: the prompt is a list of messages"):
    AnswerPrompts(path=path, tokenizer="bytes")
  path = _write(tmp_path, [{"prompt": "1+1="}])
  with pytest.raises(ConfigError, match=r'p.jsonl:1: needs "prompt" .* and "answer"'):
    AnswerPrompts(path=path, tokenizer="bytes")


def test_sums_and_their_warm_start_rows():
  p = SumPrompts(batch_size=4, process_index=0, process_count=1).batch_at(0)
  for row, n, answer in zip(p["prompts"], p["prompt_lens"], p["answers"]):
    a, b = bytes(row[:n].tolist()).decode().rstrip("=").split("+")
    assert int(a) + int(b) == int(answer)
  s = SumSft(batch_size=2, seq_len=8, process_index=0, process_count=1).batch_at(0)
  text = bytes(int(t) for t in s["inputs"][0] if 0 < t < 256).decode()
  a, rest = text.split("+")
  b, total = rest.split("=")
  assert int(a) + int(b) == int(total)
  # targets: the sum's digits and the end byte (256)
  assert list(s["targets"][0][s["weights"][0] > 0][-1:]) == [256]
  np.testing.assert_array_equal(s["targets"][:, :-1], s["inputs"][:, 1:])
