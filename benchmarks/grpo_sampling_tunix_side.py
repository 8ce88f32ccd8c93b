"""Tunix's sampler, timed: the side of benchmarks/grpo_sampling_tunix.py that runs in a venv
with google-tunix (a venv of its own: Tunix's trainer pins other versions than spmdtask's),
as a process the driver talks to, so the two libraries' calls alternate in time on this
shared machine. Nothing of spmdtask is imported here.

    /path/to/tunix_venv/bin/python benchmarks/grpo_sampling_tunix_side.py SPEC.json

SPEC.json (written by the driver): `weights` (an .npz of TinyLm's params, spmdtask's names),
the model's shapes, `prompts` (token lists, one per prompt), `group` (samples a prompt),
`max_new`, `prompt_len`, `temperature`, `seed`. Then one JSON request a line on stdin:
`{"setup": MODE, "lengths": L}` builds and compiles Tunix's sampler for a mode (L: one
length a sample, prompt-major, the stop byte included; a wrapper of Tunix's Llama3 forces
the end byte at row r's L_r-th completion token and nowhere else, since Tunix draws its own
random tokens, a stop decided by the tokens as spmdtask's benchmark does would give other
lengths; null: no stop id, every sample to `max_new`); `{"time": MODE}` times one call.
Each answer is a stdout line starting with `@@ ` (JSON): seconds, completion tokens, and
whether the lengths came out as asked.
"""
import dataclasses
import json
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.llama3 import model as llama3

PAD = 263  # the byte vocabulary's padding id: never in a prompt (Tunix masks pad positions)


class Bytes:
  """A byte tokenizer as Tunix's TokenizerAdapter takes one (encode, decode, *_id)."""

  def __init__(self, end: int):
    self.end = end

  def encode(self, text, **_):
    return list(text.encode("latin-1"))

  def decode(self, ids, **_):
    return bytes(i for i in ids if i < 256).decode("latin-1")

  def bos_id(self):
    return None  # no BOS: the prompts are the same tokens as spmdtask's

  def eos_id(self):
    return self.end

  def pad_id(self):
    return PAD


@dataclasses.dataclass(frozen=True)
class _Dtype:
  """What Tunix's sampler reads for the cache's dtype (`transformer.config.dtype`); without
  it, the state's first leaf's, here the int32 lengths."""
  dtype: object


class Lengths(nnx.Variable):
  """Per row: the completion length at which its end byte is forced."""


class StopAt(nnx.Module):
  """Tunix's Llama3 with the end byte forced at each row's given length (the benchmark's
  long tail). Row r's completion token k comes from the token fed at position
  prompt_len - 1 + k; it is forced to `end` when k == lengths[r] - 1."""

  def __init__(self, model, lengths, prompt_len: int, end: int):
    self.model, self.config = model, _Dtype(model.embedder.input_embedding.value.dtype)
    self.lengths = Lengths(jnp.asarray(lengths, jnp.int32))
    self.prompt_len, self.end = prompt_len, end

  def __call__(self, input_tokens, positions, cache, attention_mask):
    logits, cache = self.model(input_tokens, positions, cache, attention_mask)
    k = positions - (self.prompt_len - 1)
    stop = (k == (self.lengths.value[:, None] - 1))[..., None]
    is_end = jnp.arange(logits.shape[-1]) == self.end
    # at the length: only the end byte; before it: anything but the end byte
    return jnp.where(stop, jnp.where(is_end, 0.0, -1e9), jnp.where(is_end, -1e9, logits)), cache

  @property
  def num_embed(self):
    return self.model.num_embed


def load_llama(spec) -> llama3.Llama3:
  """Tunix's Llama3 at TinyLm's shapes, holding the driver's params (same weights)."""
  cfg = llama3.ModelConfig(
      num_layers=spec["num_layers"], vocab_size=spec["vocab_size"], embed_dim=spec["d_model"],
      hidden_dim=spec["d_ff"], num_heads=spec["num_heads"], head_dim=spec["head_dim"],
      num_kv_heads=spec["num_kv_heads"], rope_theta=spec["rope_theta"],
      norm_eps=spec["norm_eps"], weight_tying=False,
      shd_config=llama3.ShardingConfig.get_default_sharding(is_sampling=True))
  model = llama3.Llama3(cfg, rngs=nnx.Rngs(0))
  w = dict(np.load(spec["weights"]))
  model.embedder.input_embedding.value = jnp.asarray(w["embedding"])
  model.final_norm.w.value = jnp.asarray(w["final_norm/scale"])
  model.lm_head.w.value = jnp.asarray(w["unembed"])
  for i, layer in enumerate(model.layers):
    at = lambda name, i=i: jnp.asarray(w[f"layers/block/{name}"][i])
    layer.attn.q_proj.w.value, layer.attn.k_proj.w.value = at("attn/q"), at("attn/k")
    layer.attn.v_proj.w.value, layer.attn.o_proj.w.value = at("attn/v"), at("attn/o")
    layer.input_layernorm.w.value = at("attn_norm/scale")
    layer.post_attention_layernorm.w.value = at("mlp_norm/scale")
    layer.mlp.gate_proj.kernel.value, layer.mlp.up_proj.kernel.value = at("mlp/wg"), at("mlp/wi")
    layer.mlp.down_proj.kernel.value = at("mlp/wo")
  return model


class Mode:
  """Tunix's sampler for one mode and its call (module doc)."""

  def __init__(self, spec, model, lengths):
    group, max_new, plen, end = spec["group"], spec["max_new"], spec["prompt_len"], spec["end"]
    self.texts = [bytes(p).decode("latin-1") for p in spec["prompts"] for _ in range(group)]
    self.want, self.max_new = lengths or [max_new] * len(self.texts), max_new
    if lengths is not None:
      model = StopAt(model, lengths, plen, end)
    cache = sampler_lib.CacheConfig(cache_size=plen + max_new, num_layers=spec["num_layers"],
                                    num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"])
    self.sampler = sampler_lib.Sampler(model, Bytes(end), cache)
    # temperature sampling as spmdtask's (top_p 1: Tunix's plain categorical path), the
    # tokens' log-probs returned as spmdtask's are; no stop id at full length
    self.kw = dict(max_generation_steps=max_new, max_prompt_length=plen,
                   temperature=spec["temperature"], top_p=1.0, seed=spec["seed"],
                   return_logprobs=True, eos_tokens=[end] if lengths is not None else [-1])
    self()  # compiles

  def __call__(self) -> dict:
    t0 = time.perf_counter()
    out = self.sampler(self.texts, **self.kw)
    seconds = time.perf_counter() - t0
    # Tunix's tokens stop before the stop id: count it back in (spmdtask's samples hold it)
    got = [len(t) + (1 if len(t) < self.max_new else 0) for t in out.tokens]
    return {"seconds": seconds, "tokens": int(sum(got)), "lengths_match": got == self.want}


def main():
  spec = json.load(open(sys.argv[1], encoding="utf-8"))
  model, modes = load_llama(spec), {}
  answer = lambda obj: print("@@ " + json.dumps(obj), flush=True)
  answer({"devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
          "jax": jax.__version__})
  for line in sys.stdin:
    request = json.loads(line)
    if "setup" in request:
      modes[request["setup"]] = Mode(spec, model, request["lengths"])
      answer({"ready": request["setup"]})
    else:
      answer(modes[request["time"]]())


if __name__ == "__main__":
  main()
