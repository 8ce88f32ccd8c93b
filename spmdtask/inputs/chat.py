"""Conversations -> token ids and a target mask, with the model's own chat template.

A record (`records.read`: a JSONL line, a Parquet or datasets row) is one example:
  {"messages": [...]}                OpenAI messages, or ShareGPT's {"conversations": [{"from",
                                     "value"}, ...]}, in any form `conversation.normalize`
                                     takes (content parts, tool calls); optional "tools":
                                     function schemas the template shows
  {"prompt": P, "completion": C}     both lists of messages (the prompt's turns are context,
                                     the completion's assistant turns targets), or both
                                     strings (plain text as TRL takes it: the tokenizer's
                                     own special tokens, closed by eos; the completion and
                                     eos are targets)
Turns after the last assistant message teach nothing: they are dropped and counted
(`Example.trailing`), as TRL drops them. A template that leaves out a conversation's tool
calls or tool results, or writes a null content as 'None', is refused for it.

mask[i] = 1 when token i is a target (predicted from token i-1). Targets are each assistant
message's text and its end-of-turn token; system, user and tool turns and the generation
prompt (the assistant header) are not. Two ways to find them:
- the template marks assistant text with `{% generation %}` blocks: the tokens covering each
  block's characters, as transformers' `return_assistant_tokens_mask` finds them;
- it has none (Llama 3's, Qwen's): growing prefixes are rendered. For assistant message k,
  messages[:k] with the generation prompt and messages[:k+1] must both tokenize as prefixes of
  the whole conversation's ids; the tokens between them up to and including the first
  end-of-turn id are targets. A prefix that does not tokenize as a prefix is a ConfigError
  naming the template, never a guessed mask.

The end-of-turn id is the first special token the template emits after an assistant
message's text (a probe conversation), unless named.
"""
import dataclasses
import functools
import json

import numpy as np

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.inputs import chat_template, conversation, tokenizers

_PROBE = "Zq7 probe reply"


def _fail_prefix(template, where: str, k: int, what: str):
  raise ConfigError(
      f"{where}the chat template {template.origin} has no {{% generation %}} markers, and "
      f"{what} of this conversation (up to message {k}) does not tokenize as a prefix of the "
      "whole conversation's tokens, so the assistant turns cannot be told apart without "
      "guessing. Use a template that marks assistant text with {% generation %}..."
      "{% endgeneration %} (put it in chat_template.jinja beside tokenizer.json), or one whose "
      "rendering of earlier turns does not depend on later ones.")


