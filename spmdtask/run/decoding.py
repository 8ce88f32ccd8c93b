"""Autoregressive decoding with a KV cache: sampling, the jitted prefill and per-token steps.

The loop, per batch of prompts (left-aligned, `prompt_lens` real tokens each):

    state = prefill(params, prompts, prompt_lens, ids)  # fills cache slots 0..P-1,
                                                         # samples token at prompt_len
    repeat until every row is done or the cache is full:
      state, all_done = step(params, state)   # feeds tokens[pos] at position pos, writes
                                               # its k/v at slot pos, samples token pos+1

Every shape is fixed (the cache holds `max_decode_len` slots; positions are traced
arrays), so `step` compiles once. The cache is sharded like the attention
activations: batch over the data axes, KV heads over the model axis. Where the weights are
split over data axes (FSDP: `core.layouts.weight_data_axes`) the steps keep their rows
whole over those: each device multiplies its weight shard by every row, and the cache is
split over the KV heads by them where they divide. Params arrive padded and are sliced to
their logical shapes inside each step, as in train.
A row's random draw depends only on (seed, example id, position): decoding gives
the same tokens on any mesh.

The model is any `spmdtask.core.model.Decodable`. Pipelined experiments decode unpipelined
(`decode_task`): checkpoints are canonical, so the same weights load into the scanned
stack. One token per row per step leaves a pipeline nothing to overlap (its bubble
would be (S-1)/S of the step), and the cache then needs no stage dim.
"""
import dataclasses
import json
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdtask import console, fs
from spmdtask.core import layouts, sharding, steps as steps_lib
from spmdtask.errors import ConfigError
from spmdtask.core import global_batch
from spmdtask.core.host_input import PromptInput
from spmdtask.core.model import Decodable
from spmdtask.task import DecodeParams, Task


class DecodeState(NamedTuple):
  """What the per-token step carries. Every leaf has the batch as its first dim but the cache."""
  tokens: jax.Array   # [b, max_len] int32: the prompt, then generated tokens, 0 beyond
  pos: jax.Array      # [b] int32: index of the last token written (the next one to feed)
  done: jax.Array     # [b] bool: emitted eos, or no slot left
  ids: jax.Array      # [b] int32: example ids (the sampling stream); -1 for padding rows
  prompt_lens: jax.Array  # [b] int32
  cache: Any          # the model's cache, e.g. KvCache [layers, b, max_len, kv_heads, hd]


def decode_task(task: Task) -> Task:
  """The task decoding runs: the same model and mesh, its layer stack unpipelined."""
  return dataclasses.replace(task, pipeline=None)


def validate(model, dp: DecodeParams, prompt_len: int) -> None:
  """Raises ConfigError when the decode params do not fit the model or the prompts."""
  if not isinstance(model, Decodable):
    raise ConfigError(f"task.model ({type(model).__name__}) does not decode: --mode=decode "
                      "needs a spmdtask.core.model.Decodable model (a KV-cache forward), such as "
                      "TransformerLm.")
  max_seq_len = model.max_seq_len
  if dp.max_decode_len > max_seq_len:
    raise ConfigError(
        f"task.decode.max_decode_len={dp.max_decode_len} is beyond the model's maximum length "
        f"task.model.max_seq_len={max_seq_len}. Lower max_decode_len (prompt included) to at "
        f"most {max_seq_len}.")
  if prompt_len >= dp.max_decode_len:
    raise ConfigError(
        f"task.decode.max_decode_len={dp.max_decode_len} leaves no room after prompts of "
        f"{prompt_len} tokens (the decode dataset's prompt_len). Raise max_decode_len above "
        f"{prompt_len} or shorten the prompts.")
  if dp.temperature < 0 or dp.top_k < 0 or not 0.0 < dp.top_p <= 1.0:
    raise ConfigError(
        f"task.decode: temperature={dp.temperature}, top_k={dp.top_k}, top_p={dp.top_p} is not "
        "valid. Use temperature >= 0 (0 = greedy), top_k >= 0 (0 = off), 0 < top_p <= 1.")


