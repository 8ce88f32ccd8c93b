"""Group Relative Policy Optimization (`task.objective = Grpo(...)`): an `Objective`.

Each step's batch is made by the rollout loop (`spmdtask.run.rollout`), not read: B prompts,
G sampled completions each (rows p·G .. p·G+G-1 are prompt p's group), as LM rows
`inputs`, `targets`, `weights` [B·G, t] (weights 1 on the completion's tokens), with
`advantages` [B·G] (group-normalized rewards, `grpo_loss.advantages`) and, with μ > 1,
`old_logp` [B·G, t] (the sampling policy's log-probs, one forward before the μ updates;
with `overlap_sampling`, the sampler's own, from params one update older than the step's).
The loss is `grpo_loss`'s (TRL's math); every log-prob (the policy's, the sampling
policy's, the reference's) is of the logits / the sampling `temperature`, as TRL's. The KL
term's reference log-probs come from the reference model in the step (its params, or with
LoRA the policy with its adapters off), recomputed at each of the μ updates. With beta = 0
no reference runs.

Metrics: `kl` (mean k3 over completion tokens, times the ratio with the bias correction, as
TRL logs it), `clip_ratio` (share of tokens clipped; of samples at the sequence level);
the rollout loop adds the rewards, lengths and timings. An MoE's router losses are not
added (`ScoresTokens` scores tokens alone).
"""
import dataclasses

import jax
import jax.numpy as jnp

from spmdtask.core import checks, train_state
from spmdtask.core.model import ScoresTokens, Weighted
from spmdtask.core.objective import TARGET_TOKENS, Reference
from spmdtask.errors import ConfigError
from spmdtask.objectives import grpo_loss, rewards, user_rewards

MODEL_KEYS = ("inputs", "targets", "weights")
ADVANTAGES, OLD_LOGP = "advantages", "old_logp"


