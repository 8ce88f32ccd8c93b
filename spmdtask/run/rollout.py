"""GRPO's loop side: each batch of prompts is sampled, rewarded and trained on μ times.

Chosen once by the task's objective (`feed`; a `Samples` objective, e.g. GRPO's): the LM feed
reads a batch per step; the `Rollout` feed, every μ steps (μ = `objective.num_iterations`),
takes B prompts from the train input (`inputs.answers`: prompts with answers, and the ids
that stop a completion), samples G completions each with `run.sampling`'s on-device sampler
on the same mesh and the train state's own params (no copy; it compiles once), each
stopping at the first of its stop ids (`stop_ids`), scores them with the objective's
rewards, normalizes the advantages per group, scores the samples' log-probs as the loss
does (one forward: the old log-probs when μ > 1, and the gap to the sampler's own), and
trains μ optimizer steps on that batch. One loop
step is one optimizer step, as for the LM loss, so checkpoints, logs and summaries count
alike.

A sample's draws depend on (objective.seed, its id, position): id = prompt row · G + g,
the prompt row counting the train input's rows (`ids`), so every mesh samples the same.
Metrics added to each step's: reward and reward_std (over the global batch), each reward's
mean (`reward/<name>`, with several rewards; this process's rows), completion_len (tokens,
this process's rows), samples_per_sec (of the sampling phase), sample_seconds and
train_seconds (the last rollout's sampling, and the μ updates before it: the time split),
logp_gap_mean and logp_gap_max (|trainer's - sampler's| token log-prob over the completion
tokens: float noise when both run the same params), sampler_utilization (decode slot-steps
that produced a kept token / all), with a paged KV pool sampler_preempted (samples re-run).
The batch's `advantages` and `old_logp` are the keys the objective's loss reads
(`objectives.grpo`).
"""
import dataclasses
import json
import time
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from spmdtask import console, fs
from spmdtask.core import checks, global_batch, sharding, steps as steps_lib
from spmdtask.core.host_input import process_slice
from spmdtask.run import decoding, goodput_events, sampling
from spmdtask.task import DecodeParams

PROMPT_KEYS = ("prompts", "prompt_lens", "ids")


def stop_ids(objective, inputs) -> tuple[int, ...]:
  """The tokens that end a completion: the objective's `eos_id` (one id or a tuple) where
  set, else the train input's `stop_ids` (a prompts data dir's eos and end-of-turn)."""
  if objective.eos_id is not None:
    return checks.stop_ids("task.objective.eos_id", objective.eos_id)
  return tuple(inputs.stop_ids)


def decode_params(objective, prompt_len: int, stops: tuple[int, ...] = ()) -> DecodeParams:
  """The sampling phase's decode params: room for max_new_tokens after the longest prompt,
  stopping at the first of `stops`."""
  return DecodeParams(max_decode_len=prompt_len + objective.max_new_tokens,
                      temperature=objective.temperature, top_k=objective.top_k,
                      top_p=objective.top_p, seed=objective.seed, eos_id=tuple(stops) or None)


def repeat_prompts(local: dict, group: int) -> dict:
  """Each prompt row G times (adjacent), ids -> sample ids row · G + g."""
  out = {k: np.repeat(np.asarray(local[k]), group, axis=0) for k in PROMPT_KEYS}
  out["ids"] = (out["ids"] * group + np.tile(np.arange(group), len(local["ids"]))).astype(
      np.int32)
  return out


