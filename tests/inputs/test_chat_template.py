"""Chat templates rendered as transformers renders them: globals, filters, the sandbox,
`{% generation %}` spans, special-token variables and where a template is read from."""
import datetime
import json

import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs import chat_template
from spmdtask.inputs.chat_template import ChatTemplate

CHAT = "tests/inputs/data/chat"
MSGS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]


def test_generation_blocks_record_the_spans_of_their_text():
  t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
                   "{% generation %}{{ m.content }}</>{% endgeneration %}{% else %}"
                   "{{ m.content }}</>{% endif %}{% endfor %}", "test")
  r = t.render(MSGS + [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
  assert r.text == "<user>Hi</><assistant>Yo</><user>Q</><assistant>A</>"
  assert [r.text[a:b] for a, b in r.spans] == ["Yo</>", "A</>"]
  assert t.has_generation_blocks
  assert t.render(MSGS).spans == ((22, 27),)  # a second render starts afresh


def test_trim_and_lstrip_blocks_and_the_generation_prompt_variable():
  t = ChatTemplate("{% for m in messages %}\n  {{ m.content }}\n{% endfor %}\n"
                   "{% if add_generation_prompt %}[A]{% endif %}", "test")
  assert t.render(MSGS).text == "  Hi\n  Yo\n"
  assert t.render(MSGS, add_generation_prompt=True).text == "  Hi\n  Yo\n[A]"
  assert not t.has_generation_blocks


def test_globals_and_filters_are_transformers_ones():
  t = ChatTemplate("{{ bos_token }}{{ messages | tojson }}|{{ {'b': 1, 'a': 'é<'} | tojson("
                   "sort_keys=True) }}|{{ strftime_now('%Y') }}|{% set ns = namespace(n=1) %}"
                   "{% set ns.n = ns.n + 1 %}{{ ns.n }}|{{ dict(x=1).x }}"
                   "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}",
                   "test", {"bos_token": "<s>"})
  text = t.render([{"role": "user", "content": "ça & <b>"}]).text
  assert text == ('<s>[{"role": "user", "content": "ça & <b>"}]|{"a": "é<", "b": 1}|'
                  f"{datetime.datetime.now().year}|2|101")
  assert json.loads(text[3:text.index("|")]) == [{"role": "user", "content": "ça & <b>"}]


def test_raise_exception_and_sandbox_escapes_are_config_errors():
  t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first!') }}"
                   "{% endif %}ok", "my.jinja")
  assert t.render(MSGS).text == "ok"
  with pytest.raises(ConfigError, match=r"line 3: the chat template my.jinja refused this "
                     r"conversation: user first!"):
    t.render([{"role": "system", "content": "s"}], where="line 3: ")
  with pytest.raises(ConfigError, match="refused"):
    ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}", "t").render(MSGS)
  with pytest.raises(ConfigError, match="refused"):
    ChatTemplate("{{ messages.__class__.__mro__ }}", "t").render(MSGS)
  with pytest.raises(ConfigError, match=r"t is not valid Jinja \(line 1"):
    ChatTemplate("{% for m in messages %}", "t")


def test_load_reads_the_jinja_file_before_the_config_and_names_a_dir_without_one(tmp_path):
  t = chat_template.load(f"{CHAT}/llama3")
  assert t.origin.endswith("llama3/chat_template.jinja") and not t.has_generation_blocks
  assert t.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
  t = chat_template.load(f"{CHAT}/chatml")
  assert t.origin.endswith("tokenizer_config.json (chat_template)") and t.has_generation_blocks
  config = {"eos_token": {"content": "</s>"}, "pad_token": None,
            "chat_template": [{"name": "tool_use", "template": "T"},
                              {"name": "default", "template": "D{{ eos_token }}"}]}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert chat_template.load(str(tmp_path)).render(MSGS).text == "D</s>"
  (tmp_path / "chat_template.jinja").write_text("J")
  assert chat_template.load(str(tmp_path)).render(MSGS).text == "J"
  (tmp_path / "chat_template.jinja").unlink()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  with pytest.raises(ConfigError, match=r"--tokenizer='.*' has no chat template: neither "
                     r"chat_template.jinja nor a `chat_template` in tokenizer_config.json"):
    chat_template.load(str(tmp_path))
