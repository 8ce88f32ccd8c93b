"""Llama checkpoints in the Hugging Face layout (spmdtask/hf/llama.py): in, equal to a numpy Llama forward, decoded by
the binary (HF's greedy tokens, its tokenizer's text), and back out bit-identically; both
config layouts (top-level rope_theta/rope_scaling, transformers >= 5 rope_parameters)."""
import json
import os
import shutil
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import numpy as st_numpy

from spmdtask.errors import ConfigError
from spmdtask.hf import convert, files, llama, model_overrides
from spmdtask.hf.jobs import checkpoints, exports, imports
from tests import subproc as h
from tests import util
from tests.hf import checks
from tests.layers.test_rope import llama3_inv_freq

LLAMA = llama.FAMILY.experiment
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
          "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
          "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": 255,
          "torch_dtype": "float32"}


def _hf_tensors(cfg, dtype, seed=0):
  rng = np.random.default_rng(seed)
  d, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
  h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

  def w(*shape, scale=None):
    return (rng.normal(size=shape) * (scale or shape[-1] ** -0.5)).astype(dtype)

  t = {"model.embed_tokens.weight": w(cfg["vocab_size"], d, scale=1.0),
       "model.norm.weight": (1 + 0.1 * rng.normal(size=d)).astype(dtype)}
  if not cfg["tie_word_embeddings"]:
    t["lm_head.weight"] = w(cfg["vocab_size"], d)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update({p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
              p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
              p + "mlp.gate_proj.weight": w(ff, d), p + "mlp.up_proj.weight": w(ff, d),
              p + "mlp.down_proj.weight": w(d, ff),
              p + "input_layernorm.weight": (1 + 0.1 * rng.normal(size=d)).astype(dtype),
              p + "post_attention_layernorm.weight": (1 + 0.1 * rng.normal(size=d)).astype(dtype)})
  return t


def _write_hf(directory, cfg, tensors, shards):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(cfg, f)
  if shards == 1:
    st_numpy.save_file(tensors, os.path.join(directory, "model.safetensors"))
    return
  names, weight_map = sorted(tensors), {}
  for s in range(shards):
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[s::shards]}
    st_numpy.save_file(part, os.path.join(directory, fname))
    weight_map.update({n: fname for n in part})
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


def hf_inv_freq(cfg, hd):
  """HF's RoPE frequencies from either config layout (default or llama3 rope_type)."""
  p = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}),
                                     "rope_theta": cfg.get("rope_theta", 10000.0)}
  if p.get("rope_type", "default") == "llama3":
    return llama3_inv_freq(hd, p["rope_theta"], p["factor"], p["low_freq_factor"],
                           p["high_freq_factor"], p["original_max_position_embeddings"])
  return 1.0 / p["rope_theta"] ** (np.arange(0, hd, 2) / hd)