def lm_rows(samples: list[dict], seq_len: int, max_new_tokens: int) -> dict[str, np.ndarray]:
  """Samples (decoding's rows: prompt_ids, output_ids) -> LM rows [n, seq_len]: inputs the
  prompt then the completion (at most max_new_tokens), targets the next token, weights 1
  where the target is a completion token."""
  n = len(samples)
  tokens = np.zeros((n, seq_len + 1), np.int32)
  weights = np.zeros((n, seq_len), np.float32)
  for r, s in enumerate(samples):
    p, out = len(s["prompt_ids"]), s["output_ids"][:max_new_tokens]
    tokens[r, :p], tokens[r, p:p + len(out)] = s["prompt_ids"], out
    weights[r, _completion_targets(s, len(out))] = 1.0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def _completion_targets(sample: dict, n: int) -> slice:
  """Where an LM row's targets are the sample's first `n` completion tokens: the row's
  position p - 1 predicts the token at p (p the prompt's length)."""
  p = len(sample["prompt_ids"])
  return slice(p - 1, p - 1 + n)


def completion_ids(sample: dict, max_new_tokens: int, stops: tuple[int, ...]) -> list[int]:
  """A sample's completion ids as the rewards read them: the stop token left out."""
  out = sample["output_ids"][:max_new_tokens]
  return out[:-1] if out and out[-1] in stops else out


def example_batch(objective, local_prompt_rows: int, prompt_len: int) -> dict[str, np.ndarray]:
  """Zeros shaped like a process's train batch (for setting up the program)."""
  n, t = local_prompt_rows * objective.num_generations, prompt_len + objective.max_new_tokens
  batch = {"inputs": np.zeros((n, t), np.int32), "targets": np.zeros((n, t), np.int32),
           "weights": np.zeros((n, t), np.float32), "advantages": np.zeros((n,), np.float32)}
  if objective.num_iterations > 1 or objective.overlap_sampling:
    batch["old_logp"] = np.zeros((n, t), np.float32)
  return batch


class Sampler:
  """G completions per prompt of a batch, sampled on the device (`run.sampling`: each prompt
  prefilled once, `objective.sampler_slots` decode slots refilled as samples finish, one
  while_loop), each token with its log-prob (`logp`)."""

  def __init__(self, program, objective, prompts_per_step: int, local_prompts: int,
               prompt_len: int, stops: tuple[int, ...] = ()):
    self.objective, self.group, self.stops = objective, objective.num_generations, stops
    self.seq_len = prompt_len + objective.max_new_tokens
    self.generate = sampling.build(
        program, decode_params(objective, prompt_len, stops), prompts_per_step, prompt_len,
        self.group, objective.max_new_tokens, objective.sampler_slots,
        objective.score_temperature(), pages=objective.sampler_kv_pages,
        page_size=objective.sampler_page_size)
    self.utilization = 0.0  # the last call's: slot-steps that produced a kept token / all
    self.preempted = 0  # the last call's preempted samples (a paged pool's, run.pages)

  def sample(self, padded_params, local: dict) -> list[dict]:
    """This process's samples of `local` prompts, in row order (prompt-major): id,
    prompt_ids, output_ids, logp."""
    return self.collect(self.start(padded_params, local))

  def start(self, padded_params, local: dict):
    """`sample`'s program dispatched (it runs on the devices; nothing waits for it)."""
    return local, self.generate(padded_params, local)

  def collect(self, started) -> list[dict]:
    """`sample`'s result of a `start`ed sampling (waits for it)."""
    local, out = started
    by_id = sampling.to_rows(out)
    busy, slot_steps, preempted = jax.device_get((out.busy, out.slot_steps, out.preempted))
    self.utilization, self.preempted = float(busy) / max(int(slot_steps), 1), int(preempted)
    rows = repeat_prompts(local, self.group)
    return [{"id": int(i), "prompt_ids": rows["prompts"][r, :rows["prompt_lens"][r]].tolist(),
             **by_id[int(i)]} for r, i in enumerate(rows["ids"])]


