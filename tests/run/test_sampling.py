"""The on-device sampler (`run.sampling`, GRPO's `rollout.Sampler`): greedy equals today's
per-token decode token for token with and without slot refill, in the plan's worst-case
iterations at full length, several stop ids stop rows at the first, 1 and 8 devices sample
alike, half the slots give the same long-tail samples, a loop per data shard samples as the
shared loop (the layout's choice; FSDP keeps the shared one), the sampler's log-probs are
the trainer's."""
import dataclasses
import functools
import types

import jax
import numpy as np
import pytest

from configs import grpo as grpo_configs  # pylint: disable=unused-import  (registers)
from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.core import model as model_lib
from spmdtask.run import pages as pages_lib, rollout, rollout_plan, sampling
from tests import util

PROMPTS, GROUP, NEW = 8, 4, 12   # 32 samples of at most 12 tokens
SLOTS = 8                         # a pool of 8 slots (one per device): refilled 3+ times


def _setup(num_devices: int, overrides=()):
  """(run, program, fresh padded params, the train input's first prompts)."""
  mesh = [] if num_devices == 8 else ["task.ici_mesh_shape=(1, 1, 1)"]
  run = util.build_run("TinyLmGrpo", [f"datasets['train'].batch_size={PROMPTS}",
                                      f"task.objective.num_generations={GROUP}",
                                      f"task.objective.max_new_tokens={NEW}", *mesh, *overrides])
  program = program_lib.setup(run.task, rollout.example(run), jax.devices()[:num_devices])
  inputs = run.datasets["train"]
  return run, program, program.init().params, inputs.batch_at(0)


def _sampler(run, program, cls=rollout.Sampler, stops=(), **objective):
  obj = dataclasses.replace(run.task.objective, **objective)
  inputs = run.datasets["train"]
  return cls(program, obj, PROMPTS, int(inputs.local_batch_size), int(inputs.prompt_len), stops)


def _outputs(samples) -> dict[int, list[int]]:
  return {s["id"]: s["output_ids"] for s in samples}


@pytest.fixture(scope="module")
def eight():
  return _setup(8)


@functools.lru_cache(maxsize=None)
def _on_mesh(mesh: str):
  """`_setup` on 8 devices as `mesh` (data, fsdp, model), once a module."""
  return _setup(8, [f"task.ici_mesh_shape={mesh}"])


@pytest.fixture(scope="module")
def greedy(eight):
  """Today's greedy decode (host loop, no stop id), each sample's first NEW tokens."""
  run, program, params, local = eight
  today = _sampler(run, program, rollout.TokenLoopSampler, temperature=0.0)
  return {i: out[:NEW] for i, out in _outputs(today.sample(params, local)).items()}


