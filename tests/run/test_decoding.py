"""KV-cache decoding: cache == full forward, layout independence, one compile, sampling, errors."""
import dataclasses
import json

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm
from spmdtask.run import checkpoints, decoding
from spmdtask import experiment
from spmdtask.core import program as program_lib
from spmdtask.core.host_input import PromptInput
from spmdtask.errors import ConfigError
from spmdtask.inputs.prompts import SyntheticPromptInput, TokenizedPrompts
from spmdtask.task import DecodeParams
from tests import oracles, util

MAX_LEN = 20
PROMPTS = SyntheticPromptInput(batch_size=8, prompt_len=8, min_prompt_len=2, vocab_size=256,
                               num_examples=8, seed=3).batch_at(0)


def program_and_params(exp: str, num_devices: int):
  """A program for `exp` on the first `num_devices` devices and fresh (seeded) params."""
  program, state = util.program_and_state(exp, num_devices)
  return program, state.params


_DECODERS = {}


def decoder(exp: str, num_devices: int, dp: DecodeParams):
  key = (exp, num_devices, repr(dp))
  if key not in _DECODERS:
    program, _ = program_and_params(exp, num_devices)
    _DECODERS[key] = decoding.build(program, dp, 8, PROMPTS["prompts"].shape[1])
  return _DECODERS[key]


def decode(exp: str, num_devices: int, dp: DecodeParams, prompts=PROMPTS) -> list[dict]:
  _, params = program_and_params(exp, num_devices)
  return decoding.decode_batch(decoder(exp, num_devices, dp), params, prompts, 8)


GREEDY = DecodeParams(max_decode_len=MAX_LEN)
SAMPLED = DecodeParams(max_decode_len=MAX_LEN, temperature=0.9, top_k=40, top_p=0.95, seed=7)


# TinyQwen3 on 1 device is TinyLm's model with QK-norm and a tied head: it stands for TinyLm
# on 1 device too (suite time), which TinyLm on 8 devices and TinyLmFsdpTp cover besides.
@pytest.mark.parametrize("exp,num_devices", [("TinyQwen3", 1), ("TinyLm", 8), ("TinyLmFsdpTp", 8),
                                             ("TinyLmUneven", 8), ("TinyMoe", 8),
                                             ("TinyGemma3", 1)])
def test_cache_matches_repeated_full_forward(exp, num_devices):
  """TinyQwen3: QK-norm and the tied head; TinyGemma3: local layers (window 8 of 20
  positions) and global ones, sandwich norms, GeGLU, the scaled embedding."""
  program, params = program_and_params(exp, num_devices)
  out = decode(exp, num_devices, GREEDY)
  ref = oracles.greedy_without_cache(program, params, PROMPTS["prompts"],
                                      PROMPTS["prompt_lens"], MAX_LEN)
  assert len(out) == 8
  for row in out:
    n = len(row["prompt_ids"])
    assert n == PROMPTS["prompt_lens"][row["id"]]
    assert len(row["output_ids"]) == MAX_LEN - n
    assert row["output_ids"] == ref[row["id"], n:].tolist()


def test_greedy_and_sampling_same_tokens_on_1_and_8_devices():
  for dp in (GREEDY, SAMPLED):
    one = decode("TinyLm", 1, dp)
    eight = decode("TinyLmFsdpTp", 8, dp)  # data 2 x fsdp 2 x model 2
    assert one == eight
  # Sampling really samples: it differs from greedy, and another seed gives other tokens.
  greedy, sampled = decode("TinyLm", 1, GREEDY), decode("TinyLm", 1, SAMPLED)
  other = decode("TinyLm", 1, dataclasses.replace(SAMPLED, seed=8))
  assert greedy != sampled and sampled != other


def test_per_token_step_compiles_once():
  dec = decoder("TinyLmFsdpTp", 8, GREEDY)
  decode("TinyLmFsdpTp", 8, GREEDY)
  decode("TinyLmFsdpTp", 8, GREEDY, SyntheticPromptInput(num_examples=8, seed=9).batch_at(0))
  # >= 11 steps per batch (prompts <= 8 tokens, 20 slots), two batches: one executable.
  assert dec.step.jitted._cache_size() == 1  # pylint: disable=protected-access
  assert dec.prefill.jitted._cache_size() == 1  # pylint: disable=protected-access