def sample(logits: jax.Array, keys: jax.Array, dp: DecodeParams) -> jax.Array:
  """Next tokens [b] from logits [b, vocab]: greedy, or temperature / top-k / top-p sampling."""
  if dp.temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / dp.temperature
  neg = jnp.finfo(jnp.float32).min
  if dp.top_k:
    kth = jax.lax.top_k(logits, min(dp.top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth, neg, logits)
  if dp.top_p < 1.0:
    desc = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs   # mass of the strictly more likely tokens
    kept = jnp.where(before < dp.top_p, desc, jnp.inf)
    logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), neg, logits)
  return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def draw_keys(seed: int, ids: jax.Array, positions: jax.Array) -> jax.Array:
  """One key per row from (seed, example id, position of the token drawn)."""
  base = jax.random.key(seed)
  return jax.vmap(lambda i, p: jax.random.fold_in(jax.random.fold_in(base, i), p))(ids, positions)


def _put(tokens: jax.Array, where: jax.Array, values: jax.Array) -> jax.Array:
  """tokens[b, where[b]] = values[b] (rows whose `where` is out of range are unchanged)."""
  hit = jnp.arange(tokens.shape[1])[None, :] == where[:, None]
  return jnp.where(hit, values[:, None], tokens)


def _finish(tokens, pos, done, nxt, dp: DecodeParams):
  """Writes the token drawn for slot pos+1 on live rows and advances them."""
  live = ~done
  tokens = _put(tokens, jnp.where(live, pos + 1, -1), nxt)
  pos = pos + live.astype(pos.dtype)
  stop = pos + 1 >= tokens.shape[1]
  if dp.stop_ids:  # the first of several stop tokens (eos, the template's end-of-turn) ends it
    stop = stop | jnp.isin(nxt, jnp.asarray(dp.stop_ids, nxt.dtype))
  return tokens, pos, done | (live & stop)


def prefill_fn(model, logical_params, dp: DecodeParams, cache_specs):
  """`(padded_params, prompts [b,P], prompt_lens [b], ids [b]) -> (DecodeState, num_steps)`.

  Rows with id < 0 (padding) start done; num_steps is what the shortest real prompt needs.
  """
  def prefill(padded_params, prompts, prompt_lens, ids):
    params = sharding.unpad(padded_params, logical_params)
    b, plen = prompts.shape
    cache = jax.tree.map(lambda s, spec: jax.lax.with_sharding_constraint(
        jnp.zeros(s.shape, s.dtype), spec), model.cache_shape(b, dp.max_decode_len), cache_specs)
    positions = jnp.broadcast_to(jnp.arange(plen), (b, plen))
    logits, cache = model.apply({"params": params}, prompts, positions, cache,
                                logits_at=prompt_lens - 1)  # the last positions' only
    last = logits[:, 0]
    real = jnp.arange(plen)[None, :] < prompt_lens[:, None]
    tokens = jnp.zeros((b, dp.max_decode_len), jnp.int32)
    tokens = jax.lax.dynamic_update_slice(tokens, jnp.where(real, prompts, 0), (0, 0))
    nxt = sample(last, draw_keys(dp.seed, ids, prompt_lens), dp)
    tokens, pos, done = _finish(tokens, prompt_lens - 1, ids < 0, nxt, dp)
    # Steps the longest-running real row needs (replicated: every process loops alike).
    shortest = jnp.min(jnp.where(ids >= 0, prompt_lens, dp.max_decode_len))
    num_steps = dp.max_decode_len - 1 - shortest
    return DecodeState(tokens, pos, done, ids, prompt_lens, cache), num_steps
  return prefill


def step_fn(model, logical_params, dp: DecodeParams):
  """`(padded_params, state) -> (state, all_done)`: one token per row, cache updated."""
  def step(padded_params, state: DecodeState):
    params = sharding.unpad(padded_params, logical_params)
    token = jnp.take_along_axis(state.tokens, state.pos[:, None], axis=1)
    logits, cache = model.apply({"params": params}, token, state.pos[:, None], state.cache)
    nxt = sample(logits[:, 0], draw_keys(dp.seed, state.ids, state.pos + 1), dp)
    tokens, pos, done = _finish(state.tokens, state.pos, state.done, nxt, dp)
    return DecodeState(tokens, pos, done, state.ids, state.prompt_lens, cache), jnp.all(done)
  return step


