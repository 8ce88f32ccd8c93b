"""configs/chat.py: the import experiments read prepared data from --data_dir
(finetune.LlamaLoraImport only conversations with target masks), and --chat_prompts decodes
a JSONL file of conversations rendered with the data dir's template, stopping at its
end-of-turn token (spmdtask/overrides.set_chat_prompts)."""
import os

import pytest

from spmdtask import main
from spmdtask.errors import ConfigError
from spmdtask.inputs.prompts import ChatPromptInput, SyntheticPromptInput
from spmdtask.inputs.text import PackedLmInput
from tests import util
from tests.subproc import REPO
from spmdtask.hf import files, model_overrides
from tools import prepare_chat_data

EXAMPLE = os.path.join(REPO, "examples", "tiny_chat")
PROMPTS = os.path.join(EXAMPLE, "prompts.jsonl")
LORA = "finetune.LlamaLoraImport"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("chat") / "data")
  prepare_chat_data.prepare(os.path.join(EXAMPLE, "conversations.jsonl"),
                            os.path.join(EXAMPLE, "model"), out, max_len=128)
  return out


@pytest.fixture(scope="module")
def model_lines():
  """The tiny model's model_overrides.txt lines (its eos: 6, as its end of turn)."""
  return model_overrides.overrides(files.read_hf(os.path.join(EXAMPLE, "model"))[0])


def _build(exp, lines, data_dir=None, chat_prompts=None):
  return main.build(main.resolved_config(exp, lines, data_dir, chat_prompts))


def test_data_dir_trains_on_masked_rows_and_chat_prompts_stop_at_end_of_turn(chat_dir,
                                                                            model_lines):
  cfg = main.resolved_config(LORA, model_lines + ["task.decode.eos_id=1"], chat_dir, PROMPTS)
  assert cfg.task.decode.eos_id == 6  # the template's <|eot_id|>, over the flagfile's eos
  assert list(cfg.decode_datasets) == ["own_prompts"]  # printed in full, as --prompt's
  run = main.build(cfg)
  train, prompts = run.datasets["train"], run.decode_datasets["own_prompts"]
  assert isinstance(train, PackedLmInput) and train.target_mask
  assert isinstance(prompts, ChatPromptInput) and prompts.num_examples == 4
  first = prompts.tokenizer.decode(prompts.token_ids[0])
  assert first == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 1 + "
                   "2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
  # Without the flags: synthetic rows and prompts, as before.
  plain = _build(LORA, model_lines)
  assert isinstance(plain.decode_datasets["prompts"], SyntheticPromptInput)
  assert not isinstance(plain.datasets["train"], PackedLmInput)


def test_bad_chat_inputs_name_the_flag_and_the_fix(chat_dir, model_lines, tmp_path_factory):
  with pytest.raises(ConfigError, match=r"--chat_prompts.*empty: add --data_dir=DIR"):
    main.resolved_config(LORA, model_lines, None, PROMPTS)
  with pytest.raises(ConfigError, match=r"no decode dataset of --exp=lm.TinyLm reads conv"):
    main.resolved_config("lm.TinyLm", [], None, PROMPTS)
  text = util.packed_text_corpus(tmp_path_factory)  # prepare_text_data.py: no chat, no masks
  with pytest.raises(ConfigError, match=r"holds no chat template.*prepare_chat_data"):
    main.resolved_config(LORA, model_lines, text, PROMPTS)
  vocab = model_lines + ["task.model.vocab_size=257"]
  with pytest.raises(ConfigError, match=r"(?s)without target masks.*require_target_mask=False"):
    _build(LORA, vocab, text)
  assert isinstance(_build("llama.LlamaImport", vocab, text).datasets["train"], PackedLmInput)


def test_a_data_dir_of_the_wrong_kind_names_its_kind_and_the_experiment_that_takes_it(
    chat_dir, model_lines, tmp_path_factory):
  from tools import prepare_pref_data  # pylint: disable=g-import-not-at-top
  prefs = str(tmp_path_factory.mktemp("prefs") / "data")
  prepare_pref_data.prepare(os.path.join(REPO, "tests/tools/data/dpo/prefs.jsonl"),
                            os.path.join(EXAMPLE, "model"), prefs, max_len=128)
  said = (rf"^datasets\['train'\]\.data_dir='{prefs}' \(--data_dir\) holds preference pairs "
          r"\(its meta.json says so; tools/prepare_pref_data.py wrote it\), which "
          r"--exp=stages.Dpo trains on; this input reads conversations or plain text documents "
          r"\(packed as documents, a pair's rejected answer would be learned like its chosen "
          r"one\)\. Give it a dir written by tools/prepare_chat_data.py, or train on this one "
          r"with --exp=stages.Dpo\.$")
  for exp, lines in ((LORA, model_lines), ("llama.LlamaImport", model_lines),
                     ("lm.TinyLmSft", [])):
    with pytest.raises(ConfigError, match=said):
      _build(exp, lines, prefs)
  with pytest.raises(ConfigError, match=(
      rf"^datasets\['train'\]\.data_dir='{chat_dir}' \(--data_dir\) holds conversations .*which "
      r"--exp=stages.Sft trains on; this input reads preference pairs \(each pair a chosen and "
      r"a rejected answer\)\. Give it a dir written by tools/prepare_pref_data.py, or train on "
      r"this one with --exp=stages.Sft\.$")):
    _build("TinyLmDpo", ["task.model.vocab_size=300"], chat_dir)