def test_stop_ids_stop_a_row_at_the_first_of_them_and_partial_batch_is_dropped():
  greedy = decode("TinyLm", 1, GREEDY)
  row = greedy[0]
  # two stop ids (as eos and a chat template's end-of-turn): row 0's 4th token, and another
  # token of its output, so rows stop at whichever of the two comes first
  stops = (row["output_ids"][3], next(t for t in row["output_ids"] if t != row["output_ids"][3]))
  dp = dataclasses.replace(GREEDY, eos_id=stops)
  partial = {k: v[:5] for k, v in PROMPTS.items()}  # 5 real rows, padded to 8
  out = decoding.decode_batch(decoding.build(program_and_params("TinyLm", 1)[0], dp, 8, 8),
                              program_and_params("TinyLm", 1)[1], partial, 8)
  assert [r["id"] for r in out] == [0, 1, 2, 3, 4]
  first = min(row["output_ids"].index(s) for s in stops)
  assert first < 3 and out[0]["output_ids"] == row["output_ids"][:first + 1]
  for got, full in zip(out, greedy):
    ids = full["output_ids"]
    cut = min([ids.index(s) for s in stops if s in ids], default=len(ids) - 1)
    assert got["output_ids"] == ids[:cut + 1]


def test_sample_top_k_and_top_p():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
  keys = jax.random.split(jax.random.key(0), 4000)
  def counts(**kw):
    tokens = decoding.sample(logits, keys, DecodeParams(temperature=1.0, **kw))
    return np.bincount(np.asarray(tokens), minlength=4) / 4000
  assert np.allclose(counts(), [0.5, 0.3, 0.15, 0.05], atol=0.03)
  assert counts(top_k=1).tolist() == [1.0, 0.0, 0.0, 0.0]
  top2 = counts(top_k=2)
  assert top2[2:].sum() == 0 and abs(top2[0] - 0.625) < 0.03
  top_p = counts(top_p=0.7)   # 0.5 < 0.7 needs the second token: {0, 1}
  assert top_p[2:].sum() == 0 and abs(top_p[0] - 0.625) < 0.03
  assert counts(top_p=0.4).tolist() == [1.0, 0.0, 0.0, 0.0]
  greedy = decoding.sample(logits[:2], keys[:2], DecodeParams())
  assert greedy.tolist() == [0, 0]


def test_bad_decode_params_are_config_errors():
  program, _ = program_and_params("TinyLm", 1)
  with pytest.raises(ConfigError, match=r"task.decode.max_decode_len=300 .*max_seq_len=256"):
    decoding.build(program, DecodeParams(max_decode_len=300), 8, 8)
  with pytest.raises(ConfigError, match="leaves no room"):
    decoding.build(program, DecodeParams(max_decode_len=8), 8, 8)
  with pytest.raises(ConfigError, match="top_p"):
    decoding.build(program, DecodeParams(top_p=0.0), 8, 8)
  with pytest.raises(ConfigError, match=r"task.decode.eos_id=\(6, 'x'\) must be None, a token id "
                     "or a tuple"):
    DecodeParams(eos_id=(6, "x")).validate()
  program8, _ = program_and_params("TinyLm", 8)
  with pytest.raises(ConfigError, match="batch_size=6"):
    decoding.build(program8, GREEDY, 6, 8)


def _run(**decode):
  rc = experiment.run_config(lm.TinyLm())
  for k, v in decode.items():
    setattr(rc.task.decode, k, v)
  return fdl.build(rc)


def test_decode_mode_writes_jsonl_and_reports_bad_input(tmp_path):
  program, params = program_and_params("TinyLm", 8)
  state = program.init()
  files = decoding.run_decode(_run(), program, lambda step: (state, 0), str(tmp_path))
  lines = [json.loads(l) for l in open(files["prompts"])]
  assert files["prompts"] == str(tmp_path / "decoder_out" / "prompts_step0.jsonl")
  assert [l["id"] for l in lines] == list(range(16))
  assert all(len(l["prompt_ids"]) + len(l["output_ids"]) == 32 for l in lines)  # max_decode_len
  assert all(set(l) == {"id", "prompt_ids", "output_ids"} for l in lines)  # no tokenizer: ids
  del params

  def never(step):
    raise AssertionError("validation must come before the checkpoint is read")
  with pytest.raises(ConfigError, match="decode_datasets"):
    decoding.run_decode(dataclasses.replace(_run(), decode_datasets={}), program, never, "x")
  not_prompts = dataclasses.replace(_run(), decode_datasets={"eval": _run().datasets["eval"]})
  with pytest.raises(ConfigError, match=r"decode_datasets\['eval'\] is a SyntheticLmInput, "
                     "which is not a decode dataset: .*tokenizer") as e:
    decoding.run_decode(not_prompts, program, never, "x")
  assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="max_decode_len=512 .*max_seq_len=256"):
    decoding.run_decode(_run(max_decode_len=512), program, never, "x")
  with pytest.raises(ConfigError, match="no complete checkpoint"):
    decoding.run_decode(_run(), program,
                        lambda step: checkpoints.restore_state(str(tmp_path), program, step),
                        str(tmp_path))


