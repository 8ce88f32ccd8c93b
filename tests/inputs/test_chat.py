"""Conversation masks: equal to transformers' on a template with generation markers; on a
Llama-3-style one without, exactly the assistant texts and their end-of-turn tokens; pairs;
and every bad input a ConfigError naming its line."""
import json
import os

import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs import chat, records
from spmdtask.inputs.chat import Chat

CHAT = "tests/inputs/data/chat"
LINES = list(records.read(f"{CHAT}/conversations.jsonl"))


def _encode(c: Chat, n: int):
  where, record = LINES[n - 1]
  return chat.example(record, where).encode(c, where)


def _find(ids, sub) -> int:
  """The one position where `sub` occurs in `ids`."""
  hits = [i for i in range(len(ids) - len(sub) + 1) if list(ids[i:i + len(sub)]) == list(sub)]
  assert len(hits) == 1, (sub, hits)
  return hits[0]


def test_marker_masks_equal_transformers_with_and_without_a_system_message():
  c = Chat.from_model_dir(f"{CHAT}/chatml")
  with open(f"{CHAT}/chatml_expected.json") as f:
    expected = json.load(f)
  assert [e["line"] for e in expected] == [1, 2, 3]
  roles = [[m["role"] for m in r["messages"]] for _, r in LINES[:2]]
  assert roles[0].count("system") == 1 and "system" not in roles[1]  # with, without
  for e in expected:
    ids, mask = _encode(c, e["line"])
    np.testing.assert_array_equal(ids, e["input_ids"])
    np.testing.assert_array_equal(mask, e["assistant_masks"])
    assert mask.sum() > 0


def test_prefix_masks_are_exactly_assistant_texts_and_their_end_of_turn_tokens():
  c = Chat.from_model_dir(f"{CHAT}/llama3")
  eot = c.tokenizer.token_id("<|eot_id|>")
  assert c.end_of_turn_id == eot == 6 and not c.template.has_generation_blocks
  for n in (1, 2, 3):
    ids, mask = _encode(c, n)
    messages = LINES[n - 1][1]["messages"]
    want = np.zeros(len(ids), np.int32)
    for m in messages:
      # Each message's text, tokenized alone, sits in the conversation once (the template
      # writes '<|end_header_id|>\n\n' before it); an assistant's, with its <|eot_id|>, is
      # what the mask must cover, and nothing else.
      sub = c.ids(m["content"].strip()) + [eot]
      at = _find(ids, sub)
      if m["role"] == "assistant":
        want[at:at + len(sub)] = 1
    np.testing.assert_array_equal(mask, want)
    # The generation prompt (assistant header) is never a target.
    header = c.ids("<|start_header_id|>assistant<|end_header_id|>\n\n")
    for i in range(len(ids) - len(header) + 1):
      if list(ids[i:i + len(header)]) == header:
        assert not mask[i:i + len(header)].any()


@pytest.mark.parametrize("model", ["chatml", "llama3"])
def test_a_pair_of_message_lists_learns_only_the_completion(model):
  c = Chat.from_model_dir(f"{CHAT}/{model}")
  ids, mask = _encode(c, 4)
  want = c.ids("HELLO THERE!") + [c.end_of_turn_id]
  at = _find(ids, want)
  assert int(mask.sum()) == len(want) and mask[at:at + len(want)].all()
  # The prompt's own assistant turn ("Hello.") is context.
  assert not mask[_find(ids, c.ids("Hello.")):][:2].any()


def test_a_text_pair_learns_the_completion_and_eos():
  c = Chat.from_model_dir(f"{CHAT}/chatml")
  ids, mask = _encode(c, 5)
  head = c.tokenizer.encode("Question: what colour is the sky?\n")
  assert list(ids[:len(head)]) == head and ids[-1] == c.eos_id == 2
  assert list(mask) == [0] * len(head) + [1] * (len(ids) - len(head))
  assert c.tokenizer.decode(ids[len(head):]) == "Answer: blue."


def _conv(*roles):
  return {"messages": [{"role": r, "content": f"{r} text"} for r in roles]}


