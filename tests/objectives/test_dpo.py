"""DPO (spmdtask.objectives.dpo): the loss and per-pair rewards equal TRL's DPOTrainer's on a
tiny random HF Llama policy and a different tiny reference (tests/tools/data/dpo, made with
torch and TRL 1.16: README there); the precomputed reference equals the in-step one; 1 and
8 devices train alike; the bad inputs' paragraphs."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs.preferences import pair_rows
from spmdtask.objectives import dpo
from spmdtask.hf import convert, files, llama, model_overrides
from tests import util

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                    "data")
SEQ_LEN = 16


@pytest.fixture(scope="module")
def hf_models():
  """(model, policy params, reference params) converted by spmdtask.hf's functions."""
  params = {}
  for name, src in (("policy", "llama"), ("reference", "dpo/reference")):
    cfg, tensors = files.read_hf(os.path.join(DATA, src))
    params[name] = convert.to_params(cfg, tensors)
  model = util.build_run(llama.FAMILY.experiment, model_overrides.overrides(cfg)).task.model
  return model, params["policy"], params["reference"]


def _fixture_batch():
  """The fixture's pairs as a [4, 2, SEQ_LEN] batch, and TRL's numbers."""
  with open(os.path.join(DATA, "dpo", "pairs.json")) as f:
    fix = json.load(f)
  docs, masks = [], []
  for p in fix["pairs"]:
    for k in ("chosen_ids", "rejected_ids"):
      docs.append(np.asarray(p["prompt_ids"] + p[k]))
      masks.append(np.asarray([0] * len(p["prompt_ids"]) + [1] * len(p[k])))
  rows = pair_rows(docs, masks, SEQ_LEN)
  return {k: v.reshape(-1, 2, SEQ_LEN) for k, v in rows.items()}, fix


def test_loss_and_rewards_equal_trl(hf_models):
  model, policy, reference = hf_models
  batch, fix = _fixture_batch()
  objective = dpo.Dpo(beta=0.1)
  pre = dpo.Dpo(beta=0.1, reference="precomputed")

  @jax.jit
  def run(b):
    loss, metrics = objective.loss(model, policy, b, None, reference)
    rows = objective.model_batch(b)
    logps, ref = (dpo.sequence_logps(model, p, rows).reshape(4, 2) for p in (policy, reference))
    _, rewards = objective.pair_losses(logps, ref, rows["weights"].sum(-1).reshape(4, 2))
    # The reference's log-probs given in the batch (precomputed) give the in-step loss.
    precomputed = pre.loss(model, policy, {**b, dpo.REF_LOGPS: ref}, None, None)[0]
    # token_logprobs is the LM loss's path: its weighted mean is minus the loss.
    lp = model.apply({"params": policy}, rows, method=model.token_logprobs)
    lm = model.apply({"params": policy}, rows, method=model.loss)[0]
    return loss, metrics, rewards, precomputed, -jnp.sum(lp * rows["weights"]) / jnp.sum(
        rows["weights"]) - lm

  loss, metrics, rewards, precomputed, lm_gap = run(batch)
  # float32 sums of <= 9 token log-probs of size <= 7: a few ulps of 60.
  assert abs(float(loss) - fix["trl_loss"]) <= 1e-5, (float(loss), fix["trl_loss"])
  assert float(metrics["loss"].weight) == 4.0
  for ours, trl in (("rewards/chosen", "rewards/chosen"), ("rewards/rejected", "rewards/rejected"),
                    ("rewards/margin", "rewards/margins"), ("rewards/accuracy",
                                                            "rewards/accuracies")):
    got = float(metrics[ours].sum / metrics[ours].weight)
    assert abs(got - fix["trl_metrics"][trl]) <= 1e-5, (ours, got, fix["trl_metrics"][trl])
  np.testing.assert_allclose(np.asarray(rewards), np.load(os.path.join(DATA, "dpo",
                                                                       "trl_rewards.npy")),
                             rtol=0, atol=1e-5)
  # The policy is not the reference: the rewards are far from 0, so a reference mix-up shows.
  assert np.abs(np.asarray(rewards)).max() > 0.2
  assert abs(float(precomputed) - float(loss)) <= 1e-6
  assert abs(float(lm_gap)) <= 1e-6


def test_ipo_and_label_smoothing_formulas():
  logps = jnp.asarray([[-3.0, -5.0], [-4.0, -2.0]])
  ref = jnp.asarray([[-3.5, -4.0], [-4.0, -2.5]])
  lengths = jnp.asarray([[2.0, 4.0], [1.0, 3.0]])
  beta = 0.1
  ipo, _ = dpo.Dpo(beta=beta, loss_type="ipo").pair_losses(logps, ref, lengths)
  r = logps - ref
  want = (r[:, 0] / lengths[:, 0] - r[:, 1] / lengths[:, 1] - 1 / (2 * beta)) ** 2
  np.testing.assert_allclose(ipo, want, rtol=1e-6)
  smooth, _ = dpo.Dpo(beta=beta, label_smoothing=0.2).pair_losses(logps, ref, lengths)
  z = beta * (r[:, 0] - r[:, 1])
  want = -0.8 * jnp.log(jax.nn.sigmoid(z)) - 0.2 * jnp.log(jax.nn.sigmoid(-z))
  np.testing.assert_allclose(smooth, want, rtol=1e-6)


