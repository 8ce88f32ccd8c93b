"""GRPO's math, pure jnp: group-normalized advantages and the clipped policy-gradient loss
with a k3 KL penalty, reduced per TRL's `loss_type`s (numbers as TRL 1.16's GRPOTrainer).

Per completion token t of sample i (mask m[i, t] = 1 on real completion tokens), log-probs
of the logits / the sampling temperature:
  log_w   = logp - old_logp                          (old_logp = logp, detached, when μ = 1)
            or, importance_sampling_level 'sequence' (GSPO), its masked mean over the sample
  ratio   = exp(log_w)
  pg      = -min(ratio · A_i, clip(ratio, 1 - eps_low, 1 + eps_high) · A_i)
  kl      = exp(ref - logp) - (ref - logp) - 1       (k3 estimator, >= 0), times the ratio
            with use_bias_correction_kl (DeepSeek-V3.2's unbiased reverse-KL gradient: the
            ratio is 1 on-policy but its gradient is not 0)
  loss_it = pg + beta · kl
Reductions, each as a `Weighted` (sum, weight) so microbatches accumulate exactly:
  grpo     mean over samples of each sample's token mean   sum_i mean_t(loss_i)   / #samples
  dr_grpo  sum over tokens / (#samples · max_completion_length)
  dapo     sum over tokens / #completion tokens of the global batch
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spmdtask.core.model import Weighted

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4   # TRL's: advantages / (std + 1e-4)


def advantages(rewards: jax.Array, group_size: int, scale_rewards: str = "group") -> jax.Array:
  """[N] rewards, N = prompts · group_size, a prompt's samples adjacent -> [N] advantages.

  A = r - mean(group); divided by std + 1e-4 where std is the group's ('group') or the
  batch's ('batch') Bessel-corrected standard deviation, or not at all ('none').
  """
  r = rewards.astype(jnp.float32)
  grouped = r.reshape(-1, group_size)
  adv = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
  if scale_rewards == "none":
    return adv
  std = (jnp.repeat(jnp.std(grouped, axis=1, ddof=1), group_size) if scale_rewards == "group"
         else jnp.std(r, ddof=1))
  return adv / (std + STD_EPS)


class TokenTerms(NamedTuple):
  """Per-token [n, t] pieces of the loss (before the mask)."""
  loss: jax.Array      # pg + beta · kl
  kl: jax.Array
  clipped: jax.Array   # 1.0 where the clip took effect; [n, 1] at the sequence level


def token_terms(logp: jax.Array, old_logp: jax.Array | None, ref_logp: jax.Array | None,
                adv: jax.Array, mask: jax.Array, beta: float, epsilon_low: float,
                epsilon_high: float, importance_sampling_level: str = "token",
                use_bias_correction_kl: bool = True) -> TokenTerms:
  """The per-token loss of samples [n, t] with advantages [n]; `old_logp` None: the current
  policy, detached (μ = 1); `ref_logp` None only with beta = 0."""
  old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
  log_w = logp - old
  if importance_sampling_level == "sequence":
    mask = mask.astype(jnp.float32)
    log_w = (log_w * mask).sum(-1, keepdims=True) / jnp.maximum(
        mask.sum(-1, keepdims=True), 1.0)
  ratio = jnp.exp(log_w)
  a = adv[:, None]
  pg = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * a)
  clipped = ((ratio < 1 - epsilon_low) & (a < 0)) | ((ratio > 1 + epsilon_high) & (a > 0))
  if beta:
    d = ref_logp - logp
    kl = jnp.exp(d) - d - 1
    kl = kl * ratio if use_bias_correction_kl else kl
  else:
    kl = jnp.zeros_like(logp)
  return TokenTerms(pg + beta * kl, kl, clipped.astype(jnp.float32))


def reduce(per_token: jax.Array, mask: jax.Array, loss_type: str,
           max_completion_length: int) -> Weighted:
  """The loss of samples [n, t] as (sum, weight) per `loss_type` (sum / weight = TRL's loss
  on this batch; summing both over microbatches gives the whole batch's)."""
  mask = mask.astype(jnp.float32)
  masked = per_token * mask
  n = jnp.asarray(per_token.shape[0], jnp.float32)
  if loss_type == "grpo":
    rows = masked.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
    return Weighted(rows.sum(), n)
  if loss_type == "dr_grpo":
    return Weighted(masked.sum(), n * max_completion_length)
  if loss_type == "dapo":
    return Weighted(masked.sum(), mask.sum())
  raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")


def masked_mean(x: jax.Array, mask: jax.Array) -> Weighted:
  """A per-token metric averaged over completion tokens."""
  mask = mask.astype(jnp.float32)
  return Weighted((x * mask).sum(), mask.sum())


def clip_ratio(clipped: jax.Array, mask: jax.Array, importance_sampling_level: str) -> Weighted:
  """The share of clipped tokens, or at the sequence level of clipped samples (TRL's)."""
  if importance_sampling_level == "sequence":
    return Weighted(clipped.sum(), jnp.asarray(clipped.shape[0], jnp.float32))
  return masked_mean(clipped, mask)
