"""inputs/conversation.py: OpenAI content parts, ShareGPT and tool calls normalized to
transformers' message form exactly; null, non-text and unknown content refused by name."""
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs import conversation

CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def test_forms_normalize_to_transformers_messages():
  openai = [
      {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text",
                                                                      "text": "brief."}]},
      {"role": "user", "content": "2+3?", "name": "ann", "tool_calls": None},  # Arrow's nulls
      {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "content": "5", "tool_call_id": "c1"},
      {"role": "assistant", "content": "5.", "tool_calls": []},
  ]
  assert conversation.normalize(openai, "f:1: ", "messages") == [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "2+3?", "name": "ann"},
      {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "content": "5", "tool_call_id": "c1"},
      {"role": "assistant", "content": "5."},
  ]
  sharegpt = [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
              {"from": "gpt", "value": "A"}, {"from": "tool", "value": "T"},
              {"from": "user", "value": "Q2"}, {"from": "assistant", "value": "A2"}]
  assert conversation.of_record({"conversations": sharegpt}, "f:1: ") == [
      {"role": r, "content": c} for r, c in (("system", "S"), ("user", "Q"), ("assistant", "A"),
                                             ("tool", "T"), ("user", "Q2"), ("assistant", "A2"))]
  assert conversation.of_record({"prompt": "x"}, "f:1: ") is None


BAD = {  # case: (messages, the error after 'f.jsonl:3: ')
    "null": ([{"role": "user", "content": None}],
             r"message 0 of messages \(user\) has content null; give its text as a string"),
    "null_assistant": ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                          "tool_calls": []}],
                       r"message 1 of messages \(assistant\) has content null"),
    "number": ([{"role": "user", "content": 7}],
               r"message 0 of messages \(user\) has content of type int"),
    "image": ([{"role": "user", "content": [{"type": "text", "text": "see"},
                                            {"type": "image_url", "image_url": {"url": "u"}}]}],
              r"content part 1 of message 0 of messages \(user\) has type 'image_url': the "
              r"models spmdtask trains read text only"),
    "audio": ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
              r"content part 0 of message 0 of messages \(user\) has type 'input_audio'"),
    "part_text": ([{"role": "user", "content": [{"type": "text", "text": None}]}],
                  r"content part 0 of message 0 of messages \(user\) is a text part without "
                  r"a string \"text\""),
    "not_part": ([{"role": "user", "content": ["hi"]}],
                 r"content part 0 of message 0 of messages \(user\) is not a content part"),
    "role": ([{"role": "bot", "content": "x"}], r"message 0 of messages has role 'bot'"),
    "from": ([{"from": "bard", "value": "x"}],
             r"message 0 of messages is from 'bard'; ShareGPT speakers are human, user, gpt"),
    "value": ([{"from": "gpt", "value": None}],
              r"message 0 of messages \(gpt\) has value null"),
    "user_calls": ([{"role": "user", "content": "x", "tool_calls": [CALL]}],
                   r"message 0 of messages \(user\) has tool_calls; only an assistant"),
    "bad_call": ([{"role": "assistant", "content": "", "tool_calls": [{"name": "add"}]}],
                 r"tool call 0 of message 0 of messages is not an OpenAI function call"),
    "empty": ([], r"messages is not a non-empty list of messages"),
    "not_dict": (["hi"], r"message 0 of messages is a str, not an object"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_message_is_refused_naming_the_place(case):
  messages, match = BAD[case]
  with pytest.raises(ConfigError, match="^f.jsonl:3: " + match) as e:
    conversation.normalize(messages, "f.jsonl:3: ", "messages")
  assert "\n" not in str(e.value)
