"""A Hugging Face chat template (Jinja), rendered as transformers' `apply_chat_template` does.

What a template sees, as in transformers 5.x: a sandboxed Jinja environment with trim_blocks
and lstrip_blocks and the loop-control extension; the globals `raise_exception(msg)`,
`strftime_now(fmt)`, `namespace` (no underscore names) and `dict`; a `tojson` filter that is
`json.dumps` (non-ASCII kept, nothing HTML-escaped, indent/separators/sort_keys passed on);
the variables `messages`, `add_generation_prompt`, `tools`, `documents` and the named special
tokens of tokenizer_config.json (`bos_token`, `eos_token`, ...); and the
`{% generation %}...{% endgeneration %}` block, whose text is output unchanged and whose
character span in the rendered text is recorded (what `return_assistant_tokens_mask` uses).

Where the template comes from (transformers' order): `chat_template.jinja` beside the
tokenizer, else `chat_template` in tokenizer_config.json (a string, or a list of
{'name', 'template'} of which 'default' is used).
"""
import dataclasses
import datetime
import json
import re

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from spmdtask import fs
from spmdtask.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# The named special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _Generation(jinja2.ext.Extension):
  """`{% generation %}BODY{% endgeneration %}`: outputs BODY, recording its character span
  in the output rendered so far (the environment's `spans` / `blocks` of the current render)."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

  def _record(self, caller):
    text = caller()
    record = self.environment.recording
    if record is not None:
      blocks, spans = record
      start = sum(map(len, blocks))
      spans.append((start, start + len(text)))
    return text


class _Namespace(jinja2.utils.Namespace):
  """Jinja's namespace without underscore-named attributes (no way to CPython internals)."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, rest = args[0], args[1:]
    attrs = dict(*rest, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"a chat template set namespace attribute {name!r}.")


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=dict,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  env.recording = None  # (blocks, spans) while `render` tracks generation spans
  return env


@dataclasses.dataclass(frozen=True)
class Rendered:
  """A rendered conversation and the [start, end) character spans of its generation blocks."""
  text: str
  spans: tuple[tuple[int, int], ...]


class ChatTemplate:
  """A chat template and the special-token variables it is rendered with.

  `origin` names where it was read (errors name it); `has_generation_blocks` says whether it
  marks assistant text with `{% generation %}`.
  """

  def __init__(self, source: str, origin: str, special_tokens: dict[str, str] | None = None):
    self.source, self.origin = source, origin
    self.special_tokens = dict(special_tokens or {})
    self._env = _environment()
    try:
      self._template = self._env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ConfigError(f"The chat template {origin} is not valid Jinja (line {e.lineno}: "
                        f"{e.message}); fix the template or use the model's own.") from None
    self.has_generation_blocks = _GENERATION_TAG.search(source) is not None

  def render(self, messages: list[dict], add_generation_prompt: bool = False,
             where: str = "", tools: list | None = None) -> Rendered:
    """The text of `messages` (and the JSON schemas of `tools` the model may call) and its
    generation spans. ConfigError (naming `where`, e.g. the JSONL line) when the template
    raises (`raise_exception`) or fails."""
    blocks, spans = [], []
    self._env.recording = (blocks, spans)
    try:
      for block in self._template.generate(
          messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
          documents=None, **self.special_tokens):
        blocks.append(block)
    except jinja2.TemplateError as e:
      raise ConfigError(f"{where}the chat template {self.origin} refused this conversation: "
                        f"{e}. Fix the conversation (roles, order) for this model's "
                        "template.") from None
    finally:
      self._env.recording = None
    return Rendered("".join(blocks), tuple(spans))


def _token_text(value) -> str | None:
  """A tokenizer_config.json token entry: a string or {'content': ...}."""
  return value.get("content") if isinstance(value, dict) else value


def read_config(model_dir: str) -> dict:
  """MODEL_DIR/tokenizer_config.json, or {} when there is none."""
  path = fs.join(model_dir, CONFIG_FILE)
  return json.loads(fs.read_text(path)) if fs.isfile(path) else {}


def special_tokens(config: dict) -> dict[str, str]:
  """The named special tokens of a tokenizer_config.json, as template variables."""
  out = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
  return {k: v for k, v in out.items() if v is not None}


def present(model_dir: str) -> bool:
  """Whether a Hugging Face model (or tokenizer) dir has a chat template (`load` finds it)."""
  return (fs.isfile(fs.join(model_dir, TEMPLATE_FILE))
          or bool(read_config(model_dir).get("chat_template")))


def load(model_dir: str, field: str = "--tokenizer") -> ChatTemplate:
  """The chat template of a Hugging Face model (or tokenizer) dir; ConfigError naming `field`
  when it has none."""
  config = read_config(model_dir)
  file = fs.join(model_dir, TEMPLATE_FILE)
  if fs.isfile(file):
    return ChatTemplate(fs.read_text(file), file, special_tokens(config))
  source = config.get("chat_template")
  if isinstance(source, list):  # named templates: transformers uses 'default'
    source = {t.get("name"): t.get("template") for t in source}.get("default")
  if not isinstance(source, str) or not source:
    raise ConfigError(
        f"{field}={model_dir!r} has no chat template: neither {TEMPLATE_FILE} nor a "
        f"`chat_template` in {CONFIG_FILE}. Give the dir of a chat (instruct) model, or put "
        f"the template its model was tuned with into {TEMPLATE_FILE} there.")
  return ChatTemplate(source, f"{fs.join(model_dir, CONFIG_FILE)} (chat_template)",
                      special_tokens(config))