@pytest.mark.parametrize("slots", [0, SLOTS])
def test_greedy_equals_todays_decode_token_for_token(eight, greedy, slots):
  run, program, params, local = eight
  new = _sampler(run, program, temperature=0.0, sampler_slots=slots)
  samples = new.sample(params, local)
  assert [s["id"] for s in samples] == list(rollout.repeat_prompts(local, GROUP)["ids"])
  assert _outputs(samples) == greedy
  assert all(len(s["logp"]) == len(s["output_ids"]) for s in samples)
  # every sample runs NEW tokens (its first from the prefill): the loop runs the plan's
  # worst case, each iteration every slot busy
  n = PROMPTS * GROUP
  worst = sampling.worst_case_iterations(n, slots, NEW)
  assert worst == (NEW - 1) * (1 if slots == 0 else n // slots)
  assert new.utilization == pytest.approx(n * (NEW - 1) / (worst * (slots or n)), rel=1e-12)


def test_several_stop_ids_stop_each_row_at_the_first_of_them(eight, greedy):
  run, program, params, local = eight
  # two tokens the greedy rows emit at different places: rows end at various lengths
  counts = np.bincount(np.concatenate([o[1:] for o in greedy.values()]), minlength=300)
  stops = tuple(int(t) for t in np.argsort(counts)[-2:])
  def cut(out):
    at = [k for k, t in enumerate(out) if t in stops]
    return out[:at[0] + 1] if at else out
  want = {i: cut(out) for i, out in greedy.items()}
  lengths = {len(o) for o in want.values()}
  assert len(lengths) > 2 and min(lengths) < NEW, want  # the refill is exercised
  new = _sampler(run, program, stops=stops, temperature=0.0, sampler_slots=SLOTS)
  assert _outputs(new.sample(params, local)) == want
  assert new.utilization > sum(map(len, want.values())) / (NEW * len(want))


@pytest.mark.parametrize("mesh,whole", [(None, ()), ("(4, 1, 2)", ()), ("(4, 2, 1)", ("fsdp",)),
                                        ("(1, 8, 1)", ("fsdp",))])
def test_1_and_8_devices_sample_the_same(eight, mesh, whole):
  """8 devices as data 8 (the fixture's) or data 4 x model 2 (the model axis automatic
  inside each data shard's loop), or with the weights split over fsdp: the shared loop,
  its rows whole over fsdp (`whole_rows`), attention split by the KV heads (data 4 x fsdp
  2: TinyLm's 2 KV heads over fsdp) or by rows (fsdp 8), sample as one device."""
  run8, program8, params8, local = eight if mesh is None else _on_mesh(mesh)
  run1, program1, params1, _ = _setup(1)
  util.assert_trees_close(jax.device_get(params1), jax.device_get(params8))
  sampled = dict(temperature=1.0, top_k=50, seed=3)
  pool = _sampler(run8, program8, stops=(256,), sampler_slots=SLOTS, **sampled)
  assert pool.generate.per_shard == (not whole) and pool.generate.whole_rows == whole
  a = pool.sample(params8, local)
  b = _sampler(run1, program1, stops=(256,), **sampled).sample(params1, local)
  assert _outputs(a) == _outputs(b)
  for s, t in zip(a, b):
    util.assert_close_f32(s["logp"], t["logp"], terms=64)


def test_half_the_slots_give_the_same_long_tail_samples(eight):
  """A pool of half the samples' slots (half the KV cache rows): samples wait for a free
  slot and come out the same as with one slot a sample, at temperature 1 with lengths
  from 1 to NEW (a quarter of the vocabulary stops a sample)."""
  run, program, params, local = eight
  stops = tuple(range(0, 264, 4))
  sampled = dict(temperature=1.0, seed=5)
  full = _sampler(run, program, stops=stops, **sampled)
  half = _sampler(run, program, stops=stops, sampler_slots=PROMPTS * GROUP // 2, **sampled)
  a, b = full.sample(params, local), half.sample(params, local)
  lengths = [len(s["output_ids"]) for s in a]
  assert min(lengths) == 1 and max(lengths) == NEW and len(set(lengths)) > 4, lengths
  assert _outputs(a) == _outputs(b)
  for s, t in zip(a, b):  # the same draws; the same logits up to the slot's rows' sums
    util.assert_close_f32(s["logp"], t["logp"], terms=64)
  assert half.utilization > full.utilization  # the long tail keeps fewer slots idle


def test_a_loop_per_shard_samples_as_the_shared_loop(eight):
  """8 devices, no weight split over the data axes: the layout's choice is a loop per data
  shard (2 of the 16 slots each). Its samples are the shared loop's token for token, the
  log-probs the same up to float32 summation order (64-term dot products: f32_atol), its
  busy slot-steps the same; it runs fewer slot-steps than the shared one (its longest loop
  may run more iterations than the shared loop: a shard's waiting line is its own)."""
  run, program, params, local = eight
  plen, slots = int(run.datasets["train"].prompt_len), 16
  obj = dataclasses.replace(run.task.objective, temperature=1.0, seed=5)
  dp = rollout.decode_params(obj, plen, tuple(range(0, 264, 4)))  # lengths 1 to NEW
  own = sampling.build(program, dp, PROMPTS, plen, GROUP, NEW, slots)
  shared = sampling.build(program, dp, PROMPTS, plen, GROUP, NEW, slots, per_shard=False)
  assert own.per_shard and not shared.per_shard
  a, b = jax.device_get(own(params, local)), jax.device_get(shared(params, local))
  for field in ("tokens", "lengths", "ids", "busy"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  util.assert_close_f32(a.logp, b.logp, terms=64)
  assert len(set(a.lengths.tolist())) > 4 and a.busy == np.sum(a.lengths - 1)
  assert b.slot_steps == b.iterations * slots
  assert a.busy <= a.slot_steps < b.slot_steps and a.slot_steps <= a.iterations * slots


def test_fsdp_and_one_device_keep_the_shared_loop():
  """Weights split over the data axes (FSDP over 8 devices): a shard cannot step alone."""
  for overrides, devices in ((["task.ici_mesh_shape=(1, 8, 1)"], 8),
                             (["task.ici_mesh_shape=(1, 1, 1)"], 1)):
    run = util.build_run("TinyLmGrpo", [f"datasets['train'].batch_size={PROMPTS}", *overrides])
    program = program_lib.setup(run.task, rollout.example(run), jax.devices()[:devices])
    assert not sampling.per_shard_loops(program, PROMPTS)


def test_the_sampler_log_probs_are_the_trainers(eight):
  """The rollout's metrics: |trainer's - sampler's| token log-prob at float noise (the same
  params; the sampler's come from the cached decode, the trainer's from the full forward)."""
  run, program, _, _ = eight
  run = dataclasses.replace(run, task=dataclasses.replace(
      run.task, objective=dataclasses.replace(run.task.objective, temperature=0.7,
                                              sampler_slots=SLOTS)))
  feed = rollout.feed(run, program)
  _, metrics = feed.step(program.init())
  # |logp| <= ~10 here (264 tokens at temperature 0.7), its logits sums of 64-term dot
  # products: 8 eps32 · 10 · sqrt(64) = 7.6e-5 (measured: max 3.6e-6, mean 7e-7)
  tol = util.f32_atol(10.0, terms=64)
  assert 0 <= metrics["logp_gap_mean"] <= metrics["logp_gap_max"] <= tol, metrics
  assert 0 < metrics["sampler_utilization"] <= 1


def test_bad_slot_counts_are_config_errors():
  for slots, shards in ((0, 1), (33, 1), (6, 4), (2.5, 1)):
    with pytest.raises(ConfigError, match="sampler_slots"):
      sampling.check_slots(slots, 32, shards, "task.objective.sampler_slots")


# -------------------------------------------------------------------- paged (run.pages)

PAGE = 4  # tokens a page: a sample of NEW = 12 tokens spans 3


def _long_tail(run):
  """Decode params at temperature 1 with a quarter of the vocabulary stopping: lengths 1 to NEW."""
  obj = dataclasses.replace(run.task.objective, temperature=1.0, seed=5)
  return rollout.decode_params(obj, int(run.datasets["train"].prompt_len),
                               tuple(range(0, 264, 4)))


def _same_samples(a, b):
  for field in ("tokens", "lengths", "ids"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  util.assert_close_f32(a.logp, b.logp, terms=64)


@pytest.fixture(scope="module")
def one():
  return _setup(1)


def test_a_paged_pool_samples_as_the_unpaged_cache(one):
  """One device, 16 slots, long-tail lengths: pools of every slot's pages at max length
  (unbounded: 48), half of them (24) and one sample's (3: preemption) give the unpaged
  cache's samples. Busy slot-steps stay the kept tokens' (a preempted sample's steps are
  `recomputed`, apart): utilization stays honest."""
  run, program, params, local = one
  plen, slots, dp = int(run.datasets["train"].prompt_len), 16, _long_tail(run)
  build = lambda pages: sampling.build(program, dp, PROMPTS, plen, GROUP, NEW, slots,
                                       pages=pages, page_size=PAGE)
  want = jax.device_get(build(0)(params, local))
  assert want.preempted == 0 and want.recomputed == 0 and len(set(want.lengths.tolist())) > 4
  runs = {pages: jax.device_get(build(pages)(params, local)) for pages in (48, 24, 3)}
  for pages, got in runs.items():
    _same_samples(got, want)
    assert got.busy == np.sum(want.lengths - 1) == want.busy, pages
    assert got.busy + got.recomputed <= got.slot_steps, pages
  assert runs[48].preempted == 0 and runs[48].slot_steps == want.slot_steps
  assert runs[3].preempted > 0 and runs[3].recomputed > 0, runs[3]
  assert runs[3].slot_steps > want.slot_steps


def test_paged_greedy_equals_todays_decode_with_preemption(eight, greedy):
  """Temperature 0, every sample at NEW tokens, a slot a sample (4 a shard) sharing half
  their pages (6 a shard: 2 samples at full length): samples are preempted and re-run, and
  come out as today's greedy decode token for token."""
  run, program, params, local = eight
  new = _sampler(run, program, temperature=0.0, sampler_kv_pages=PROMPTS * GROUP * 3 // 2,
                 sampler_page_size=PAGE)
  assert _outputs(new.sample(params, local)) == greedy
  assert new.preempted > 0
  n = PROMPTS * GROUP
  assert 0 < new.utilization < n * (NEW - 1) / (sampling.worst_case_iterations(n, n, NEW) * n)


def test_paged_1_and_8_devices_sample_the_same(one):
  """Data 4 x model 2 (a loop per data shard, the pool's KV heads over the model axis) and
  one device, 8 slots sharing 12 pages of 4 tokens (4 slots' at full length; 3 a shard),
  sample alike, each preempting as its pools say."""
  run8, program8, params8, local = _on_mesh("(4, 1, 2)")
  run1, program1, params1, _ = one
  kw = dict(stops=(256,), sampler_slots=SLOTS, sampler_kv_pages=12, sampler_page_size=PAGE,
            temperature=1.0, top_k=50, seed=3)
  pool = _sampler(run8, program8, **kw)
  assert pool.generate.per_shard and pool.generate.pages == 12
  a = pool.sample(params8, local)
  alone = _sampler(run1, program1, **kw)
  b = alone.sample(params1, local)
  assert _outputs(a) == _outputs(b)
  assert pool.preempted > 0 and alone.preempted > 0  # samples at full length: 2 a pool
  for s, t in zip(a, b):
    util.assert_close_f32(s["logp"], t["logp"], terms=64)


def test_fsdp_pages_where_its_rows_are_whole():
  """FSDP over 2 devices (TinyLm's 2 KV heads divide it): the shared loop's rows are whole,
  its cache split over the KV heads, so a pool holds there too: half the pages and one
  sample's (preempting) give the unpaged samples; over 8 (the heads do not divide it, the
  rows stay split) it is a ConfigError."""
  run, program, params, local = _setup(2, ["task.ici_mesh_shape=(1, 2, 1)"])
  plen, dp = int(run.datasets["train"].prompt_len), _long_tail(run)
  build = lambda pages: sampling.build(program, dp, PROMPTS, plen, GROUP, NEW, 16,
                                       pages=pages, page_size=PAGE)
  want = jax.device_get(build(0)(params, local))
  for pages in (24, 3):
    gen = build(pages)
    assert gen.whole_rows == ("fsdp",) and not gen.per_shard
    got = jax.device_get(gen(params, local))
    _same_samples(got, want)
    assert (got.preempted > 0) == (pages == 3), got.preempted
  fsdp8, program8, _, _ = _on_mesh("(1, 8, 1)")
  with pytest.raises(ConfigError, match="sampler_kv_pages.*rows over mesh axes"):
    sampling.build(program8, dp, PROMPTS, plen, GROUP, NEW, 16, pages=24, page_size=PAGE)


def test_the_plan_reads_the_pool_and_the_prompts(one):
  """The plan's decode iteration reads the pool and the prompts' KV (not slots x max
  length); at max length the pool holds pages / 3 samples at once: its worst case's waves."""
  run, program, _, _ = one
  obj = dataclasses.replace(run.task.objective, max_new_tokens=NEW, sampler_slots=16,
                            sampler_kv_pages=24, sampler_page_size=PAGE)
  loop = rollout_plan.sampling_lowerings(
      dataclasses.replace(run, task=dataclasses.replace(run.task, objective=obj)), program)[0].loop
  plen = int(run.datasets["train"].prompt_len)
  assert loop.cache_bytes == model_lib.cache_bytes_per_token(program.model) * (
      24 * PAGE + PROMPTS * plen)
  assert loop.trips == sampling.worst_case_iterations(PROMPTS * GROUP, 24 // 3, NEW)


def test_bad_pools_are_config_errors(eight):
  """Page sizes below 1, pools not divisible over the loops or short of one sample a loop,
  and models whose cache is not one stack of per-head KV (MLA, dense layers before MoE)."""
  for pages, size, shards in ((7, 4, 8), (8, 4, 8 * 2), (-8, 4, 1), (2, 4, 1), (8, 0, 1)):
    with pytest.raises(ConfigError, match="sampler_kv_pages" if size else "sampler_page_size"):
      pages_lib.check(pages, size, NEW, shards)
  pages_lib.check(0, 4, NEW, 8)  # unpaged
  for model in (types.SimpleNamespace(mla=True), types.SimpleNamespace(
      mla=None, moe=types.SimpleNamespace(first_moe_layer=1))):  # MLA's latents; two stacks
    with pytest.raises(ConfigError, match="sampler_kv_pages.*(mla|first_moe_layer)"):
      pages_lib.check_place(model, None, {}, set())
  run, program, _, _ = eight  # 8 loops: 8 pages a loop is W = 3 pages of 4 tokens and more
  _sampler(run, program, sampler_kv_pages=64, sampler_page_size=PAGE)
  with pytest.raises(ConfigError, match="sampler_kv_pages=16.*at least 24"):
    _sampler(run, program, sampler_kv_pages=16, sampler_page_size=PAGE)
