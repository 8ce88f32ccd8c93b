"""Direct Preference Optimization (`task.objective = Dpo(...)`): an `Objective`.

The batch holds pairs: every leaf is `[pairs, 2, t]` (index 0 the chosen completion, 1 the
rejected one; `inputs/preferences.py` reads them), so the microbatch split (rows m, m + M,
...) keeps a pair together; `weights` mark the completion's tokens (the targets). With a
precomputed reference the batch adds `ref_logps` [pairs, 2] float32.

Each sequence's score is its summed target log-probability (`ScoresTokens.token_logprobs`
times `weights`) under the policy and under the frozen reference; with
Δ = (logp_c - ref_c) - (logp_r - ref_r):
  sigmoid  -(1 - ε) log σ(βΔ) - ε log σ(-βΔ)  (ε = label_smoothing; 0: TRL's sigmoid)
  ipo      ((logp_c - ref_c) / n_c - (logp_r - ref_r) / n_r - 1 / (2β))²  (n: completion
           tokens; TRL's length-normalized IPO)
averaged over the global batch's pairs (the loss's weight is the pair count). Rewards are
β·(logp - ref) per completion; the metrics are their means (`rewards/chosen`,
`rewards/rejected`), the mean margin chosen - rejected and the accuracy (share of pairs whose
chosen reward is the larger), as TRL logs them.

An MoE's router losses are not added (`ScoresTokens` scores tokens alone): the router
trains from the DPO loss only.
"""
import dataclasses

import jax
import jax.numpy as jnp

from spmdtask.core import checks, train_state
from spmdtask.core.model import ScoresTokens, Weighted
from spmdtask.core.objective import TARGET_TOKENS, Reference
from spmdtask.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo")
REFERENCES = ("in_step", "precomputed")
MODEL_KEYS = ("inputs", "targets", "weights", "positions", "segment_ids")
REF_LOGPS = "ref_logps"  # [pairs, 2] float32: the reference's summed log-probs, precomputed
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