def state_specs(model, batch_axes: tuple[str, ...], mesh_shape, batch_size: int) -> DecodeState:
  """PartitionSpecs of the decode state: batch over the data axes, the cache as the model says."""
  data = tuple(batch_axes) or None
  if batch_size % sharding.shards(data, mesh_shape):
    raise ConfigError(
        f"The decode dataset's batch_size={batch_size} does not divide over the data axes "
        f"{batch_axes} ({sharding.shards(data, mesh_shape)} shards). Make it a multiple of "
        f"{sharding.shards(data, mesh_shape)}.")
  return DecodeState(P(data, None), P(data), P(data), P(data), P(data),
                     model.cache_split_dims(mesh_shape))


@dataclasses.dataclass(frozen=True)
class Decoder:
  """The jitted decode programs of one program, for one batch size."""
  prefill: steps_lib.Partitioned
  step: steps_lib.Partitioned
  fetch: steps_lib.Partitioned
  specs: DecodeState
  params: DecodeParams
  mesh: Any


def build(program, dp: DecodeParams, batch_size: int, prompt_len: int) -> Decoder:
  """Validates `dp` and jits prefill, the per-token step (state donated) and the fetch."""
  model = program.model
  if program.task.pipeline is not None:
    raise ValueError("Decode with the program of decode_task(task): a pipelined stack does not "
                     "decode.")
  validate(model, dp, prompt_len)
  mesh, data = program.mesh, program.task.batch_axes()
  whole = layouts.weight_data_axes(program)  # FSDP: the per-token steps' rows whole over its axes
  stepper = model.whole_rows(whole, dict(mesh.shape)) if whole else model
  specs = state_specs(stepper, data, dict(mesh.shape), batch_size)
  logical, psplit = program.layout.logical.params, program.layout.split.params
  prefill_cache = state_specs(model, data, dict(mesh.shape), batch_size).cache
  prefill = steps_lib.partition(prefill_fn(model, logical, dp, prefill_cache), mesh,
                                (psplit, specs.tokens, specs.pos, specs.ids), (specs, P()))
  step = steps_lib.partition(step_fn(stepper, logical, dp), mesh, (psplit, specs),
                             (specs, P()), donate_argnums=(1,))
  fetch = steps_lib.partition(lambda s: (s.tokens, s.pos, s.ids, s.prompt_lens), mesh,
                              (specs,), (P(), P(), P(), P()))
  return Decoder(prefill, step, fetch, specs, dp, mesh)


def pad_prompts(local: dict, rows: int) -> dict:
  """Pads a partial batch to `rows` rows: 1-token prompts with id -1 (dropped on output)."""
  n = local["ids"].shape[0]
  if n == rows:
    return local
  def pad(x, value):
    return np.concatenate([x, np.full((rows - n,) + x.shape[1:], value, x.dtype)])
  return {"prompts": pad(local["prompts"], 0), "prompt_lens": pad(local["prompt_lens"], 1),
          "ids": pad(local["ids"], -1)}


def decode_batch(decoder: Decoder, padded_params, local: dict, local_rows: int,
                 check_every: int = 8) -> list[dict]:
  """Decodes one host-local batch of prompts; returns one dict per real row of the GLOBAL batch.

  Each: `id`, `prompt_ids`, `output_ids` (generated, eos included when emitted).
  """
  local = pad_prompts(local, local_rows)
  batch_specs = {"prompts": decoder.specs.tokens, "prompt_lens": decoder.specs.pos,
                 "ids": decoder.specs.ids}
  g = global_batch.to_global(local, batch_specs, decoder.mesh)
  state, steps = decoder.prefill(padded_params, g["prompts"], g["prompt_lens"], g["ids"])
  for i in range(int(jax.device_get(steps))):
    state, all_done = decoder.step(padded_params, state)
    if (i + 1) % check_every == 0 and bool(jax.device_get(all_done)):
      break
  tokens, pos, ids, lens = jax.device_get(decoder.fetch(state))
  return [{"id": int(ids[r]), "prompt_ids": tokens[r, :lens[r]].tolist(),
           "output_ids": tokens[r, lens[r]:pos[r] + 1].tolist()}
          for r in range(len(ids)) if ids[r] >= 0]


def fresh_path(out_dir: str, name: str, step: int) -> str:
  """`out_dir/<name>_step<step>.jsonl`, or the first free `..._2.jsonl`, `..._3.jsonl`, ..."""
  base = fs.join(out_dir, f"{name}_step{step}")
  path, k = base + ".jsonl", 1
  while fs.exists(path):
    k += 1
    path = f"{base}_{k}.jsonl"
  return path


