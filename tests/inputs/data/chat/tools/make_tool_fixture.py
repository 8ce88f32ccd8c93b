"""Writes tests/inputs/data/chat/tools/: a model dir (the chat fixtures' tokenizer with a
ChatML-style template written for these tests that shows tools, tool calls, tool results
and content parts, with {% generation %} markers) and expected.json: transformers'
apply_chat_template input_ids and assistant_masks of each line of conversations.jsonl, its
messages and tools given as transformers takes them (content parts and null content as
they are; tools parsed where a line gives them as a JSON string).

    /work/torchenv/bin/python tests/inputs/data/chat/tools/make_tool_fixture.py

(transformers 5.24.0; the tests import neither transformers nor torch.)"""
import json
import os
import shutil

from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}"
    "{%- for p in c if p.type == 'text' -%}{{ p.text }}{%- endfor -%}{%- endif -%}{%- endmacro -%}\n"
    "{%- if tools -%}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ text(messages[0].content) }}\n{% endif -%}"
    "Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' -%}<|im_start|>system\n{{ text(messages[0].content) }}"
    "<|im_end|>\n{%- endif -%}\n"
    "{%- for m in messages if m.role != 'system' -%}\n"
    "{%- if m.role == 'assistant' -%}<|im_start|>assistant\n{% generation %}"
    "{{ text(m.content) }}{%- for c in m.tool_calls or [] -%}\n<call>{\"name\": "
    "{{ c.function.name | tojson }}, \"arguments\": {% if c.function.arguments is string %}"
    "{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}{% endif %}}"
    "</call>{%- endfor -%}<|im_end|>{% endgeneration %}\n"
    "{%- elif m.role == 'tool' -%}<|im_start|>tool\n{{ text(m.content) }}<|im_end|>\n"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ text(m.content) }}<|im_end|>\n{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}\n")


def main():
  model = os.path.join(HERE, "model")
  os.makedirs(model, exist_ok=True)
  shutil.copy(os.path.join(HERE, "..", "chatml", "tokenizer.json"), model)
  with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}, f,
              indent=1)
  with open(os.path.join(model, "chat_template.jinja"), "w") as f:
    f.write(TEMPLATE)
  tok = AutoTokenizer.from_pretrained(model)
  expected = []
  with open(os.path.join(HERE, "conversations.jsonl")) as f:
    for line, text in enumerate(f, 1):
      record = json.loads(text)
      tools = record.get("tools")
      tools = json.loads(tools) if isinstance(tools, str) else tools
      r = tok.apply_chat_template(record["messages"], tools=tools, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
      expected.append({"line": line, "input_ids": list(r["input_ids"]),
                       "assistant_masks": list(r["assistant_masks"])})
  with open(os.path.join(HERE, "expected.json"), "w") as f:
    json.dump(expected, f)


if __name__ == "__main__":
  main()