class TokenLoopSampler(Sampler):
  """The sampler before `run.sampling` (the benchmark's baseline): `run.decoding`'s
  programs on B·G rows, every prompt prefilled G times, one jitted step per token driven
  from the host, a row that stops idling until the batch is done; no log-probs."""

  def __init__(self, program, objective, prompts_per_step: int, local_prompts: int,
               prompt_len: int, stops: tuple[int, ...] = ()):  # pylint: disable=super-init-not-called
    self.objective, self.group, self.stops = objective, objective.num_generations, stops
    self.seq_len = prompt_len + objective.max_new_tokens
    self.decoder = decoding.build(program, decode_params(objective, prompt_len, stops),
                                  prompts_per_step * self.group, prompt_len)
    self.local_rows = local_prompts * self.group

  def sample(self, padded_params, local: dict) -> list[dict]:
    rows = repeat_prompts(local, self.group)
    results = decoding.decode_batch(self.decoder, padded_params, rows, self.local_rows)
    by_id = {r["id"]: r for r in results}
    return [by_id[int(i)] for i in rows["ids"]]


def scorer(program, objective):
  """Jitted `(padded_params, rows, sampler_logp [n, t]) -> (logp [n, t], gap mean, gap
  max)`: the current policy's token log-probs scored as the loss scores them (the sampling
  policy's of the μ updates) and their distance |logp - the sampler's| over the completion
  tokens (rows' weights > 0)."""
  model, logical = program.model, program.layout.logical.params
  specs = {k: program.batch_specs[k] for k in objective.model_batch(program.batch_specs)}
  per_token = program.batch_specs["targets"]

  def score(padded_params, rows, sampled):
    params = sharding.unpad(padded_params, logical)
    logp = objective.token_logprobs(model, params, rows)
    scored = rows["weights"] > 0
    gap = jnp.where(scored, jnp.abs(logp - sampled), 0.0)
    return logp, jnp.sum(gap) / jnp.maximum(jnp.sum(scored), 1), jnp.max(gap)
  return steps_lib.partition(score, program.mesh, (program.layout.split.params, specs, per_token),
                             (per_token, P(), P()))


def sampler_logp(samples: list[dict], seq_len: int, max_new_tokens: int) -> np.ndarray:
  """The samples' token log-probs placed as `lm_rows` places their targets [n, seq_len]."""
  out = np.zeros((len(samples), seq_len), np.float32)
  for r, s in enumerate(samples):
    logp = s["logp"][:max_new_tokens]
    out[r, _completion_targets(s, len(logp))] = logp
  return out


