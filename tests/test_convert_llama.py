"""Llama checkpoints in the Hugging Face layout: in, equal to a numpy Llama forward, decoded by
the binary, and back out bit-identically."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors import numpy as st_numpy

from spmdtask.errors import ConfigError
from tests import subproc as h
from tests import util
from tools import convert_llama

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


def llama_forward(cfg, t, tokens):
  """A numpy (float64) forward of HF's LlamaForCausalLM on one sequence: logits [t, vocab]."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  h, kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
  hd = cfg.get("head_dim") or cfg["hidden_size"] // h
  n = len(tokens)

  def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

  inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
  freqs = np.arange(n)[:, None] * inv
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


def _assert_bit_identical(a: dict, b: dict):
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert a[k].tobytes() == b[k].tobytes(), k


def _convert_and_check_logits(tmp_path, cfg, tensors, shards):
  hf, out, back = str(tmp_path / "hf"), str(tmp_path / "job"), str(tmp_path / "back")
  _write_hf(hf, cfg, tensors, shards)
  lines = convert_llama.from_hf(hf, out)
  with open(os.path.join(out, "model_overrides.txt")) as f:
    assert f.read().splitlines() == [f"--fdl_set={line}" for line in lines]
  model = util.build_run("lm.TinyLm", lines).task.model
  params = convert_llama.read_checkpoint(out, lines)
  tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], 40)
  ours = np.asarray(model.apply({"params": params}, tokens[None]))[0]
  np.testing.assert_allclose(ours, llama_forward(cfg, tensors, tokens), rtol=1e-4, atol=1e-4)
  convert_llama.to_hf(out, back)
  got_cfg, got = convert_llama.read_hf(back)
  assert got_cfg == cfg
  _assert_bit_identical(got, tensors)
  return out


def test_sharded_untied_llama_converts_in_decodes_and_back_bit_identically(tmp_path):
  tensors = _hf_tensors(CONFIG, np.float32)
  out = _convert_and_check_logits(tmp_path, CONFIG, tensors, shards=2)
  r = h.run(h.main_cmd("lm.TinyLm", out, flags=["--mode=decode",
                                                f"--flagfile={out}/model_overrides.txt"]))
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(out, "decoder_out", "prompts_step0.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert len(rows) == 16
  checked = 0
  for row in rows:  # greedy: the first new token is the reference's argmax (clear margins)
    ref = np.sort(llama_forward(CONFIG, tensors, np.asarray(row["prompt_ids"]))[-1])
    if ref[-1] - ref[-2] > 1e-3:
      want = int(np.argmax(llama_forward(CONFIG, tensors, np.asarray(row["prompt_ids"]))[-1]))
      assert row["output_ids"][0] == want
      checked += 1
  assert checked >= 12


def test_tied_bfloat16_llama_round_trips_bit_identically(tmp_path):
  cfg = {**CONFIG, "tie_word_embeddings": True, "num_key_value_heads": 4,
         "torch_dtype": "bfloat16"}
  del cfg["head_dim"]  # defaults to hidden_size / heads
  tensors = _hf_tensors({**cfg, "head_dim": 16}, ml_dtypes.bfloat16, seed=2)
  _convert_and_check_logits(tmp_path, cfg, tensors, shards=1)


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling="),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
])
def test_unsupported_config_fields_are_named(change, match):
  with pytest.raises(ConfigError, match=match):
    convert_llama.to_params({**CONFIG, **change}, _hf_tensors(CONFIG, np.float32))


def test_missing_and_unknown_tensors_are_named():
  tensors = _hf_tensors(CONFIG, np.float32)
  missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(ConfigError, match=r"no tensor 'model.layers.1.mlp.up_proj.weight'"):
    convert_llama.to_params(CONFIG, missing)
  extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
  with pytest.raises(ConfigError, match=r"q_proj.bias"):
    convert_llama.to_params(CONFIG, extra)