def llama_forward(cfg, t, tokens):
  """A numpy (float64) forward of HF's LlamaForCausalLM on one sequence: logits [t, vocab]."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  h, kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
  hd = cfg.get("head_dim") or cfg["hidden_size"] // h
  n = len(tokens)

  def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

  freqs = np.arange(n)[:, None] * hf_inv_freq(cfg, hd)
  cos, sin = np.cos(np.concatenate([freqs] * 2, -1)), np.sin(np.concatenate([freqs] * 2, -1))

  def rotary(x):  # HF's rotate_half form on [t, heads, hd]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]

  x = t["model.embed_tokens.weight"][tokens]
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    y = rms(x, t[p + "input_layernorm.weight"])
    q = rotary((y @ t[p + "self_attn.q_proj.weight"].T).reshape(n, h, hd))
    k = rotary((y @ t[p + "self_attn.k_proj.weight"].T).reshape(n, kv, hd))
    v = (y @ t[p + "self_attn.v_proj.weight"].T).reshape(n, kv, hd)
    k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # HF repeat_kv
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("hts,shd->thd", a, v).reshape(n, h * hd) @ t[p + "self_attn.o_proj.weight"].T
    y = rms(x, t[p + "post_attention_layernorm.weight"])
    g = y @ t[p + "mlp.gate_proj.weight"].T
    x = x + ((g / (1 + np.exp(-g))) * (y @ t[p + "mlp.up_proj.weight"].T)) @ t[
        p + "mlp.down_proj.weight"].T
  x = rms(x, t["model.norm.weight"])
  head = t["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else t["lm_head.weight"]
  return x @ head.T


def _convert_and_check_logits(tmp_path, cfg, tensors, shards, tokenizer_dir=None):
  hf, out, back = str(tmp_path / "hf"), str(tmp_path / "job"), str(tmp_path / "back")
  _write_hf(hf, cfg, tensors, shards)
  for name in files.present(tokenizer_dir, files.TOKENIZER_FILES) if tokenizer_dir else ():
    shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(hf, name))
  lines = imports.from_hf(hf, out)
  with open(os.path.join(out, "model_overrides.txt")) as f:
    assert f.read().splitlines() == ["--family=llama"] + [f"--fdl_set={line}" for line in lines]
  model = util.build_run(LLAMA, lines).task.model
  params = checkpoints.read_checkpoint(out, lines, LLAMA)
  tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], 40)
  ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens[None]))[0]  # one compile
  np.testing.assert_allclose(ours, llama_forward(cfg, tensors, tokens), rtol=1e-4, atol=1e-4)
  exports.to_hf(out, back)
  got_cfg, got = files.read_hf(back)
  assert got_cfg == cfg
  checks.assert_bit_identical(got, tensors)
  return out


def test_sharded_untied_llama_converts_in_and_back_bit_identically(tmp_path):
  # Decoding through the binary: the Llama 3.2-style test below (HF's greedy tokens).
  _convert_and_check_logits(tmp_path, CONFIG, _hf_tensors(CONFIG, np.float32), shards=2)


def test_tied_bfloat16_llama_round_trips_bit_identically(tmp_path):
  cfg = {**CONFIG, "tie_word_embeddings": True, "num_key_value_heads": 4,
         "torch_dtype": "bfloat16"}
  del cfg["head_dim"]  # defaults to hidden_size / heads
  tensors = _hf_tensors({**cfg, "head_dim": 16}, ml_dtypes.bfloat16, seed=2)
  _convert_and_check_logits(tmp_path, cfg, tensors, shards=1)


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_type='yarn' is not supp"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}},
     "rope_parameters rope_type='linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"lacks \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                          "partial_rotary_factor": 0.5}}, r"\['partial_rotary_factor'\]"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     r"disagree on \['rope_theta'\]"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "per-layer-type"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
])
def test_unsupported_config_fields_are_named(change, match):
  with pytest.raises(ConfigError, match=match):
    convert.to_params({**CONFIG, **change}, _hf_tensors(CONFIG, np.float32))


def test_missing_and_unknown_tensors_are_named():
  tensors = _hf_tensors(CONFIG, np.float32)
  missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(ConfigError, match=r"no tensor 'model.layers.1.mlp.up_proj.weight'"):
    convert.to_params(CONFIG, missing)
  extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
  with pytest.raises(ConfigError, match=r"q_proj.bias"):
    convert.to_params(CONFIG, extra)


# A tiny Llama 3.2: θ 500000, llama3 scaling (its original context shrunk to 64 so that the
# scaling changes these short sequences' logits), tied embeddings, GQA; vocab = tokenizer's.
LLAMA32_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TEXTS = ["the tokenizer of an imported llama decodes text", "greedy tokens equal hf's own",
         "rotary positions scaled the llama3 way, embeddings tied"] * 4


def _llama32_configs(vocab_size):
  """The same model in both layouts: transformers < 5 and >= 5."""
  old = {**CONFIG, "vocab_size": vocab_size, "tie_word_embeddings": True, "eos_token_id": 1,
         "rope_scaling": dict(LLAMA32_SCALING)}
  new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
  new["rope_parameters"] = {"rope_theta": old["rope_theta"], **LLAMA32_SCALING}
  return old, new


def hf_greedy(cfg, tensors, prompt, max_len):
  """HF's greedy continuation (numpy forward per token) and its smallest top-2 logit margin."""
  tokens, margin = list(prompt), np.inf
  while len(tokens) < max_len:
    logits = llama_forward(cfg, tensors, np.asarray(tokens))[-1]
    top = np.sort(logits)
    margin = min(margin, top[-1] - top[-2])
    tokens.append(int(np.argmax(logits)))
    if tokens[-1] == cfg["eos_token_id"]:
      break
  return tokens[len(prompt):], margin