@dataclasses.dataclass
class Rollout:
  """The GRPO feed: `step(state) -> (state, metrics)` (module doc)."""
  program: Any
  inputs: Any            # the train input: prompts with answers
  sampler: Sampler
  tokenizer: Any
  scorer: Any = None
  record: goodput_events.Recorder = goodput_events.OFF  # times the waits for prompts
  _batch: Any = None
  _extra: dict = dataclasses.field(default_factory=dict)
  _left: int = 0
  _t_train: float | None = None
  _ahead: dict | None = None  # the input's position before a batch sampled ahead

  def step(self, state):
    obj = self.sampler.objective
    if obj.overlap_sampling:
      return self._overlapped(state)
    if self._left == 0:
      jax.block_until_ready(state.params)  # the train steps' time ends here
      self._batch, self._extra = self._finish(self._start(state), state)
      self._left = obj.num_iterations
    self._left -= 1
    state, metrics = self.program.train(state, self._batch)
    return state, {**metrics, **self._extra}

  def _overlapped(self, state):
    """One step off-policy: the next batch is sampled from the params before this batch's
    last update, dispatched ahead of it, and finished on the host (decoded, rewarded)
    while that update runs on the devices. The first batch (and a resumed run's) is
    sampled at once, on-policy."""
    obj = self.sampler.objective
    if self._batch is None:
      self._batch, self._extra = self._finish(self._start(state), state)
      self._left = obj.num_iterations
    pending = self._start(state) if self._left == 1 else None
    self._left -= 1
    state, metrics = self.program.train(state, self._batch)
    metrics = {**metrics, **self._extra}
    if pending is not None:
      self._batch, self._extra = self._finish(pending, state)
      self._left = obj.num_iterations
    return state, metrics

  def input_state(self) -> dict | None:
    """The train input's position for a checkpoint: with a batch sampled ahead
    (`overlap_sampling`), the position before its prompts, so a resumed run samples them
    again (on its own params) instead of skipping them."""
    return self._ahead if self._ahead is not None else _input_state(self.inputs)

  def _start(self, state):
    """(the sampling dispatched on `state`'s params, when it started, the train step's
    seconds before it)."""
    t0 = time.perf_counter()
    train_seconds = 0.0 if self._t_train is None else t0 - self._t_train
    with self.record.phase("data"):
      ahead = self.sampler.objective.overlap_sampling and self._batch is not None
      self._ahead = _input_state(self.inputs) if ahead else None
      local = next(self.inputs)
    return self.sampler.start(state.params, local), t0, train_seconds

  def _finish(self, pending, state):
    """(the train batch, its metrics) of a `_start`ed sampling; log-probs (the old ones
    of the μ updates, the sampler's gap) scored with `state`'s params."""
    obj = self.sampler.objective
    started, t0, train_seconds = pending
    local = started[0]
    samples = self.sampler.collect(started)
    t1 = time.perf_counter()
    rows = lm_rows(samples, self.sampler.seq_len, obj.max_new_tokens)
    texts = [self.tokenizer.decode(completion_ids(s, obj.max_new_tokens, self.sampler.stops))
             for s in samples]
    prompts = [self.tokenizer.decode(s["prompt_ids"]) for s in samples]
    answers = list(np.repeat(local["answers"], obj.num_generations))
    local_r, means = obj.score(prompts, texts, answers)
    all_r = np.asarray(multihost_utils.process_allgather(np.asarray(local_r, np.float32)))
    all_r = all_r.reshape(-1)
    adv = np.asarray(obj.advantages(jnp.asarray(all_r)))
    lo, hi = process_slice(len(all_r))
    rows["advantages"] = adv[lo:hi].astype(np.float32)
    # the rows' leaves only: old_logp (μ > 1) is computed on the devices
    batch = global_batch.to_global(rows, {k: self.program.batch_specs[k] for k in rows},
                                   self.program.mesh)
    sampled = global_batch.to_global(
        sampler_logp(samples, self.sampler.seq_len, obj.max_new_tokens),
        self.program.batch_specs["targets"], self.program.mesh)
    logp, gap_mean, gap_max = self.scorer(state.params, obj.model_batch(batch), sampled)
    if obj.overlap_sampling:  # the policy that sampled them: params one update older
      batch["old_logp"] = sampled
    elif obj.num_iterations > 1:
      batch["old_logp"] = logp
    lengths = rows["weights"].sum(-1)
    extra = {"reward": float(all_r.mean()), "reward_std": float(all_r.std()),
             **({f"reward/{k}": v for k, v in means.items()} if len(means) > 1 else {}),
             "completion_len": float(lengths.mean()),
             "logp_gap_mean": float(gap_mean), "logp_gap_max": float(gap_max),
             "sampler_utilization": self.sampler.utilization,
             **({"sampler_preempted": float(self.sampler.preempted)}
                if obj.sampler_kv_pages else {}),
             "samples_per_sec": len(all_r) / max(t1 - t0, 1e-9),
             "sample_seconds": t1 - t0, "train_seconds": train_seconds}
    self._t_train = time.perf_counter()
    return batch, extra