def _short(value, limit: int = 80) -> str:
  text = value if isinstance(value, str) else " ".join(map(str, value))
  text = text.replace("\n", "\\n")
  return repr(text[:limit] + ("..." if len(text) > limit else ""))


def write_outputs(out_dir: str, name: str, step: int, results: list[dict], tokenizer,
                  seconds: float) -> str:
  """Writes one decode dataset's rows to a fresh file; says what and where, with a sample."""
  fs.makedirs(out_dir)
  path = fresh_path(out_dir, name, step)
  rows = []
  for r in results:
    if tokenizer is not None:
      r = {**r, "prompt_text": tokenizer.decode(r["prompt_ids"]),
           "output_text": tokenizer.decode(r["output_ids"])}
    rows.append(r)
  # fresh_path: never over an earlier decode's file (process 0 is the only writer).
  fs.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
  new_tokens = sum(len(r["output_ids"]) for r in rows)
  earlier = not path.endswith(f"/{name}_step{step}.jsonl")
  console.say("decode dataset %r, step %d: %d rows, %d tokens generated (%.1f tokens/s); "
              "wrote %s%s", name, step, len(rows), new_tokens, new_tokens / max(seconds, 1e-9), path,
              " (earlier decodes of this step kept)" if earlier else "")
  # Given prompts: every continuation, in full; a dataset's: one sample.
  own = name == OWN_PROMPTS
  for r in rows if own else rows[:1]:
    limit = 100_000 if own else 80
    console.say("  %s %d: %s -> %s", "prompt" if own else "sample id", r["id"],
                _short(r.get("prompt_text", r["prompt_ids"]), limit),
                _short(r.get("output_text", r["output_ids"]), limit))
  return path


OWN_PROMPTS = "own_prompts"  # the decode dataset of --prompt / --prompts_file


def read_prompts(prompts: list[str] | None, prompts_file: str | None) -> list[str]:
  """The texts of `--prompt` (each) then `--prompts_file` (one prompt per non-empty line)."""
  texts = list(prompts or [])
  if prompts_file:
    if not fs.isfile(prompts_file):
      raise ConfigError(f"--prompts_file={prompts_file!r} does not exist. Give a text file "
                        "with one prompt per line.")
    lines = [l.rstrip("\r") for l in fs.read_text(prompts_file).split("\n") if l.strip()]
    if not lines:
      raise ConfigError(f"--prompts_file={prompts_file!r} holds no prompt. Write one prompt "
                        "per line.")
    texts += lines
  return texts


def experiment_tokenizer(run, needed_by: str = "--prompt / --prompts_file need"):
  """The tokenizer of the experiment's first decode dataset that has one (sorted by name);
  ConfigError (saying what `needed_by` it) where none has."""
  for name, inputs in sorted(run.decode_datasets.items()):
    if _prompt_input(name, inputs).tokenizer is not None:
      return inputs.tokenizer
  names = ", ".join(f"{n!r} ({type(i).__name__})" for n, i in sorted(run.decode_datasets.items()))
  raise ConfigError(
      f"{needed_by} the experiment's tokenizer to turn text into token ids, "
      f"but none of its decode datasets has one ({names or 'none'}; synthetic data has no "
      "tokenizer). Use an experiment on prepared text (e.g. --exp=lm.TextLm --data_dir=DIR), "
      "or name the tokenizer of the model's vocabulary, e.g. "
      "--fdl_set=\"decode_datasets['prompts'].tokenizer='hf:PATH/tokenizer.json'\".")