@dataclasses.dataclass
class Dpo:
  """DPO's fields.

  Attributes:
    beta: β, the strength of the implicit KL penalty to the reference (TRL's default 0.1).
    loss_type: 'sigmoid' (DPO) or 'ipo'.
    label_smoothing: ε of the sigmoid loss (conservative DPO), in [0, 0.5); 0 = off.
    reference: 'in_step' (the reference runs in every step: its params split like the
      policy's, never donated; with LoRA the policy with its adapters off) or
      'precomputed' (its log-probs are read from the data: tools/precompute_ref_logps.py
      writes them beside the pairs once).
    reference_checkpoint_dir: a job dir whose latest params are the reference; None = the
      policy's starting params (task.train.init_checkpoint_dir, else the fresh init).
      Resumes use the same reference. Not with LoRA (its reference is the base).
  """
  beta: float = 0.1
  loss_type: str = "sigmoid"
  label_smoothing: float = 0.0
  reference: str = "in_step"
  reference_checkpoint_dir: str | None = None

  # ------------------------------------------------------------------ the Objective contract

  def validate(self, task) -> None:
    """ConfigError naming the first field that cannot work with `task`."""
    checks.in_range("task.objective.beta", self.beta, 1e-12, float("inf"), "TRL's default: 0.1.")
    if self.loss_type not in LOSS_TYPES:
      raise ConfigError(f"task.objective.loss_type={self.loss_type!r} is not one of "
                        f"{LOSS_TYPES}: 'sigmoid' is DPO, 'ipo' the squared IPO loss.")
    if self.reference not in REFERENCES:
      raise ConfigError(f"task.objective.reference={self.reference!r} is not one of "
                        f"{REFERENCES}: 'in_step' runs the reference in every step, "
                        "'precomputed' reads its log-probs from the data.")
    if isinstance(self.label_smoothing, bool) or not isinstance(
        self.label_smoothing, (int, float)) or not 0 <= self.label_smoothing < 0.5:
      raise ConfigError(f"task.objective.label_smoothing={self.label_smoothing!r} must be a "
                        "number in [0, 0.5); 0 = off.")
    if task.pipeline is not None:
      raise ConfigError(
          "task.objective=Dpo runs under the scan only: the pipelines (task.pipeline="
          f"{type(task.pipeline).__name__}) compute the model's own LM loss. Set "
          "task.pipeline=None; shard the model with fsdp / model axes instead.")
    if not isinstance(task.model, ScoresTokens):
      raise ConfigError(f"task.objective=Dpo needs a model that scores tokens "
                        f"(token_logprobs); task.model is a {type(task.model).__name__}.")
    if self.reference_checkpoint_dir is not None and train_state.adapters_only(task.model):
      raise ConfigError(
          f"task.objective.reference_checkpoint_dir={self.reference_checkpoint_dir!r} with a "
          "LoRA model (task.model.lora): its reference is the base with the adapters off "
          "(task.train.init_checkpoint_dir). Leave reference_checkpoint_dir None, or train "
          "without LoRA.")

  def reference_kind(self, model) -> Reference:
    if self.reference == "precomputed":
      return Reference.PRECOMPUTED
    if train_state.adapters_only(model):
      return Reference.ADAPTERS_OFF
    return Reference.PARAMS

  def reference_dir(self) -> tuple[str, str | None]:
    """`run.reference.HasReferenceDir`."""
    return "task.objective.reference_checkpoint_dir", self.reference_checkpoint_dir

  def model_batch(self, batch) -> dict:
    """[pairs, 2, t] leaves -> [2·pairs, t] rows: chosen 0, rejected 0, chosen 1, ..."""
    return {k: v.reshape((-1,) + tuple(v.shape[2:])) for k, v in batch.items()
            if k in MODEL_KEYS}

  def loss(self, model, params, batch, rng, reference):
    rows = self.model_batch(batch)
    pairs = batch["inputs"].shape[0]
    weights = rows["weights"].astype(jnp.float32)
    rngs = None if rng is None else {"dropout": rng}
    logps = sequence_logps(model, params, rows, rngs).reshape(pairs, 2)
    if reference is None:
      if REF_LOGPS not in batch:
        raise ConfigError(
            "task.objective.reference='precomputed' but the batches hold no reference "
            f"log-probs ({REF_LOGPS}): give the input the objective (PreferenceInput's "
            "`objective` field, as TinyLmDpo does) and write them with "
            "tools/precompute_ref_logps.py, or set task.objective.reference='in_step'.")
      ref = batch[REF_LOGPS].astype(jnp.float32)
    else:
      ref = jax.lax.stop_gradient(sequence_logps(model, reference, rows).reshape(pairs, 2))
    lengths = jnp.sum(weights, axis=-1).reshape(pairs, 2)
    per_pair, rewards = self.pair_losses(logps, ref, lengths)
    valid = (jnp.sum(lengths, axis=-1) > 0).astype(jnp.float32)  # a padding pair: weight 0
    n = jnp.sum(valid)
    total = jnp.sum(per_pair * valid)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    values = (chosen, rejected, chosen - rejected, (chosen > rejected).astype(jnp.float32))
    metrics = {"loss": Weighted(total, n),
               **{k: Weighted(jnp.sum(v * valid), n) for k, v in zip(METRICS, values)},
               TARGET_TOKENS: Weighted(jnp.sum(lengths), jnp.sum(lengths))}
    return total / jnp.maximum(n, 1.0), metrics

  # ------------------------------------------------------------------ the math

  def pair_losses(self, logps, ref, lengths):
    """(per-pair loss [pairs], rewards [pairs, 2] without gradient) from summed log-probs
    [pairs, 2] (chosen, rejected) of the policy and the reference, and completion lengths."""
    ratios = logps - ref
    if self.loss_type == "ipo":
      avg = ratios / jnp.maximum(lengths, 1.0)
      per_pair = (avg[:, 0] - avg[:, 1] - 1 / (2 * self.beta)) ** 2
    else:
      z = self.beta * (ratios[:, 0] - ratios[:, 1])
      eps = self.label_smoothing
      per_pair = -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
    return per_pair, self.beta * jax.lax.stop_gradient(ratios)


def sequence_logps(model, params, rows, rngs=None) -> jax.Array:
  """Each row's summed target log-probability over its weighted tokens [rows] float32."""
  lp = model.apply({"params": params}, rows, method=model.token_logprobs, rngs=rngs)
  return jnp.sum(lp * rows["weights"].astype(jnp.float32), axis=-1)