@runtime_checkable
class Samples(Protocol):
  """An objective trained on the model's own samples (GRPO): the loop then feeds `Rollout`."""
  num_generations: int
  max_new_tokens: int
  num_iterations: int
  eos_id: int | tuple[int, ...] | None
  sampler_slots: int     # decode slots of `run.sampling` (0 = one per sample)
  sampler_kv_pages: int  # its completions' KV pages (`run.pages`; 0 = a KV row a slot)
  sampler_page_size: int  # tokens of a page
  overlap_sampling: bool  # the next batch sampled while this one trains (`Rollout`)

  def score_temperature(self) -> float:
    """What the logits are divided by where log-probs are scored (sampler and loss alike)."""

  def check_room(self, prompt_len: int, max_seq_len: int, field: str) -> None:
    """ConfigError when a prompt leaves no room for the completion."""

  def score(self, prompts: list[str], completions: list[str],
            answers: list[str]) -> tuple[list[float], dict[str, float]]:
    """(each sample's reward, each reward function's mean by name)."""

  def advantages(self, rewards: jax.Array) -> jax.Array:
    """The global batch's rewards [B·G] (groups adjacent) -> advantages [B·G]."""

  def reward_files(self) -> dict[str, str]:
    """{reward name: fingerprint} of the rewards read from the user's files."""

  def model_batch(self, batch: dict) -> dict:
    """The batch's LM rows (`Objective.model_batch`)."""

  def token_logprobs(self, model, params, rows) -> jax.Array:
    """[n, t] log-probs of the rows' targets as the loss scores them (the sampling policy's)."""


class LmFeed(NamedTuple):
  """The default feed: one batch of the train input per step."""
  program: Any
  inputs: Any
  record: goodput_events.Recorder = goodput_events.OFF  # times the waits for batches

  def step(self, state):
    with self.record.phase("data"):
      batch = next(self.inputs)
    return self.program.train(state, self.program.global_batch(batch))

  def input_state(self) -> dict | None:
    """The train input's position, for a checkpoint."""
    return _input_state(self.inputs)


def _input_state(inputs) -> dict | None:
  return inputs.get_state() if hasattr(inputs, "get_state") else None


REWARD_FILES = "reward_files.json"  # in the job dir: the user reward files' fingerprints


def note_reward_files(objective, job_log_dir: str | None, first_step: int) -> None:
  """Records the fingerprints of a `Samples` objective's reward files in the job dir; a
  resumed job (first_step > 0) says which changed since it last ran (process 0 writes)."""
  if not isinstance(objective, Samples) or job_log_dir is None or jax.process_index():
    return
  now, path = objective.reward_files(), fs.join(job_log_dir, REWARD_FILES)
  before = json.loads(fs.read_text(path)) if fs.exists(path) else {}
  for name, digest in now.items():
    if first_step and name in before and before[name] != digest:
      console.say("Reward %s: its file changed since this job last ran (sha256 %s..., now "
                  "%s...); the steps from %d on are rewarded by the file as it is now.", name,
                  before[name][:12], digest[:12], first_step + 1)
  if now:
    fs.write_text(path, json.dumps({**before, **now}, indent=1))


def example(run) -> dict:
  """The process-local example batch the program is set up with: the train input's first
  batch, or with a `Samples` objective the shape of a rollout's train batch (after checking
  that the prompts leave room for the completions)."""
  obj, inputs = run.task.objective, run.datasets["train"]
  if not isinstance(obj, Samples):
    return inputs.batch_at(0)
  obj.check_room(int(inputs.prompt_len), int(run.task.model.max_seq_len), "datasets['train']")
  return example_batch(obj, int(inputs.local_batch_size), int(inputs.prompt_len))


def feed(run, program, record: goodput_events.Recorder = goodput_events.OFF):
  """What the loop calls each step (`.step(state) -> (state, metrics)`), chosen once from
  the task's objective; `record` times its waits for the train input."""
  obj, inputs = run.task.objective, run.datasets["train"]
  if not isinstance(obj, Samples):
    return LmFeed(program, inputs, record)
  sampler = Sampler(program, obj, int(inputs.batch_size), int(inputs.local_batch_size),
                    int(inputs.prompt_len), stop_ids(obj, inputs))
  return Rollout(program, inputs, sampler, inputs.tokenizer, scorer(program, obj), record)
