"""Chat prompts for decode: conversations rendered with a prepared chat dir's template and
its generation prompt; decoding them writes text and stops a row at the end-of-turn id."""
import dataclasses
import json
import shutil

import fiddle as fdl
import jax
import numpy as np
import pytest

from configs import lm
from spmdtask import experiment
from spmdtask.core import program as program_lib
from spmdtask.core.host_input import PromptInput
from spmdtask.errors import ConfigError
from spmdtask.inputs.prompts import ChatPromptInput
from spmdtask.run import decoding
from tools import prepare_chat_data

CHAT = "tests/inputs/data/chat"
PROMPTS = [[{"role": "user", "content": "Name a colour."}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
           [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Louder."}]]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat")
  prepare_chat_data.prepare(f"{CHAT}/conversations.jsonl", f"{CHAT}/llama3", str(root / "data"),
                            max_len=128)
  (root / "prompts.jsonl").write_text("".join(json.dumps({"messages": p}) + "\n"
                                              for p in PROMPTS))
  return str(root / "data"), str(root / "prompts.jsonl")


def test_chat_prompts_are_rendered_with_the_generation_prompt(chat_dir):
  data, prompts = chat_dir
  inp = ChatPromptInput(data_dir=data, prompts_file=prompts, batch_size=2, process_index=0,
                        process_count=1)
  assert isinstance(inp, PromptInput) and inp.num_examples == 3 and inp.end_of_turn_id == 6
  b = inp.batch_at(0)
  assert b["ids"].tolist() == [0, 1] and b["prompts"].shape == (2, inp.prompt_len)
  row = b["prompts"][1][:b["prompt_lens"][1]].tolist()
  tok = inp.tokenizer._tok  # pylint: disable=protected-access
  assert tok.decode(row, skip_special_tokens=False) == (
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n")
  assert inp.batch_at(1)["ids"].tolist() == [2]


def test_bad_chat_prompts_are_config_errors(chat_dir, tmp_path):
  data, _ = chat_dir
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"messages": PROMPTS[2][:2]}) + "\n")
  with pytest.raises(ConfigError, match=r"bad.jsonl:1: ends with an assistant message"):
    ChatPromptInput(data_dir=data, prompts_file=str(bad))
  with pytest.raises(ConfigError, match=r"prompts_file='/no/such.jsonl' names no file"):
    ChatPromptInput(data_dir=data, prompts_file="/no/such.jsonl")
  copy = tmp_path / "copy"
  shutil.copytree(data, copy)
  (copy / "chat_template.jinja").unlink()
  with pytest.raises(ConfigError, match=r"data_dir='.*copy' has no chat_template.jinja"):
    ChatPromptInput(data_dir=str(copy), prompts_file=str(bad))
  meta = json.load(open(f"{data}/meta.json"))
  plain = tmp_path / "plain"
  plain.mkdir()
  (plain / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "chat"}))
  with pytest.raises(ConfigError, match=r"data_dir='.*plain' was not prepared from "
                     "conversations.*prepare_chat_data.py"):
    ChatPromptInput(data_dir=str(plain), prompts_file=str(bad))


def test_decode_writes_chat_text_and_stops_at_the_end_of_turn(chat_dir, tmp_path):
  data, prompts = chat_dir
  rc = experiment.run_config(lm.TinyLm())
  rc.task.model.vocab_size = 300
  rc.task.ici_mesh_shape = (1,) * len(rc.task.mesh_axis_names)
  rc.task.decode.max_decode_len = 72
  run = fdl.build(rc)
  chat = ChatPromptInput(data_dir=data, prompts_file=prompts, batch_size=4, model=run.task.model)
  run = dataclasses.replace(run, decode_datasets={"chat": chat})
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0),
                              devices=jax.devices()[:1])
  state = program.init()
  out = decoding.run_decode(run, program, lambda step: (state, 0), str(tmp_path / "a"))
  free = [json.loads(l) for l in open(out["chat"])]
  assert [l["id"] for l in free] == [0, 1, 2]
  assert all(l["prompt_ids"] == chat.token_ids[l["id"]] for l in free)
  assert all(isinstance(l["output_text"], str) and "assistant" in l["prompt_text"] for l in free)
  # Make the untrained model say <|eot_id|> where it said the third token of row 0 (swap
  # their output columns): with eos_id the template's end-of-turn id, decoding stops there.
  first = free[0]["output_ids"]
  said = first[2]
  assert chat.end_of_turn_id not in first[:3] and said != chat.end_of_turn_id
  unembed = np.array(state.params["unembed"])
  unembed[:, [said, chat.end_of_turn_id]] = unembed[:, [chat.end_of_turn_id, said]]
  swapped = state._replace(params={**state.params, "unembed": jax.device_put(
      unembed, state.params["unembed"].sharding)})
  run = dataclasses.replace(
      run, task=dataclasses.replace(run.task, decode=dataclasses.replace(
          run.task.decode, eos_id=chat.end_of_turn_id)),
      decode_datasets={"chat": dataclasses.replace(chat)})  # a fresh pass over the prompts
  out = decoding.run_decode(run, program, lambda step: (swapped, 0), str(tmp_path / "b"))
  stopped = [json.loads(l) for l in open(out["chat"])][0]
  assert stopped["output_ids"] == first[:first.index(said)] + [chat.end_of_turn_id]