def test_bad_lines_are_config_errors_naming_the_line():
  with pytest.raises(ConfigError, match=r"^f.jsonl:7: has no assistant turn, so nothing"):
    chat.example(_conv("system", "user"), "f.jsonl:7: ")
  with pytest.raises(ConfigError, match=r"^f.jsonl:2: message 1 of messages has role 'bot'; "
                     r"roles are system, user, assistant, tool"):
    chat.example(_conv("user", "bot"), "f.jsonl:2: ")
  with pytest.raises(ConfigError, match="has no assistant turn in its completion"):
    chat.example({"prompt": [{"role": "user", "content": "a"}],
                  "completion": [{"role": "user", "content": "b"}]}, "x: ")
  with pytest.raises(ConfigError, match="neither 'messages' .* nor 'prompt' and 'completion'"):
    chat.example({"text": "hi"}, "x: ")
  with pytest.raises(ConfigError, match=r"\.\.\.\}\. It has 'chosen' and 'rejected': a "
                     "preference pair, which tools/prepare_pref_data.py prepares for DPO.$"):
    chat.example({"prompt": "q", "chosen": "a", "rejected": "b"}, "x: ")
  with pytest.raises(ConfigError, match="ends with an assistant message"):
    chat.prompt_messages(_conv("user", "assistant"), "x: ")
  assert chat.prompt_messages(_conv("system", "user"), "x: ")[1]["role"] == "user"
  assert chat.prompt_messages({"conversations": [{"from": "human", "value": "hi"}]}, "x: ") == [
      {"role": "user", "content": "hi"}]


def _model_dir(tmp_path, template: str, name="m"):
  d = tmp_path / name
  d.mkdir()
  with open(f"{CHAT}/llama3/tokenizer.json", "rb") as f:
    (d / "tokenizer.json").write_bytes(f.read())
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
  (d / "chat_template.jinja").write_text(template)
  return str(d)


def test_a_template_whose_prefixes_do_not_tokenize_as_prefixes_is_refused(tmp_path):
  # Earlier assistant turns are written without their text (as templates that drop earlier
  # reasoning do): messages[:2] is not a prefix of the whole conversation.
  template = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
              "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}<|eot_id|>"
              "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
              "<|end_header_id|>{% endif %}")
  c = Chat.from_model_dir(_model_dir(tmp_path, template))
  assert c.end_of_turn_id == 6
  c.encode(_conv("user", "assistant")["messages"])  # one turn is fine
  with pytest.raises(ConfigError, match=r"^x:3: the chat template .*chat_template.jinja has no "
                     r"\{% generation %\} markers, and a prefix of this conversation \(up to "
                     r"message 1\) does not tokenize as a prefix"):
    c.encode(_conv("user", "assistant", "user", "assistant")["messages"],
             where="x:3: ")


def test_a_template_giving_no_target_and_one_without_end_of_turn_are_refused(tmp_path):
  empty = ("{% for m in messages %}{{ m.content }}<|eot_id|>{% if m.role == 'assistant' %}"
           "{% generation %}{% endgeneration %}{% endif %}{% endfor %}")
  c = Chat.from_model_dir(_model_dir(tmp_path, empty, "empty"))
  with pytest.raises(ConfigError, match=r"^l:1: the chat template .* gives this conversation "
                     "no target token"):
    c.encode(_conv("user", "assistant")["messages"], where="l:1: ")
  with pytest.raises(ConfigError, match=r"emits no special token after an assistant message.*"
                     "--end_of_turn_token"):
    Chat.from_model_dir(_model_dir(tmp_path, "{% for m in messages %}{{ m.content }}\n"
                                   "{% endfor %}", "plain"))
  with pytest.raises(ConfigError, match=r"does not show an assistant message's content as "
                     "given.*--end_of_turn_token"):
    Chat.from_model_dir(_model_dir(tmp_path, "{% for m in messages %}{{ m.role }}<|eot_id|>"
                                   "{% endfor %}", "hidden"))
  d = _model_dir(tmp_path, "{% for m in messages %}{{ m.content }}\n{% endfor %}", "named")
  with pytest.raises(ConfigError, match="emits no end-of-turn token \\(id 6\\) after assistant "
                     "message 1"):
    Chat.from_model_dir(d, "<|eot_id|>").encode(
        _conv("user", "assistant")["messages"])
  with pytest.raises(ConfigError, match="--end_of_turn_token='<nope>' is not a token"):
    Chat.from_model_dir(d, "<nope>")
  os.remove(os.path.join(d, "tokenizer.json"))
  with pytest.raises(ConfigError, match="holds no tokenizer.json"):
    Chat.from_model_dir(d)