class Chat:
  """A chat template with its tokenizer: renders and tokenizes conversations and masks them.

  `end_of_turn_id` ends an assistant turn (the decode stop token); `eos_id` is the
  tokenizer_config's eos_token's id (None without one).
  """

  def __init__(self, template: chat_template.ChatTemplate, tokenizer: tokenizers.HfTokenizer,
               end_of_turn_id: int | None = None):
    self.template, self.tokenizer = template, tokenizer
    eos = template.special_tokens.get("eos_token")
    self.eos_id = tokenizer.token_id(eos) if eos else None
    self.end_of_turn_id = (self._probe_end_of_turn() if end_of_turn_id is None
                           else int(end_of_turn_id))

  @classmethod
  def from_model_dir(cls, model_dir: str, end_of_turn_token: str | None = None,
                     field: str = "--tokenizer") -> "Chat":
    """A Hugging Face model dir's tokenizer.json and chat template."""
    path = fs.join(model_dir, tokenizers.HF_FILE)
    if not fs.isfile(path):
      raise ConfigError(f"{field}={model_dir!r} holds no {tokenizers.HF_FILE}; give the dir of "
                        "a Hugging Face model (tokenizer.json + tokenizer_config.json).")
    template = chat_template.load(model_dir, field)
    tok = tokenizers.HfTokenizer(path)
    eot = None
    if end_of_turn_token is not None:
      eot = tok.token_id(end_of_turn_token)
      if eot is None:
        raise ConfigError(f"--end_of_turn_token={end_of_turn_token!r} is not a token of {path}; "
                          "name one of its special tokens (e.g. '<|eot_id|>').")
    return cls(template, tok, eot)

  @classmethod
  def from_data_dir(cls, data_dir: str, meta: dict, field: str) -> "Chat":
    """The chat of a prepared chat data dir (tools/prepare_chat_data.py)."""
    if "chat" not in meta:
      raise ConfigError(f"{field}={data_dir!r} was not prepared from conversations (its "
                        f"{tokenizers.META_FILE} has no 'chat'); prepare it with "
                        "tools/prepare_chat_data.py.")
    file = fs.join(data_dir, chat_template.TEMPLATE_FILE)
    if not fs.isfile(file):
      raise ConfigError(f"{field}={data_dir!r} has no {chat_template.TEMPLATE_FILE} beside its "
                        f"{tokenizers.META_FILE}; copy the one it was prepared with there, or "
                        "prepare it again with tools/prepare_chat_data.py.")
    template = chat_template.ChatTemplate(fs.read_text(file), file,
                                          meta["chat"].get("special_tokens", {}))
    tok = tokenizers.load(data_dir, meta, field)
    return cls(template, tok, meta["chat"]["end_of_turn_id"])

  def ids(self, text: str) -> list[int]:
    return self.tokenizer.encoding(text).ids

  def _probe_end_of_turn(self) -> int:
    r = self.template.render([{"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": _PROBE}],
                             where="Probing the end-of-turn token (pass --end_of_turn_token to "
                             "skip it): ")
    if _PROBE not in r.text:
      raise ConfigError(f"The chat template {self.template.origin} does not show an assistant "
                        "message's content as given, so its end-of-turn token cannot be found; "
                        "pass --end_of_turn_token=TOKEN (the token that ends an assistant turn).")
    after = r.text.index(_PROBE) + len(_PROBE)
    enc, special = self.tokenizer.encoding(r.text), self.tokenizer.special_ids()
    for i, (start, _) in zip(enc.ids, enc.offsets):
      if start >= after and i in special:
        return int(i)
    raise ConfigError(f"The chat template {self.template.origin} emits no special token after "
                      "an assistant message, so its end-of-turn token is unknown; pass "
                      "--end_of_turn_token=TOKEN (the token that ends an assistant turn).")

  def encode(self, messages: list[dict], first_target: int = 0, where: str = "",
             tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int32 of a conversation (with `tools`, the schemas it may call) whose
    assistant messages from `first_target` on are targets (see the module doc). ConfigError
    naming `where` (e.g. 'FILE:LINE: ')."""
    render = functools.partial(self.template.render, where=where, tools=tools)
    full = render(messages)
    self._check_shown(messages, full.text, where, tools)
    if self.template.has_generation_blocks:
      enc = self.tokenizer.encoding(full.text)
      spans = full.spans
      if first_target:  # the prompt's own generation blocks are context
        head = render(messages[:first_target], True).text
        if not full.text.startswith(head):
          raise ConfigError(
              f"{where}the chat template {self.template.origin} renders the prompt (with its "
              "generation prompt) differently from the start of prompt + completion, so the "
              "completion cannot be told apart; give the pair as one conversation "
              '({"messages": [...]}: every assistant turn is then learned).')
        spans = tuple(s for s in spans if s[0] >= len(head))
      mask = _span_mask(enc, spans)
      ids = np.asarray(enc.ids, np.int32)
    else:
      ids = np.asarray(self.ids(full.text), np.int32)
      mask = self._prefix_mask(render, messages, first_target, ids, where)
    if not mask[1:].any():
      raise ConfigError(
          f"{where}the chat template {self.template.origin} gives this conversation no target "
          "token (its {% generation %} blocks cover no assistant text). Check that the "
          "template marks each assistant message, or drop the conversation.")
    return ids, mask

  def _prefix_mask(self, render, messages, first_target, ids, where) -> np.ndarray:
    mask = np.zeros(len(ids), np.int32)
    for k in range(first_target, len(messages)):
      if messages[k]["role"] != "assistant":
        continue
      head = self.ids(render(messages[:k], True).text)
      upto = self.ids(render(messages[:k + 1]).text)
      if list(ids[:len(head)]) != head:
        _fail_prefix(self.template, where, k, "the generation prompt")
      if list(ids[:len(upto)]) != upto:
        _fail_prefix(self.template, where, k, "a prefix")
      turn = ids[len(head):len(upto)]
      ends = np.flatnonzero(turn == self.end_of_turn_id)
      if not ends.size:
        raise ConfigError(
            f"{where}the chat template {self.template.origin} emits no end-of-turn token "
            f"(id {self.end_of_turn_id}) after assistant message {k}; pass the token that "
            "ends its assistant turns as --end_of_turn_token.")
      mask[len(head):len(head) + int(ends[0]) + 1] = 1
    return mask

  def encode_text_pair(self, prompt: str, completion: str,
                       where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a plain-text pair: prompt + completion with the tokenizer's own
    special tokens, closed by eos (else the end-of-turn id); completion and eos targets."""
    head = self.tokenizer.encode(prompt)
    ids = self.tokenizer.encode(prompt + completion)
    if ids[:len(head)] != head:
      raise ConfigError(f"{where}the prompt's tokens are not a prefix of prompt + completion's "
                        "(a token spans their boundary); end the prompt at a word boundary, "
                        "e.g. with a space or newline.")
    if len(ids) == len(head):
      raise ConfigError(f"{where}the completion is empty; give it text to learn.")
    close = self.eos_id if self.eos_id is not None else self.end_of_turn_id
    mask = np.zeros(len(ids) + 1, np.int32)
    mask[len(head):] = 1
    return np.asarray(ids + [close], np.int32), mask

  def prompt_ids(self, messages: list[dict], where: str = "",
                 tools: list | None = None) -> list[int]:
    """Decode prompt: the conversation rendered with the generation prompt."""
    text = self.template.render(messages, True, where, tools).text
    self._check_shown(messages, text, where, tools, add_generation_prompt=True)
    return self.ids(text)

  def _check_shown(self, messages: list[dict], text: str, where: str, tools=None,
                   add_generation_prompt: bool = False) -> None:
    """ConfigError where the template renders `messages` (as `text`) the same without their
    tool calls, or without their tool results' content, or writes a null content as the
    text 'None': trained on, the model would learn replies without what they depend on, or
    the word None."""
    calls = [k for k, m in enumerate(messages) if m.get("tool_calls")]
    results = [k for k, m in enumerate(messages) if m["role"] == "tool" and m["content"]]
    same = functools.partial(self._renders_same, text, tools, add_generation_prompt)
    if calls and same([
        {k: v for k, v in m.items() if k != "tool_calls"} | {"content": m["content"] or ""}
        for m in messages]):
      k = calls[0]
      raise ConfigError(
          f"{where}the chat template {self.template.origin} does not show assistant tool "
          f"calls (message {k}'s call of {messages[k]['tool_calls'][0]['function']['name']!r} "
          "leaves its rendering unchanged), so the model would learn replies without the "
          "calls they make. Use the model's own tool-calling template (chat_template.jinja "
          "beside tokenizer.json), or drop the conversation.")
    if results and same([
        m | {"content": ""} if m["role"] == "tool" else m for m in messages]):
      raise ConfigError(
          f"{where}the chat template {self.template.origin} does not show tool results "
          f"(message {results[0]}'s content leaves its rendering unchanged), so the model "
          "would learn replies without the results they read. Use the model's own "
          "tool-calling template, or drop the conversation.")
    for k, m in enumerate(messages):
      if m["content"] is None and self._writes_null:
        raise ConfigError(
            f"{where}message {k} has content null, which the chat template "
            f"{self.template.origin} writes as the text 'None'; give its content as \"\" "
            "(an assistant turn that only calls tools).")

  def _renders_same(self, text: str, tools, add_generation_prompt: bool,
                    variant: list[dict]) -> bool:
    try:
      return self.template.render(variant, add_generation_prompt, tools=tools).text == text
    except ConfigError:  # the template reacts to what was taken out
      return False

  @functools.cached_property
  def _writes_null(self) -> bool:
    """Whether the template renders an assistant's null content (beside a tool call) as
    the text 'None' (a template that refuses the probe is asked again by the real turn)."""
    call = {"type": "function", "function": {"name": "zq7_probe", "arguments": "{}"}}
    try:
      text = self.template.render([{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": None,
                                    "tool_calls": [call]}]).text
    except ConfigError:
      return False
    return "None" in text


def _span_mask(enc, spans) -> np.ndarray:
  """Tokens covering each character span [start, end) (transformers' rule: from the token of
  the first character through the token of the last; a span whose start has no token ends
  the marking)."""
  mask = np.zeros(len(enc.ids), np.int32)
  for start, end in spans:
    first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
    if first is None:
      break
    mask[first:last + 1 if last else len(mask)] = 1
  return mask


@dataclasses.dataclass(frozen=True)
class Example:
  """One record: a conversation (`first_target`: messages before it are a pair's prompt;
  `tools`: the function schemas it may call; `trailing`: messages dropped after its last
  assistant turn), or a plain-text pair (`text_pair`)."""
  messages: tuple = ()
  first_target: int = 0
  text_pair: tuple[str, str] | None = None
  tools: tuple | None = None
  trailing: int = 0

  def encode(self, chat: Chat, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    if self.text_pair is not None:
      return chat.encode_text_pair(*self.text_pair, where)
    return chat.encode(list(self.messages), self.first_target, where,
                       None if self.tools is None else list(self.tools))


def example(record: dict, where: str) -> Example:
  """The `Example` of one record (a dict of `records.read`); ConfigError naming `where`.

  Messages after the last assistant turn (e.g. a closing user turn) teach nothing: they are
  dropped, and `Example.trailing` counts them (the prepare tools report how many)."""
  turns, first = conversation.of_record(record, where), 0
  if turns is None and {"prompt", "completion"} <= set(record):
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
      return Example(text_pair=(prompt, completion))
    turns = (conversation.normalize(prompt, where, "prompt") +
             conversation.normalize(completion, where, "completion"))
    first = len(prompt)
  elif turns is None:
    is_pair = {"chosen", "rejected"} <= set(record)
    pair = (" It has 'chosen' and 'rejected': a preference pair, which "
            "tools/prepare_pref_data.py prepares for DPO." if is_pair else "")
    raise ConfigError(f"{where}has neither 'messages' (or ShareGPT's 'conversations') nor "
                      "'prompt' and 'completion'; write {\"messages\": [...]} or "
                      "{\"prompt\": ..., \"completion\": ...}." + pair)
  replies = [i for i, m in enumerate(turns) if i >= first and m["role"] == "assistant"]
  if not replies:
    raise ConfigError(f"{where}has no assistant turn{' in its completion' if first else ''}, so "
                      "nothing to learn; add the assistant's reply or drop the line.")
  return Example(tuple(turns[:replies[-1] + 1]), first, tools=_tools(record, where),
                 trailing=len(turns) - replies[-1] - 1)


def _tools(record: dict, where: str) -> tuple | None:
  """A record's function schemas: a list, or that list as a JSON string (as Parquet and
  datasets often store them)."""
  tools = record.get("tools")
  if isinstance(tools, str):
    try:
      tools = json.loads(tools)
    except json.JSONDecodeError:
      pass  # refused below, as a string
  if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                               for t in tools)):
    raise ConfigError(f"{where}'tools' is not a list of function schemas (JSON objects); "
                      "write [{\"type\": \"function\", \"function\": {...}}, ...] or drop it.")
  return None if tools is None else tuple(tools)


def prompt_messages(record: dict, where: str) -> list[dict]:
  """A decode prompt's messages: `{"messages": [...]}` (or ShareGPT's "conversations", or
  `{"prompt": [...]}`) whose last message is not the assistant's (the model writes the next
  assistant turn)."""
  key = next((k for k in ("messages", "conversations", "prompt") if k in record), "messages")
  turns = conversation.normalize(record.get(key), where, key)
  if turns[-1]["role"] == "assistant":
    raise ConfigError(f"{where}ends with an assistant message; a decode prompt ends where the "
                      "assistant is to answer (drop the last message).")
  return turns
