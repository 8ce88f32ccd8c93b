"""GRPO's loss, metrics and gradients against TRL 1.16's GRPOTrainer at its defaults, on a
tiny random HF Llama policy, sampling policy and reference (fixture: data/grpo/, made by
data/make_grpo_fixture.py): temperature 0.7 / 1.0, beta 0 / 0.04, grpo / dr_grpo / dapo /
GSPO, with and without old log-probs. Each log-prob is spmdtask's own (`Grpo.token_logprobs`,
the loss's and the rollout's), of the HF weights converted by spmdtask.hf."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.hf import convert, files, llama, model_overrides
from spmdtask.objectives import grpo, grpo_loss
from tests import util

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "grpo")
with open(os.path.join(DATA, "trl.json")) as _f:
  FIXTURE = json.load(_f)
GRADS = np.load(os.path.join(DATA, "trl_grads.npy"))
CASES = list(enumerate(FIXTURE["cases"]))
BETAS, WITH_OLD = (0.0, 0.04), (False, True)


def _name(case) -> str:
  kind = "gspo" if case["importance_sampling_level"] == "sequence" else case["loss_type"]
  return (f"T{case['temperature']}-b{case['beta']}-{kind}-"
          f"{'old' if case['with_old'] else 'onpolicy'}")


@functools.cache
def _models():
  """(model, {policy, old, reference: params}, HF config) converted by spmdtask.hf."""
  params = {}
  for name in ("policy", "old", "reference"):
    cfg, tensors = files.read_hf(os.path.join(DATA, name))
    params[name] = convert.to_params(cfg, tensors)
  model = util.build_run(llama.FAMILY.experiment, model_overrides.overrides(cfg)).task.model
  return model, params, cfg


def _rows() -> dict:
  """The fixture's prompts + completions as LM rows: targets the next token, weights 1 on
  the completion's real tokens."""
  f = FIXTURE
  tokens = np.concatenate([f["prompt_ids"], f["completion_ids"]], 1).astype(np.int32)
  pad = np.zeros((len(tokens), f["prompt_len"] - 1), np.float32)
  weights = np.concatenate([pad, np.asarray(f["completion_mask"], np.float32)], 1)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def _objective(temperature, beta, loss_type, level, **fields) -> grpo.Grpo:
  """A Grpo at its defaults but for the grid's fields (TRL's: GRPOConfig's defaults)."""
  return grpo.Grpo(temperature=temperature, beta=beta, loss_type=loss_type,
                   importance_sampling_level=level, num_generations=FIXTURE["group_size"],
                   max_new_tokens=FIXTURE["max_completion_length"], **fields)


@functools.cache
def _program():
  """Jitted (params, temperature, cotangent [n, t]) -> (the rows' target log-probs [n, t],
  the params' gradient of <cotangent, log-probs>), compiled once: `Grpo.loss` is
  `loss_of_logprobs` of the model's log-probs, so the grid's points differ only in that
  small function, and its gradient chains through this one pullback
  (test_the_loss_is_loss_of_logprobs_of_the_models_logprobs checks the whole). The logits
  untiled, where a traced temperature divides them (the whole's check runs the import's
  vocab tiles, where the temperature divides the head's scale)."""
  model = _models()[0].clone(loss_vocab_tiles=1)
  rows = _rows()

  def scored(p, t, ct):
    logp, pullback = jax.vjp(
        lambda q: model.apply({"params": q}, rows, t, method=model.token_logprobs), p)
    return logp, pullback(ct)[0]
  return jax.jit(scored)


@functools.cache
def _scored(temperature: float):
  """The policy's, the sampling policy's and the reference's log-probs [n, t] at
  `temperature`."""
  _, params, _ = _models()
  zero = jnp.zeros(_rows()["targets"].shape, jnp.float32)
  return tuple(np.asarray(_program()(params[k], temperature, zero)[0])
               for k in ("policy", "old", "reference"))