def with_own_prompts(run, texts: list[str], prompts_input, chat=None):
  """`run` decoding `texts` (one row each, through the experiment's tokenizer; with `chat`,
  the job's `spmdtask.inputs.chat.Chat`, each rendered as a user message and stopped at the
  template's end-of-turn token: task.decode.eos_id) instead of its decode datasets, batched
  like its first decode dataset; ConfigError for a prompt that leaves no room to continue
  within task.decode.max_decode_len. `prompts_input` is
  `spmdtask.inputs.prompts.TokenizedPrompts` (the binary passes it: run/ never imports an
  input)."""
  tokenizer = experiment_tokenizer(run) if chat is None else chat.tokenizer
  first = run.decode_datasets[sorted(run.decode_datasets)[0]]
  inputs = prompts_input(texts=tuple(texts), tokenizer=tokenizer,
                         batch_size=int(first.batch_size), chat=chat)
  if chat is not None:
    run = dataclasses.replace(run, task=dataclasses.replace(run.task, decode=dataclasses.replace(
        run.task.decode, eos_id=int(chat.end_of_turn_id))))
  limit, max_seq_len = run.task.decode.max_decode_len, run.task.model.max_seq_len
  for i, (text, ids) in enumerate(zip(texts, inputs.token_ids)):
    if not ids or len(ids) >= limit:
      raise ConfigError(
          f"Prompt {i} ({_short(text, 40)}) is {len(ids)} tokens with the experiment's "
          f"tokenizer; a decode holds task.decode.max_decode_len={limit} tokens, prompt "
          f"included (the model's max_seq_len is {max_seq_len}). Give a non-empty prompt "
          f"shorter than {limit} tokens, or raise --fdl_set=task.decode.max_decode_len=N "
          f"(N <= {max_seq_len}).")
  return dataclasses.replace(run, decode_datasets={OWN_PROMPTS: inputs})


def _prompt_input(name: str, inputs) -> PromptInput:
  """`inputs`, checked to be a decode dataset (`PromptInput`: reading its `tokenizer` here
  also loads it, so a tokenizer file that is missing fails before any checkpoint is read)."""
  if not isinstance(inputs, PromptInput):
    raise ConfigError(
        f"decode_datasets[{name!r}] is a {type(inputs).__name__}, which is not a decode "
        "dataset: it needs batch_size, local_batch_size, tokenizer (None for token ids only) "
        "and batch_at(i) giving {'prompts', 'prompt_lens', 'ids'} "
        "(spmdtask.core.host_input.PromptInput). Use one like "
        "spmdtask.inputs.prompts.SyntheticPromptInput.")
  return inputs


def _prompt_shape(name: str, inputs: PromptInput) -> tuple[int, int, int]:
  """(global batch size, local rows, prompt_len) of a decode dataset."""
  first = inputs.batch_at(0)
  if "prompts" not in first:
    raise ConfigError(f"decode_datasets[{name!r}] ({type(inputs).__name__}) gives batches "
                      f"{sorted(first)}, not {{'prompts', 'prompt_lens', 'ids'}}; give those "
                      "from batch_at(i), like spmdtask.inputs.prompts.SyntheticPromptInput.")
  return int(inputs.batch_size), int(inputs.local_batch_size), int(first["prompts"].shape[1])


def run_decode(run, program, restore: Callable[[int | None], tuple[Any, int]], job_log_dir: str,
               restore_step: int | None = None) -> dict[str, str]:
  """--mode=decode: decodes every decode dataset with a checkpoint's params.

  Writes `job_log_dir/decoder_out/<dataset>_step<N>.jsonl` (process 0; `..._<k>.jsonl`
  when an earlier decode wrote that name), one line per prompt: id, prompt_ids,
  output_ids, and prompt/output text when the dataset's `tokenizer` is not None (every
  decode dataset is a `host_input.PromptInput`); says what it wrote, with one sample.
  Everything is validated before the checkpoint is read. Returns the files written by
  process 0, by dataset.
  """
  if not run.decode_datasets:
    raise ConfigError("--mode=decode needs a decode dataset, but Experiment.decode_datasets() "
                      "is empty (config field decode_datasets). Add one, e.g. "
                      "{'prompts': fdl.Config(SyntheticPromptInput, ...)}.")
  decoders = {}
  for name, inputs in sorted(run.decode_datasets.items()):
    batch, rows, prompt_len = _prompt_shape(name, _prompt_input(name, inputs))
    decoders[name] = (build(program, run.task.decode, batch, prompt_len), rows)
  state, step = restore(restore_step)
  out_dir = fs.join(job_log_dir, "decoder_out")
  files = {}
  for name, (decoder, rows) in decoders.items():
    inputs = run.decode_datasets[name]
    tokenizer = inputs.tokenizer
    t0, results = time.perf_counter(), []
    for local in inputs:
      results.extend(decode_batch(decoder, state.params, local, rows))
    seconds = time.perf_counter() - t0
    if jax.process_index() == 0:
      files[name] = write_outputs(out_dir, name, step, results, tokenizer, seconds)
  return files
