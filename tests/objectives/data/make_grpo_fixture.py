"""Makes grpo_trl.json: TRL 1.16's GRPO loss on fixed log-probs, rewards and masks.

Run offline with the side venv (torch + trl); tests read only the JSON:
  /work/torchenv/bin/python tests/objectives/data/make_grpo_fixture.py

The loss is TRL's own `GRPOTrainer._compute_loss`, called on a stand-in trainer whose
`_get_per_token_logps_and_entropies` returns the fixed policy log-probs (no model). The
advantages follow TRL's `_generate_and_score_completions` (group mean, `trl.trainer.utils.nanstd`
(Bessel-corrected), + 1e-4), written out here because that method also samples.
"""
import collections
import json
import types

import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

B, G, T = 2, 4, 6          # prompts, generations per prompt, max completion length
N = B * G
gen = torch.Generator().manual_seed(0)
logp = -torch.rand(N, T, generator=gen, dtype=torch.float64) * 3
old = logp + 0.3 * torch.randn(N, T, generator=gen, dtype=torch.float64)
ref = logp + 0.2 * torch.randn(N, T, generator=gen, dtype=torch.float64)
lengths = torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])
mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 2.0, 0.25], dtype=torch.float64)


def advantages(scale: str) -> torch.Tensor:
  grouped = rewards.view(-1, G)
  mean = grouped.mean(1).repeat_interleave(G)
  std = (nanstd(grouped, dim=1).repeat_interleave(G) if scale == "group"
         else nanstd(rewards).expand_as(rewards) if scale == "batch" else None)
  adv = rewards - mean
  return adv if scale == "none" else adv / (std + 1e-4)


class _Accel:
  num_processes, sync_gradients = 1, True
  def reduce(self, x, reduction="sum"): return x
  def gather(self, x): return x
  def gather_for_metrics(self, x): return x


def trl_loss(loss_type, beta, eps_low, eps_high, adv, with_old):
  pol = logp.clone().float().requires_grad_(True)
  me = types.SimpleNamespace(
      top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
      beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), use_vllm=False,
      model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
      max_completion_length=T, accelerator=_Accel(), _entropy_bonus_enabled=False,
      aux_loss_enabled=False, _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
  me._get_per_token_logps_and_entropies = lambda *a, **k: (pol, torch.zeros_like(pol), None)
  inputs = {"prompt_ids": torch.zeros(N, 1, dtype=torch.long), "prompt_mask": torch.ones(N, 1),
            "completion_ids": torch.zeros(N, T, dtype=torch.long), "completion_mask": mask,
            "advantages": adv.float(), "num_items_in_batch": mask.sum(),
            "ref_per_token_logps": ref.float()}
  if with_old:
    inputs["old_per_token_logps"] = old.float()
  loss = GRPOTrainer._compute_loss(me, None, inputs)
  loss.backward()
  m = me._metrics["train"]
  return {"loss": loss.item(), "grad": pol.grad.tolist(),
          "kl": m["kl"][0] if m["kl"] else 0.0, "clip_ratio": m["clip_ratio/region_mean"][0]}


cases = []
for loss_type in ("grpo", "dr_grpo", "dapo"):
  for beta, scale, with_old in ((0.0, "group", False), (0.04, "group", True),
                                (0.1, "batch", True), (0.04, "none", True)):
    adv = advantages(scale)
    cases.append({"loss_type": loss_type, "beta": beta, "scale_rewards": scale,
                  "with_old": with_old, "epsilon_low": 0.2, "epsilon_high": 0.28,
                  "advantages": adv.tolist(),
                  **trl_loss(loss_type, beta, 0.2, 0.28, adv, with_old)})

with open(__file__.replace("make_grpo_fixture.py", "grpo_trl.json"), "w") as f:
  json.dump({"group_size": G, "max_completion_length": T, "logp": logp.float().tolist(),
             "old_logp": old.float().tolist(), "ref_logp": ref.float().tolist(),
             "mask": mask.tolist(), "rewards": rewards.tolist(), "cases": cases}, f)
print(len(cases), "cases")