def test_pipelined_lm_decodes_unpipelined():
  """TinyLmPipeline's state (stage 2 x data 2 x model 2) decodes, unpipelined on the same
  mesh through the canonical layout, like TinyLm on 1 device."""
  pipelined, state = util.program_and_state("TinyLmPipeline", 8)
  canonical = pipelined.to_canonical(state)
  run = util.build_run("TinyLmPipeline")
  program = program_lib.setup(decoding.decode_task(run.task), run.datasets["train"].batch_at(0))
  assert program.task.pipeline is None and dict(program.mesh.shape)["stage"] == 2
  out = decoding.decode_batch(decoding.build(program, GREEDY, 8, PROMPTS["prompts"].shape[1]),
                              program.from_canonical(canonical).params, PROMPTS, 8)
  ref_program, _ = program_and_params("TinyLm", 1)
  ref_params = ref_program.from_canonical(jax.device_get(canonical)).params
  ref = decoding.decode_batch(decoder("TinyLm", 1, GREEDY), ref_params, PROMPTS, 8)
  assert out == ref and len(out) == 8


def test_own_prompts_decode_through_the_experiment_tokenizer(tmp_path, capsys, monkeypatch):
  """--prompt texts go through the decode dataset's tokenizer, one row each, and come back
  as text on the console and in decoder_out/ (TinyLm's vocabulary of 256 is the byte
  tokenizer's; a Hugging Face tokenizer.json encodes them as it says)."""
  from spmdtask import console  # pylint: disable=g-import-not-at-top
  from spmdtask.inputs import tokenizers  # pylint: disable=g-import-not-at-top
  program, state = util.program_and_state("TinyLm", 1)
  run = util.build_run("TinyLm", ["decode_datasets['prompts'].tokenizer='bytes'"])
  texts = ["the cat", "a mat\tsat on"]
  assert all(isinstance(i, PromptInput) for i in run.decode_datasets.values())
  own = decoding.with_own_prompts(run, texts, TokenizedPrompts)
  monkeypatch.setattr(console, "_echo", True)
  files = decoding.run_decode(own, program, lambda step: (state, 5), str(tmp_path))
  assert files == {"own_prompts": str(tmp_path / "decoder_out" / "own_prompts_step5.jsonl")}
  rows = [json.loads(l) for l in open(files["own_prompts"])]
  assert [r["id"] for r in rows] == [0, 1]
  assert [r["prompt_text"] for r in rows] == texts
  assert [r["prompt_ids"] for r in rows] == [list(t.encode()) for t in texts]
  for r in rows:  # greedy, no eos: every row fills max_decode_len
    assert len(r["prompt_ids"]) + len(r["output_ids"]) == 32
    assert r["output_text"] == tokenizers.ByteTokenizer().decode(r["output_ids"])
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("decode dataset 'own_prompts', step 5: 2 rows, "
                           f"{sum(len(r['output_ids']) for r in rows)} tokens generated")
  assert out[1:] == [f"  prompt {i}: {t!r} -> {r['output_text']!r}"
                     for i, (t, r) in enumerate(zip(texts, rows))]

  tok_path = util.tiny_hf_tokenizer(str(tmp_path / "tok"), ["the cat sat on the mat"] * 4)
  hf = util.build_run("TinyLm", [f"decode_datasets['prompts'].tokenizer='hf:{tok_path}'"])
  tok = tokenizers.from_spec("hf:" + tok_path)
  own_hf = decoding.with_own_prompts(hf, texts, TokenizedPrompts)
  assert own_hf.decode_datasets["own_prompts"].token_ids == [tok.encode(t) for t in texts]
  with pytest.raises(ConfigError, match=r"Prompt 1 .*is \d\d tokens.*max_decode_len=32"):
    decoding.with_own_prompts(hf, ["the cat", "the cat sat on the mat " * 10],
                              TokenizedPrompts)
  with pytest.raises(ConfigError, match="SyntheticPromptInput.*synthetic data has no tokenizer"):
    decoding.with_own_prompts(util.build_run("TinyLm"), texts, TokenizedPrompts)
  path = tmp_path / "prompts.txt"
  path.write_text("first prompt\n\n second one \n")
  assert decoding.read_prompts(["given"], str(path)) == ["given", "first prompt", " second one "]
  path.write_text("\n \n")
  with pytest.raises(ConfigError, match="holds no prompt"):
    decoding.read_prompts(None, str(path))
  with pytest.raises(ConfigError, match="does not exist"):
    decoding.read_prompts(None, str(tmp_path / "none.txt"))
  path.write_bytes(b"ok\nna\xefve\n")  # Latin-1
  with pytest.raises(ConfigError, match=rf"^{path}:2: byte 3 of the line \(0xef\) is not UTF-8"):
    decoding.read_prompts(None, str(path))