def _ours(case) -> tuple:
  """(loss, kl, clip ratio, the policy params' gradient, the policy's log-probs) of the
  fixture's case by `Grpo.loss_of_logprobs` on spmdtask's log-probs."""
  obj = _objective(case["temperature"], case["beta"], case["loss_type"],
                   case["importance_sampling_level"],
                   use_bias_correction_kl=case["use_bias_correction_kl"])
  logp, old, ref = _scored(case["temperature"])
  batch = {**_rows(), grpo.ADVANTAGES: grpo_loss.advantages(
      jnp.asarray(FIXTURE["rewards"]), FIXTURE["group_size"], obj.scale_rewards)}
  if case["with_old"]:  # the sampling policy's, as the rollout scores them
    batch[grpo.OLD_LOGP] = jnp.asarray(old)
  ref = jnp.asarray(ref) if case["beta"] else None
  (_, metrics), ct = jax.value_and_grad(obj.loss_of_logprobs, has_aux=True)(
      jnp.asarray(logp), ref, batch)
  ratio = lambda w: float(w.sum / w.weight)
  return (ratio(metrics["loss"]), ratio(metrics["kl"]) if case["beta"] else 0.0,
          ratio(metrics["clip_ratio"]),
          jax.device_get(_program()(_models()[1]["policy"], case["temperature"], ct)[1]), logp)


def _largest_error(grad, want) -> tuple[float, float]:
  """(the largest |ours - TRL's| over all the weights' gradients, TRL's largest |component|)."""
  largest = max(float(np.abs(w).max()) for w in jax.tree.leaves(want))
  worst = max(float(np.abs(g - w).max()) for g, w in zip(jax.tree.leaves(grad),
                                                           jax.tree.leaves(want)))
  return worst, largest


def _trl_grads(i: int) -> dict:
  """Case i's gradient of the policy's weights, in spmdtask's layout (convert.to_params:
  transposes and reshapes, linear)."""
  flat, at = {}, 0
  for name, shape in zip(FIXTURE["grad_names"], FIXTURE["grad_shapes"]):
    size = int(np.prod(shape))
    flat[name] = GRADS[i, at:at + size].reshape(shape)
    at += size
  return convert.to_params(_models()[2], flat)


@pytest.mark.parametrize("i,case", CASES, ids=[_name(c) for _, c in CASES])
def test_loss_metrics_and_gradients_equal_trl(i, case):
  obj = _objective(case["temperature"], case["beta"], case["loss_type"],
                   case["importance_sampling_level"])
  # The fixture's trainer ran at TRL's defaults, which are Grpo's.
  assert (obj.epsilon_low, obj.epsilon_high, obj.use_bias_correction_kl, obj.scale_rewards) == (
      case["epsilon_low"], case["epsilon_high"], case["use_bias_correction_kl"],
      case["scale_rewards"])
  loss, kl, clip, grad, logp = _ours(case)
  p = FIXTURE["prompt_len"] - 1
  mask = np.asarray(FIXTURE["completion_mask"]) > 0
  np.testing.assert_allclose(logp[:, p:][mask], np.asarray(case["logp"])[mask], atol=1e-5)
  assert abs(loss - case["loss"]) <= 1e-5, (loss, case["loss"])
  assert abs(kl - case["kl"]) <= 1e-5, (kl, case["kl"])
  assert abs(clip - case["clip_ratio"]) <= 1e-6, (clip, case["clip_ratio"])
  worst, largest = _largest_error(grad, _trl_grads(i))
  assert largest > 1e-3 and worst <= 1e-5 * largest, (worst, largest)