def test_the_reference_checkpoint_is_read_and_one_of_another_model_is_one_paragraph(tmp_path):
  import dataclasses  # pylint: disable=g-import-not-at-top
  from spmdtask.core import program as program_lib, sharding  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints, reference  # pylint: disable=g-import-not-at-top
  run = util.build_run("TinyLmDpo")
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0))

  def with_dir(job):
    return dataclasses.replace(run.task, objective=dataclasses.replace(
        run.task.objective, reference_checkpoint_dir=job))

  # A checkpoint of this model: its params (not the fresh init) are the reference.
  canonical = program.to_canonical(program.init())
  moved = jax.tree.map(lambda x: x + 0.5, canonical.params)
  ckpt = checkpoints.Checkpointer(str(tmp_path / "ref"), program, 1, None, {"config": ""})
  ckpt.save(0, program.from_canonical(canonical._replace(params=moved)), None)
  ckpt.close()
  got = reference.attach(with_dir(str(tmp_path / "ref")), program).reference
  util.assert_trees_equal(jax.device_get(sharding.unpad(got, program.layout.logical.params)),
                          jax.device_get(moved))
  # The same checkpoint as the reference of another model (2 layers, not 4): one paragraph.
  small = util.build_run("TinyLmDpo", ["task.model.num_layers=2"])
  small_program = program_lib.setup(small.task, small.datasets["train"].batch_at(0))
  with pytest.raises(ConfigError) as e:
    reference.attach(dataclasses.replace(small.task, objective=with_dir(
        str(tmp_path / "ref")).objective), small_program)
  msg = str(e.value)
  assert "\n" not in msg and "task.objective.reference_checkpoint_dir" in msg, msg
  assert "not a reference for this model" in msg and "differ" in msg, msg


def test_8_devices_with_microbatches_train_like_one_device():
  """TinyLmDpo 7 steps on one device vs on data 2 x fsdp 2 x model 2 with 2 microbatches
  (the strided split keeps each pair whole: a split pair would change every loss)."""
  want, want_params, _, _ = util.train_steps("TinyLmDpo", 7, jax.devices()[:1])
  losses, params, program, _ = util.train_steps("TinyLmDpoFsdpTp", 7,
                                                overrides=["task.train.num_microbatches=2"])
  assert program.mesh.size == 8
  assert want[-1] < want[0] - 0.15  # it learns (0.693 -> 0.505)
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  # Adam moves a weight whose gradient is ~0 (rounding noise) by up to lr = 1e-3 whatever
  # its size: a few such elements differ by ~1e-4; everything else to float32 rounding.
  util.assert_trees_close(params, want_params, atol=2.5e-4)


def test_token_logprobs_come_back_in_row_order_under_a_context_split():
  """TinyLmContext splits each row zig-zag over 4 'context' devices; the per-token
  log-probs (not only their sums) equal the unsplit model's, token for token, and so do
  `token_scores` (lm-eval's scorer): its log-probs, and its greedy flags, which are the
  unsplit logits' argmax == target."""
  from configs import lm  # pylint: disable=g-import-not-at-top
  split = util.build_run("lm.TinyLmContext").task.model
  plain = split.clone(activation_split_dims_mapping=util.build_run("lm.TinyLm").task.model
                      .activation_split_dims_mapping)
  batch = util.build_run("lm.TinyLm").datasets["train"].batch_at(0)
  batch = {k: v[:4] for k, v in batch.items()}
  params = plain.init(jax.random.key(0), batch, method=plain.loss)["params"]
  both = lambda m: jax.jit(lambda p, b: (m.apply({"params": p}, b, method=m.token_logprobs),
                                          m.apply({"params": p}, b, method=m.token_scores)))
  want, (want_lp, want_greedy) = both(plain)(params, batch)
  logits = plain.apply({"params": params}, batch["inputs"])
  np.testing.assert_array_equal(want_greedy, np.argmax(logits, -1) == batch["targets"])
  assert 0 < np.sum(want_greedy) < want_greedy.size  # (an untrained model: a few greedy)
  mesh = jax.make_mesh((2, 1, 4, 1), lm.CONTEXT_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 4, devices=jax.devices()[:8])
  with jax.set_mesh(mesh):
    got, (got_lp, got_greedy) = both(split)(params, batch)
  util.assert_close_f32(got, want, terms=64)
  util.assert_close_f32(got_lp, want_lp, terms=64)
  util.assert_close_f32(want_lp, want, terms=64)
  np.testing.assert_array_equal(got_greedy, want_greedy)
