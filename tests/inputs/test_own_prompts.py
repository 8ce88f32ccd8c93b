"""--prompt / --chat of a job with a chat template: its chat data's, else its import
tokenizer's; each text one user message, the reply stopped at the end-of-turn token."""
import os

import pytest

from spmdtask import main
from spmdtask.hf import files, model_overrides
from spmdtask.inputs import own_prompts
from spmdtask.inputs.prompts import TokenizedPrompts
from spmdtask.run import decoding
from tests.subproc import REPO
from tools import prepare_chat_data

MODEL = os.path.join(REPO, "examples", "tiny_chat", "model")
LORA = "finetune.LlamaLoraImport"
RENDERED = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 1 + 2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.fixture(scope="module")
def model_lines():
  """The tiny model's model_overrides.txt lines: eos 1 (not its end of turn, 6), and its
  tokenizer.json, whose dir holds chat_template.jinja (as an import's does)."""
  cfg = files.read_hf(MODEL)[0]
  return model_overrides.overrides(cfg, os.path.join(MODEL, "tokenizer.json")) + [
      "task.decode.eos_id=1"]


def _run(lines, data_dir=None):
  return main.build(main.resolved_config(LORA, lines, data_dir))


def _own(run, texts, chat):
  out = decoding.with_own_prompts(run, texts, TokenizedPrompts, chat)
  return out, out.decode_datasets[decoding.OWN_PROMPTS]


def test_an_imports_template_renders_each_prompt_and_its_end_of_turn_stops_it(model_lines):
  run = _run(model_lines)
  chat = own_prompts.job_chat(run.datasets, run.decode_datasets)
  assert chat.template.origin == os.path.join(MODEL, "chat_template.jinja")
  out, prompts = _own(run, ["What is 1 + 2?"], chat)
  assert prompts.tokenizer.decode(prompts.token_ids[0]) == RENDERED
  assert prompts.token_ids[0] == chat.prompt_ids([{"role": "user", "content": "What is 1 + 2?"}])
  assert (run.task.decode.eos_id, out.task.decode.eos_id) == (1, 6)  # <|eot_id|>
  # --raw_prompt: the text as written, through the experiment's tokenizer.
  raw_out, raw = _own(run, ["What is 1 + 2?"], None)
  assert raw.tokenizer.decode(raw.token_ids[0]) == "What is 1 + 2?"
  assert raw.token_ids[0] == decoding.experiment_tokenizer(run).encode("What is 1 + 2?")
  assert len(raw.token_ids[0]) < len(prompts.token_ids[0])
  assert raw_out.task.decode.eos_id == 1


def test_chat_data_gives_the_template_and_a_job_without_one_has_none(model_lines,
                                                                     tmp_path_factory):
  data = str(tmp_path_factory.mktemp("own") / "data")
  prepare_chat_data.prepare(os.path.join(REPO, "examples", "tiny_chat", "conversations.jsonl"),
                            MODEL, data, max_len=128)
  no_tokenizer = [l for l in model_lines if ".tokenizer=" not in l]
  run = _run(no_tokenizer, data)
  chat = own_prompts.job_chat(run.datasets, run.decode_datasets)
  assert chat.template.origin == os.path.join(data, "chat_template.jinja")
  _, prompts = _own(run, ["What is 1 + 2?"], chat)
  assert prompts.tokenizer.decode(prompts.token_ids[0]) == RENDERED
  plain = _run(no_tokenizer)  # synthetic data, no tokenizer: nothing to render with
  assert own_prompts.job_chat(plain.datasets, plain.decode_datasets) is None