def test_the_loss_is_loss_of_logprobs_of_the_models_logprobs():
  """`Grpo.loss` on the params (what the train step differentiates) equals the chained
  path the grid uses: loss and gradient, one case with every term (old, reference, 0.7)."""
  i, case = next((i, c) for i, c in CASES if c["temperature"] == 0.7 and c["beta"]
                 and c["with_old"] and c["loss_type"] == "dapo")
  model, params, _ = _models()
  obj = _objective(0.7, case["beta"], "dapo", "token")
  _, old, _ = _scored(0.7)
  batch = {**_rows(), grpo.OLD_LOGP: jnp.asarray(old), grpo.ADVANTAGES: grpo_loss.advantages(
      jnp.asarray(FIXTURE["rewards"]), FIXTURE["group_size"])}
  (loss, _), grad = jax.jit(jax.value_and_grad(
      lambda p: obj.loss(model, p, batch, None, params["reference"]), has_aux=True))(
          params["policy"])
  assert abs(float(loss) - case["loss"]) <= 1e-5
  worst, largest = _largest_error(grad, _trl_grads(i))
  assert worst <= 1e-5 * largest, (worst, largest)


@pytest.mark.parametrize("temperature", (0.7, 1.0))
def test_old_and_reference_logprobs_equal_trl(temperature):
  """The sampling policy's and the reference's log-probs at the sampling temperature."""
  p = FIXTURE["prompt_len"] - 1
  mask = np.asarray(FIXTURE["completion_mask"]) > 0
  _, old, ref = _scored(temperature)
  for name, got in (("old", old), ("reference", ref)):
    want = np.asarray(FIXTURE["scored"][str(temperature)][name])
    np.testing.assert_allclose(got[:, p:][mask], want[mask], atol=1e-5, err_msg=name)


def test_advantages_equal_trl():
  for scale, want in FIXTURE["advantages"].items():
    got = grpo_loss.advantages(jnp.asarray(FIXTURE["rewards"]), FIXTURE["group_size"], scale)
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=scale)


def test_the_temperature_and_the_bias_correction_change_the_numbers():
  """What the grid checks is not vacuous: TRL's loss at 0.7 differs from at 1.0, and the
  bias correction changes the gradient on-policy (ratio 1, its gradient not 0)."""
  by = {(c["temperature"], c["beta"], c["loss_type"], c["importance_sampling_level"],
         c["with_old"]): (i, c) for i, c in CASES}
  assert abs(by[(0.7, 0.04, "dapo", "token", True)][1]["loss"]
             - by[(1.0, 0.04, "dapo", "token", True)][1]["loss"]) > 1e-2
  i, case = by[(1.0, 0.04, "dapo", "token", False)]
  grad = _ours({**case, "use_bias_correction_kl": False})[3]
  worst, largest = _largest_error(grad, _trl_grads(i))
  assert worst > 1e-3 * largest, (worst, largest)


def test_microbatches_sum_to_the_batch():
  """Summing (sum, weight) over two halves gives the whole batch's loss, each loss_type and
  level."""
  g = np.random.default_rng(0)
  logp = jnp.asarray(-g.uniform(0, 3, (8, 6)), jnp.float32)
  old = logp + jnp.asarray(0.3 * g.normal(size=(8, 6)), jnp.float32)
  ref = logp + jnp.asarray(0.2 * g.normal(size=(8, 6)), jnp.float32)
  mask = jnp.asarray(np.arange(6)[None, :] < np.array([6, 3, 1, 5, 6, 2, 4, 6])[:, None])
  adv = grpo_loss.advantages(jnp.asarray(g.uniform(size=8)), 4)

  @jax.jit
  def wholes_and_parts():
    out = {}
    for level in grpo_loss.IMPORTANCE_SAMPLING_LEVELS:
      terms = grpo_loss.token_terms(logp, old, ref, adv, mask, 0.04, 0.2, 0.2, level)
      for lt in grpo_loss.LOSS_TYPES:
        whole = grpo_loss.reduce(terms.loss, mask, lt, 6)
        parts = [grpo_loss.reduce(terms.loss[s], mask[s], lt, 6)
                 for s in (slice(0, 3), slice(3, 8))]
        out[f"{level} {lt}"] = (sum(p.sum for p in parts) / sum(p.weight for p in parts),
                                whole.sum / whole.weight)
    return out

  for name, (parts, whole) in wholes_and_parts().items():
    np.testing.assert_allclose(parts, whole, rtol=1e-6, atol=1e-7, err_msg=name)