def test_conversations_and_decode_prompts_tokenize_as_transformers_renders_them():
  """The Llama-3-style template (bos_token from tokenizer_config.json, trim filter, the
  generation prompt): ids equal transformers' apply_chat_template."""
  c = Chat.from_model_dir(f"{CHAT}/llama3")
  with open(f"{CHAT}/llama3_expected.json") as f:
    expected = json.load(f)
  assert [e["line"] for e in expected] == [1, 2, 3]
  for e in expected:
    messages = LINES[e["line"] - 1][1]["messages"]
    ids, _ = _encode(c, e["line"])
    assert ids.tolist() == e["input_ids"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    assert c.prompt_ids(messages[:last]) == e["prompt_ids"]
    assert ids[:len(e["prompt_ids"])].tolist() == e["prompt_ids"]


def test_the_prefix_method_on_chatml_without_markers_gives_transformers_marker_masks(tmp_path):
  """Qwen's case: the ChatML template with its {% generation %} tags removed. Its generation
  blocks held exactly each assistant text and <|im_end|>, so the prefix method must find
  transformers' masks of the marked template."""
  d = tmp_path / "qwenish"
  d.mkdir()
  with open(f"{CHAT}/chatml/tokenizer_config.json") as f:
    config = json.load(f)
  template = config.pop("chat_template")
  (d / "chat_template.jinja").write_text(
      template.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
  (d / "tokenizer_config.json").write_text(json.dumps(config))
  with open(f"{CHAT}/chatml/tokenizer.json", "rb") as f:
    (d / "tokenizer.json").write_bytes(f.read())
  c = Chat.from_model_dir(str(d))
  assert not c.template.has_generation_blocks and c.end_of_turn_id == 2  # <|im_end|>
  with open(f"{CHAT}/chatml_expected.json") as f:
    for e in json.load(f):
      ids, mask = _encode(c, e["line"])
      assert ids.tolist() == e["input_ids"] and mask.tolist() == e["assistant_masks"]
  marked = Chat.from_model_dir(f"{CHAT}/chatml")
  for n in (4, 5):  # the pairs, whose prompts are context either way
    np.testing.assert_array_equal(np.stack(_encode(c, n)), np.stack(_encode(marked, n)))


def test_a_lines_tools_reach_the_template(tmp_path):
  template = ("{% if tools %}<|start_header_id|>system<|end_header_id|>{{ tools | tojson }}"
              "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}"
              "<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>{% endif %}")
  c = Chat.from_model_dir(_model_dir(tmp_path, template))
  tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
  record = {"messages": [{"role": "user", "content": "2+3"},
                         {"role": "assistant", "content": "add(2, 3)"}], "tools": tools}
  ids, mask = chat.example(record, "l: ").encode(c)
  text = c.tokenizer._tok.decode(ids.tolist(), skip_special_tokens=False)  # pylint: disable=protected-access
  assert text.startswith('<|start_header_id|>system<|end_header_id|>[{"type": "function", '
                         '"function": {"name": "add", "parameters": {}}}]<|eot_id|>')
  assert c.tokenizer._tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == (  # pylint: disable=protected-access
      "add(2, 3)<|eot_id|>")
  with pytest.raises(ConfigError, match="^l: 'tools' is not a list of function schemas"):
    chat.example({**record, "tools": "add"}, "l: ")


def _as_parts(messages):
  """Each content as two OpenAI text parts (split mid-text), joined back as written."""
  return [{**m, "content": [{"type": "text", "text": m["content"][:3]},
                            {"type": "text", "text": m["content"][3:]}]} for m in messages]


def _as_sharegpt(messages):
  speaker = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
  return [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]


@pytest.mark.parametrize("model", ["chatml", "llama3"])
def test_content_parts_and_sharegpt_give_the_plain_messages_tokens_and_mask(model):
  c = Chat.from_model_dir(f"{CHAT}/{model}")
  for n in (1, 2, 3):
    where, record = LINES[n - 1]
    want = chat.example(record, where).encode(c, where)
    for other in ({"messages": _as_parts(record["messages"])},
                  {"conversations": _as_sharegpt(record["messages"])}):
      got = chat.example(other, where).encode(c, where)
      np.testing.assert_array_equal(got[0], want[0])
      np.testing.assert_array_equal(got[1], want[1])
  # A closing user turn teaches nothing: dropped and counted, the rest encoded as before.
  where, record = LINES[1]
  closing = chat.example({"messages": record["messages"] + [
      {"role": "user", "content": "Thanks!"}]}, where)
  assert closing.trailing == 1 and len(closing.messages) == len(record["messages"])
  np.testing.assert_array_equal(np.stack(closing.encode(c)),
                                np.stack(chat.example(record, where).encode(c)))


TOOL_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "{% if m.content %}{{ m.content }}{% endif %}{% for t in m.tool_calls or [] %}"
    "[{{ t.function.name }} {{ t.function.arguments }}]{% endfor %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
TOOL_CHAT = {"messages": [{"role": "user", "content": "2+3?"},
                          {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "content": "5"},
                          {"role": "assistant", "content": "It is 5."}]}


def test_tool_calls_reach_the_template_and_one_that_hides_them_is_refused(tmp_path):
  c = Chat.from_model_dir(_model_dir(tmp_path, TOOL_TEMPLATE))
  ids, mask = chat.example(TOOL_CHAT, "l:1: ").encode(c, "l:1: ")
  decode = lambda x: c.tokenizer._tok.decode(x.tolist(), skip_special_tokens=False)  # pylint: disable=protected-access
  assert decode(ids) == (
      "<|start_header_id|>user<|end_header_id|>2+3?<|eot_id|><|start_header_id|>assistant"
      '<|end_header_id|>[add {"a": 2, "b": 3}]<|eot_id|><|start_header_id|>tool'
      "<|end_header_id|>5<|eot_id|><|start_header_id|>assistant<|end_header_id|>It is 5."
      "<|eot_id|>")
  assert decode(ids[mask == 1]) == '[add {"a": 2, "b": 3}]<|eot_id|>It is 5.<|eot_id|>'
  # The Llama-3-style fixture shows only content: the call would vanish from training.
  llama3 = Chat.from_model_dir(f"{CHAT}/llama3")
  calls_text = {"messages": [TOOL_CHAT["messages"][0], {**TOOL_CHAT["messages"][1],
                                                        "content": "Let me add."}]}
  with pytest.raises(ConfigError, match=r"^l:1: the chat template .*chat_template.jinja does "
                     r"not show assistant tool calls \(message 1's call of 'add' leaves its "
                     r"rendering unchanged\)"):
    chat.example(calls_text, "l:1: ").encode(llama3, "l:1: ")
  # ... and it writes the null content of a call-only turn as the text 'None'.
  with pytest.raises(ConfigError, match=r"^l:1: message 1 has content null, which the chat "
                     r"template .* writes as the text 'None'; give its content as \"\""):
    chat.example(TOOL_CHAT, "l:1: ").encode(llama3, "l:1: ")
  hides_results = TOOL_TEMPLATE.replace("{% for m in messages %}",
                                        "{% for m in messages if m.role != 'tool' %}")
  c = Chat.from_model_dir(_model_dir(tmp_path, hides_results, "hides"))
  with pytest.raises(ConfigError, match=r"^l:1: the chat template .* does not show tool "
                     r"results \(message 2's content leaves its rendering unchanged\)"):
    chat.example(TOOL_CHAT, "l:1: ").encode(c, "l:1: ")


def test_tool_calls_and_content_parts_tokenize_and_mask_as_transformers():
  """A template that shows tools, calls (null content; arguments a JSON string or an
  object), results and content parts: ids and masks equal apply_chat_template's
  (tools/make_tool_fixture.py), the line's tools given as a JSON string parsed."""
  c = Chat.from_model_dir(f"{CHAT}/tools/model")
  with open(f"{CHAT}/tools/expected.json") as f:
    expected = json.load(f)
  lines = list(records.read(f"{CHAT}/tools/conversations.jsonl"))
  assert [e["line"] for e in expected] == [1, 2, 3] and len(lines) == 3
  assert isinstance(lines[1][1]["tools"], str) and lines[0][1]["messages"][1]["content"] is None
  for (where, record), e in zip(lines, expected):
    ids, mask = chat.example(record, where).encode(c, where)
    assert ids.tolist() == e["input_ids"] and mask.tolist() == e["assistant_masks"]