@dataclasses.dataclass
class Grpo:
  """GRPO's fields (names and defaults as TRL's GRPOConfig where it has them).

  Attributes:
    rewards: registered reward names (`spmdtask.objectives.rewards`) or functions of your
      own files, `PATH.py:FN` (`spmdtask.objectives.user_rewards`; --reward sets both
      fields), summed with their weights.
    reward_weights: one weight per reward (TRL's reward_weights); None = all 1.
    num_generations: G, completions sampled per prompt (>= 2: advantages compare a group).
    max_new_tokens: the longest completion (TRL's max_completion_length, its default 512);
      prompt length + max_new_tokens must fit task.model.max_seq_len.
    temperature, top_p, top_k: sampling (top_k 0 = off); temperature 0 = greedy. The loss
      scores log-probs of the logits / temperature (at 0: the logits as they are).
    eos_id: the token that ends a completion (included in it), or a tuple of them (the first
      of any ends it); None = the train input's stop ids (a prompts data dir's eos and chat
      end-of-turn; none: run to max_new_tokens).
    seed: the sampling seed (a sample's draws depend on it, its id and position only).
    sampler_slots: the sampler's decode slots (KV-cache rows); 0 = one per sample of the
      step (all at once). Fewer slots hold less cache and refill a finished sample's slot
      with the next waiting sample (`spmdtask.run.sampling`); a multiple of the data shards.
    sampler_kv_pages: 0 = each slot holds a KV row of prompt + max_new_tokens positions;
      > 0: the prompts' KV is shared (read, not copied) and the completions' lies in a pool
      of this many pages of `sampler_page_size` tokens, a slot taking one as its sample
      grows into it; where the pool is full a sample waits or is preempted and re-run (the
      same samples: `spmdtask.run.pages`). A multiple of the sampler's loops (a loop per
      data shard, or one), each loop's pool at least one sample at max_new_tokens; held
      where no automatic mesh axis splits the cache's rows.
    sampler_page_size: tokens of a KV page (with sampler_kv_pages).
    beta: the KL penalty's weight (k3 estimator); 0 = no reference model.
    epsilon_low, epsilon_high: the ratio's clip range [1 - low, 1 + high] (TRL's epsilon,
      epsilon_high).
    loss_type: 'grpo', 'dr_grpo' or 'dapo' (TRL's token normalizations).
    importance_sampling_level: 'token' (a ratio per token) or 'sequence' (one per sample,
      the masked mean of its tokens' log-ratios: GSPO).
    use_bias_correction_kl: the KL term times the ratio (TRL's default; DeepSeek-V3.2).
    scale_rewards: 'group', 'batch' or 'none': what the advantages are divided by.
    num_iterations: μ, optimizer updates on each batch of samples.
    reference_checkpoint_dir: a job dir whose latest params are the KL reference; None =
      the policy's starting params. Not with LoRA (its reference is the base).
    overlap_sampling: sample the next batch while this one trains (one step off-policy):
      its sampler runs on the params before this batch's last update, and the host's work
      on it (decoding, rewards) overlaps that update on the devices. The ratio is then
      taken against the sampler's log-probs (old_logp: the policy that sampled), so its
      clip bounds each update's distance from it, at any μ. Off (on-policy) by default.
  """
  rewards: tuple[str, ...] = ("final_answer",)
  reward_weights: tuple[float, ...] | None = None
  num_generations: int = 8
  max_new_tokens: int = 512
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  eos_id: int | tuple[int, ...] | None = None
  seed: int = 0
  sampler_slots: int = 0
  sampler_kv_pages: int = 0
  sampler_page_size: int = 32
  beta: float = 0.0
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  loss_type: str = "dapo"
  importance_sampling_level: str = "token"
  use_bias_correction_kl: bool = True
  scale_rewards: str = "group"
  num_iterations: int = 1
  reference_checkpoint_dir: str | None = None
  overlap_sampling: bool = False

  # ------------------------------------------------------------------ the Objective contract

  def validate(self, task) -> None:
    """ConfigError naming the first field that cannot work with `task`."""
    rewards.lookup(self.rewards)
    rewards.check_weights(self.rewards, self.reward_weights)
    n = self.num_generations
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
      raise ConfigError(
          f"task.objective.num_generations={n!r}: GRPO compares each completion with the "
          "others of its prompt's group, so a group needs at least 2 (TRL's default is 8). "
          "Set num_generations >= 2.")
    checks.stop_ids("task.objective.eos_id", self.eos_id)
    checks.positive("task.objective", max_new_tokens=self.max_new_tokens,
                    num_iterations=self.num_iterations)
    checks.in_range("task.objective.temperature", self.temperature, 0.0, float("inf"),
                    "0 = greedy.")
    checks.in_range("task.objective.top_p", self.top_p, 1e-9, 1.0, "1.0 = off.")
    checks.in_range("task.objective.top_k", self.top_k, 0, float("inf"), "0 = off.")
    checks.in_range("task.objective.sampler_slots", self.sampler_slots, 0, float("inf"),
                    "0 = one slot per sample.")
    checks.in_range("task.objective.sampler_kv_pages", self.sampler_kv_pages, 0, float("inf"),
                    "0 = unpaged (a KV row a slot).")
    checks.positive("task.objective", sampler_page_size=self.sampler_page_size)
    checks.in_range("task.objective.beta", self.beta, 0.0, float("inf"), "0 = no KL term.")
    for name in ("epsilon_low", "epsilon_high"):
      checks.in_range(f"task.objective.{name}", getattr(self, name), 0.0, float("inf"),
                      "TRL's default: 0.2.")
    if self.loss_type not in grpo_loss.LOSS_TYPES:
      raise ConfigError(f"task.objective.loss_type={self.loss_type!r} is not one of "
                        f"{grpo_loss.LOSS_TYPES} (TRL's token normalizations).")
    if self.importance_sampling_level not in grpo_loss.IMPORTANCE_SAMPLING_LEVELS:
      raise ConfigError(
          f"task.objective.importance_sampling_level={self.importance_sampling_level!r} is not "
          f"one of {grpo_loss.IMPORTANCE_SAMPLING_LEVELS} (a ratio per token, or one per "
          "sample: GSPO).")
    if not isinstance(self.use_bias_correction_kl, bool):
      raise ConfigError(
          f"task.objective.use_bias_correction_kl={self.use_bias_correction_kl!r} is not a bool. "
          "Set True (TRL's default: the KL term times the importance ratio) or False.")
    if not isinstance(self.overlap_sampling, bool):
      raise ConfigError(
          f"task.objective.overlap_sampling={self.overlap_sampling!r} is not a bool. Set True "
          "(sample the next batch while this one trains, one step off-policy) or False.")
    if self.scale_rewards not in grpo_loss.SCALE_REWARDS:
      raise ConfigError(f"task.objective.scale_rewards={self.scale_rewards!r} is not one of "
                        f"{grpo_loss.SCALE_REWARDS}.")
    if task.pipeline is not None:
      raise ConfigError(
          "task.objective=Grpo runs under the scan only: sampling decodes the unpipelined "
          f"stack and the pipelines (task.pipeline={type(task.pipeline).__name__}) compute the "
          "model's own LM loss. Set task.pipeline=None.")
    if not isinstance(task.model, ScoresTokens):
      raise ConfigError(f"task.objective=Grpo needs a model that scores tokens "
                        f"(token_logprobs); task.model is a {type(task.model).__name__}.")
    if self.reference_checkpoint_dir is not None and train_state.adapters_only(task.model):
      raise ConfigError(
          f"task.objective.reference_checkpoint_dir={self.reference_checkpoint_dir!r} with a "
          "LoRA model: its reference is the base with the adapters off. Leave it None.")

  def check_room(self, prompt_len: int, max_seq_len: int, field: str) -> None:
    """ConfigError when the longest prompt leaves no room for max_new_tokens."""
    if prompt_len + self.max_new_tokens > max_seq_len:
      raise ConfigError(
          f"The longest prompt of {field} is {prompt_len} tokens; with "
          f"task.objective.max_new_tokens={self.max_new_tokens} a sample needs "
          f"{prompt_len + self.max_new_tokens} tokens, more than the KV cache holds "
          f"(task.model.max_seq_len={max_seq_len}). Lower max_new_tokens to at most "
          f"{max_seq_len - prompt_len}, shorten the prompts, or raise max_seq_len.")

  def score(self, prompts, completions, answers) -> tuple[list[float], dict[str, float]]:
    """(each sample's weighted reward sum, each reward's mean by name): the rollout's."""
    return rewards.combine(self.rewards, self.reward_weights, prompts, completions, answers)

  def reward_files(self) -> dict[str, str]:
    """{'PATH.py:FN': the file's sha256} of the rewards read from the user's files."""
    return {n: user_rewards.fingerprint(user_rewards.split_spec(n)[0])
            for n in self.rewards if user_rewards.is_file_spec(n)}

  def advantages(self, all_rewards: jax.Array) -> jax.Array:
    """The global batch's rewards [B·G] -> group-normalized advantages [B·G]."""
    return grpo_loss.advantages(all_rewards, self.num_generations, self.scale_rewards)

  def reference_kind(self, model) -> Reference:
    if not self.beta:
      return Reference.NONE
    return Reference.ADAPTERS_OFF if train_state.adapters_only(model) else Reference.PARAMS

  def reference_dir(self) -> tuple[str, str | None]:
    """`run.reference.HasReferenceDir`."""
    return "task.objective.reference_checkpoint_dir", self.reference_checkpoint_dir

  def model_batch(self, batch) -> dict:
    return {k: v for k, v in batch.items() if k in MODEL_KEYS}

  def score_temperature(self) -> float:
    """What log-probs divide the logits by: the sampling temperature (greedy's 0: 1)."""
    return self.temperature or 1.0

  def token_logprobs(self, model, params, rows, rngs=None) -> jax.Array:
    """[n, t] log-probs of `rows`' targets as the loss scores them (at the sampling
    temperature): the policy's, the reference's, and the rollout's of the sampling policy."""
    return model.apply({"params": params}, rows, self.score_temperature(),
                       method=model.token_logprobs, rngs=rngs)

  def loss(self, model, params, batch, rng, reference):
    rows = self.model_batch(batch)
    rngs = None if rng is None else {"dropout": rng}
    logp = self.token_logprobs(model, params, rows, rngs)
    ref = None
    if reference is not None:
      ref = jax.lax.stop_gradient(self.token_logprobs(model, reference, rows))
    return self.loss_of_logprobs(logp, ref, batch)

  def loss_of_logprobs(self, logp: jax.Array, ref: jax.Array | None, batch) -> tuple:
    """`loss`'s (loss, metrics) from the policy's token log-probs [n, t] (and the
    reference's, None with beta = 0) of `batch`'s rows."""
    mask = batch["weights"].astype(jnp.float32)
    terms = grpo_loss.token_terms(logp, batch.get(OLD_LOGP), ref, batch[ADVANTAGES], mask,
                                  self.beta, self.epsilon_low, self.epsilon_high,
                                  self.importance_sampling_level, self.use_bias_correction_kl)
    total = grpo_loss.reduce(terms.loss, mask, self.loss_type, self.max_new_tokens)
    tokens = jnp.sum(mask)
    clip = grpo_loss.clip_ratio(terms.clipped, mask, self.importance_sampling_level)
    metrics = {"loss": total, "clip_ratio": clip,
               TARGET_TOKENS: Weighted(tokens, tokens)}
    if self.beta:
      metrics["kl"] = grpo_loss.masked_mean(terms.kl, mask)
    return total.sum / jnp.maximum(total.weight, 1e-9), metrics
