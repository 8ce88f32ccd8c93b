"""generation_config.json of an export: eos is the chat template's end-of-turn token first,
then the tokenizer's eos and those the import named; its other fields are kept."""
import os
import shutil

from spmdtask.hf import generation
from tests.subproc import REPO

MODEL = os.path.join(REPO, "examples", "tiny_chat", "model")


def test_the_end_of_turn_token_comes_first(tmp_path):
  cfg = {"eos_token_id": 6, "bos_token_id": 3, "pad_token_id": None}
  assert generation.stop_ids(MODEL) == [6, 6]  # <|eot_id|>, and the tokenizer's eos
  assert generation.generation_config(cfg, MODEL, None) == {"eos_token_id": 6,
                                                             "bos_token_id": 3}
  previous = {"eos_token_id": [1, 6], "temperature": 0.6, "do_sample": True}
  assert generation.generation_config({**cfg, "eos_token_id": 2}, MODEL, previous) == {
      "eos_token_id": [6, 1, 2], "temperature": 0.6, "do_sample": True, "bos_token_id": 3}
  plain = tmp_path / "no_template"  # a base model: the tokenizer's eos only
  shutil.copytree(MODEL, plain)
  os.remove(plain / "chat_template.jinja")
  assert generation.stop_ids(str(plain)) == [6]
  assert generation.stop_ids(str(tmp_path)) == []  # no tokenizer.json
