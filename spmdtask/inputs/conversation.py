"""Conversations as users have them -> the messages a chat template renders.

`normalize(value, where, what)` takes a list of messages in either form, per message:
  OpenAI     {"role": system|user|assistant|tool, "content": ..., ...}
  ShareGPT   {"from": human|user|gpt|assistant|system|tool, "value": "..."}
and returns transformers' form: {"role", "content", ...}. The rules:
- `content` is a string, or OpenAI content parts: the "text" parts' texts joined as written
  (no separator, as chat templates that take parts render them). Any other part (image_url,
  input_audio, file, refusal, ...) is refused by its type: the models here read text only.
- `content` null, or another type, is refused, except on an assistant message with
  `tool_calls` (OpenAI sends null there): that None reaches the template as transformers
  passes it.
- `tool_calls` (assistant only: a list of {"type": "function", "function": {"name",
  "arguments": a JSON string or an object}}) and the other keys of a message (`name`,
  `tool_call_id`, ...) reach the template unchanged; a key whose value is null is left out,
  as Parquet and datasets give every message every column's key.
- An unknown role or ShareGPT `from` is refused.
Every refusal is a ConfigError starting with `where` (e.g. 'FILE:LINE: ') that names the
message by its number in `what` (e.g. "messages") and says the fix.

`of_record(record, where)` is the conversation of a record's "messages" (OpenAI) or
"conversations" (ShareGPT) key, None where it has neither.
"""
from spmdtask.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers (`from`) and the roles they are.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
CONVERSATION_KEYS = ("messages", "conversations")


def of_record(record: dict, where: str) -> list[dict] | None:
  """The normalized conversation under `record`'s "messages" or "conversations"; None where
  it has neither key."""
  key = next((k for k in CONVERSATION_KEYS if k in record), None)
  return None if key is None else normalize(record[key], where, key)


def normalize(value, where: str, what: str) -> list[dict]:
  """The messages of `value` in transformers' form (see the module doc); ConfigError naming
  `where` and the message."""
  if not isinstance(value, list) or not value:
    raise ConfigError(f"{where}{what} is not a non-empty list of messages; write "
                      '[{"role": "user", "content": "..."}, ...].')
  return [_message(m, where, f"message {i} of {what}") for i, m in enumerate(value)]


def _message(m, where: str, which: str) -> dict:
  if not isinstance(m, dict):
    raise ConfigError(f"{where}{which} is a {type(m).__name__}, not an object; write "
                      '{"role": ..., "content": ...}.')
  if "role" not in m and "from" in m:
    return _sharegpt(m, where, which)
  role = m.get("role")
  if role not in ROLES:
    raise ConfigError(f"{where}{which} has role {role!r}; roles are {', '.join(ROLES)}. Fix "
                      "the message (or rename the role).")
  out = {k: v for k, v in m.items() if v is not None}
  calls = out.pop("tool_calls", None)
  if calls is not None and not (isinstance(calls, list) and not calls):
    out["tool_calls"] = _tool_calls(calls, role, where, which)
  content = m.get("content")
  if content is None and "tool_calls" in out:
    out["content"] = None  # an assistant's call without text, as OpenAI sends it
  else:
    out["content"] = _content(content, where, f"{which} ({role})")
  return out


def _sharegpt(m: dict, where: str, which: str) -> dict:
  speaker = m["from"]
  if speaker not in SHAREGPT_ROLES:
    raise ConfigError(f"{where}{which} is from {speaker!r}; ShareGPT speakers are "
                      f"{', '.join(SHAREGPT_ROLES)}. Fix the message (or rename the speaker).")
  role = SHAREGPT_ROLES[speaker]
  value = m.get("value")
  if not isinstance(value, str):
    raise ConfigError(f"{where}{which} ({speaker}) has value "
                      f"{'null' if value is None else 'of type ' + type(value).__name__}; "
                      'a ShareGPT message\'s "value" is its text: give a string ("" for an '
                      "empty turn) or drop the message.")
  return {"role": role, "content": value}


def _content(content, where: str, which: str) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    return "".join(_text_part(p, where, f"content part {i} of {which}")
                   for i, p in enumerate(content))
  said = "null" if content is None else f"of type {type(content).__name__}"
  raise ConfigError(f"{where}{which} has content {said}; give its text as a string (\"\" for "
                    'an empty turn) or a list of {"type": "text", "text": ...} parts, or drop '
                    "the message.")


def _text_part(part, where: str, which: str) -> str:
  kind = part.get("type") if isinstance(part, dict) else None
  if kind == "text" and isinstance(part.get("text"), str):
    return part["text"]
  if kind == "text":
    raise ConfigError(f"{where}{which} is a text part without a string \"text\"; write "
                      '{"type": "text", "text": "..."}.')
  if kind is None:
    raise ConfigError(f"{where}{which} is not a content part (an object with a \"type\"); "
                      'write {"type": "text", "text": "..."}.')
  raise ConfigError(f"{where}{which} has type {kind!r}: the models spmdtask trains read "
                    "text only, so only \"text\" parts can be learned. Drop that part (or "
                    "the conversation).")


def _tool_calls(calls, role: str, where: str, which: str) -> list:
  if role != "assistant":
    raise ConfigError(f"{where}{which} ({role}) has tool_calls; only an assistant message "
                      "calls tools. Move them to the assistant message that makes the calls.")
  if not isinstance(calls, list):
    raise ConfigError(f"{where}the tool_calls of {which} are not a list; write "
                      '[{"type": "function", "function": {"name": ..., "arguments": ...}}].')
  for i, call in enumerate(calls):
    fn = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments"), (str, dict))
        or call.get("type", "function") != "function"):
      raise ConfigError(f"{where}tool call {i} of {which} is not an OpenAI function call; write "
                        '{"type": "function", "function": {"name": "NAME", "arguments": '
                        "a JSON string or object}}.")
  return [{k: v for k, v in call.items() if v is not None} for call in calls]