def test_llama32_style_checkpoint_in_both_layouts_decodes_hf_greedy_tokens(tmp_path):
  tok_path = util.tiny_hf_tokenizer(str(tmp_path / "hf_v4"), TEXTS)
  from spmdtask.inputs import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.from_spec("hf:" + tok_path)
  old, new = _llama32_configs(tok.vocab_size)
  tensors = _hf_tensors(old, np.float32, seed=3)
  assert "lm_head.weight" not in tensors
  unscaled = {**old, "rope_scaling": None}
  probe = np.arange(40) % tok.vocab_size  # the scaling matters here: a silent default shows
  assert np.abs(llama_forward(old, tensors, probe) - llama_forward(unscaled, tensors, probe)
                ).max() > 1e-2
  # transformers >= 5's layout: in (logits == the numpy forward), back out bit-identically.
  out = _convert_and_check_logits(tmp_path / "v5", new, tensors, shards=1,
                                  tokenizer_dir=str(tmp_path / "hf_v4"))
  # The older layout converts to the same checkpoint and overrides: decoding one decodes both.
  _write_hf(str(tmp_path / "hf_v4"), old, tensors, 1)
  v4_lines = imports.from_hf(str(tmp_path / "hf_v4"), str(tmp_path / "v4"))
  assert v4_lines == [l.replace(out, str(tmp_path / "v4")) for l in model_overrides.overrides(
      new, os.path.join(out, "tokenizer.json"))]
  assert "task.model.rope_scaling.factor=32.0" in v4_lines
  same = jax.tree.map(lambda a, b: a.tobytes() == b.tobytes(),
                      convert.to_params(old, tensors), convert.to_params(new, tensors))
  assert all(jax.tree.leaves(same))
  r = h.run(h.main_cmd(LLAMA, out, flags=["--mode=decode",
                                                      f"--flagfile={out}/model_overrides.txt"]))
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(out, "decoder_out", "prompts_step0.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert len(rows) == 16
  matched = 0
  for row in rows:
    want, margin = hf_greedy(new, tensors, row["prompt_ids"], 64)
    assert margin > 1e-4  # no near-tie: fp32 vs float64 cannot flip a token
    assert row["output_ids"] == want
    assert row["output_text"] == tok.decode(row["output_ids"])
    assert row["prompt_text"] == tok.decode(row["prompt_ids"])
    matched += len(want)
  print(f"decode == HF greedy: 16 prompts, {matched} tokens")


def test_unsupported_rope_type_exits_2_naming_it(tmp_path):
  cfg = {**CONFIG, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}}
  del cfg["rope_theta"]
  _write_hf(str(tmp_path / "hf"), cfg, _hf_tensors(CONFIG, np.float32), shards=1)
  r = h.run([sys.executable, "tools/convert_llama.py", f"--from_hf={tmp_path}/hf",
             f"--job_log_dir={tmp_path}/job"])
  assert r.returncode == 2, r.stderr[-2000:]
  assert "rope_type='yarn' is not supported" in r.stderr and "Traceback" not in r.stderr
  assert not os.path.exists(tmp_path / "job")
