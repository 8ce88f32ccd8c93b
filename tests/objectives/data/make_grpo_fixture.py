"""Makes grpo/: TRL 1.16's GRPO loss, metrics and gradients on a tiny random HF Llama.

Run offline with the side venv (torch + transformers + trl); tests read only what it writes:
  /work/torchenv/bin/python tests/objectives/data/make_grpo_fixture.py

Three tiny LlamaForCausalLM checkpoints (1 layer, d_model 8, 2 heads of 4 / 1 KV head,
SwiGLU 16, vocab 16, float32): `policy/`, `old/` (the sampling policy of the μ updates) and
`reference/` (the KL's), the last two the policy plus noise. 2 prompts x 4 completions of
fixed tokens; the log-probs are TRL's own: `add_fused_lm_head(model, temperature=T)` (the
logits / T, as GRPOTrainer patches its models) and `GRPOTrainer._get_per_token_logps_and_
entropies` for the old and reference log-probs (as `_generate_and_score_completions`
computes them) and, inside `GRPOTrainer._compute_loss`, the policy's; the loss is called on
a stand-in trainer whose fields are a default `GRPOConfig`'s but for the grid's: temperature
0.7 / 1.0, beta 0 / 0.04, loss_type grpo / dr_grpo / dapo and GSPO (loss_type 'grpo' with
importance_sampling_level 'sequence', TRL's recipe), with and without old log-probs.
The advantages follow `_generate_and_score_completions` (group mean, `nanstd` + 1e-4),
written out here because that method also samples.

Writes grpo/trl.json (inputs, each case's loss, kl, clip ratio, the log-probs) and
grpo/trl_grads.npy [cases, params] (each case's gradient of the policy's weights, float32,
flattened in `grad_names` order).
"""
import collections
import json
import os
import types

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, nanstd

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo")
B, G, P, T = 2, 4, 3, 5     # prompts, generations per prompt, prompt and completion length
N = B * G
CONFIG = LlamaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, intermediate_size=16,
                     max_position_embeddings=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                     torch_dtype="float32")
NOISE = {"old": 0.03, "reference": 0.03}

gen = torch.Generator().manual_seed(0)
prompt_ids = torch.randint(0, 16, (N, P), generator=gen)
completion_ids = torch.randint(0, 16, (N, T), generator=gen)
lengths = torch.tensor([5, 3, 1, 4, 5, 2, 4, 5])
completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 2.0, 0.25])


def checkpoints() -> dict[str, dict[str, torch.Tensor]]:
  torch.manual_seed(0)
  policy = LlamaForCausalLM(CONFIG)
  with torch.no_grad():  # init leaves norms at 1 and weights tiny: random scales instead
    for p in policy.parameters():
      p.normal_(0, 0.5 if p.ndim > 1 else 0.2).add_(1.0 if p.ndim == 1 else 0.0)
  state = {k: v.clone() for k, v in policy.state_dict().items()}
  out = {"policy": state}
  g = torch.Generator().manual_seed(1)
  for name, scale in NOISE.items():
    out[name] = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}
  return out


def model(state: dict, temperature: float) -> LlamaForCausalLM:
  m = LlamaForCausalLM(CONFIG)
  m.load_state_dict(state)
  add_fused_lm_head(m, temperature=temperature, outputs=("log_probs", "entropy"))
  return m.train()


def advantages(scale: str) -> torch.Tensor:
  grouped = rewards.view(-1, G)
  mean = grouped.mean(1).repeat_interleave(G)
  std = (nanstd(grouped, dim=1).repeat_interleave(G) if scale == "group"
         else nanstd(rewards).expand_as(rewards) if scale == "batch" else None)
  adv = rewards - mean
  return adv if scale == "none" else adv / (std + 1e-4)


class _Accel:
  num_processes, sync_gradients, is_main_process = 1, True, True
  def reduce(self, x, reduction="sum"): return x
  def gather(self, x): return x
  def gather_for_metrics(self, x): return x
  def autocast(self): return torch.autocast("cpu", enabled=False)


def trainer(args: GRPOConfig):
  """A stand-in GRPOTrainer with the fields its __init__ sets from `args`."""
  me = types.SimpleNamespace(
      args=args, beta=args.beta, loss_type=args.loss_type, temperature=args.temperature,
      importance_sampling_level=args.importance_sampling_level,
      epsilon_low=args.epsilon, epsilon_high=args.epsilon_high or args.epsilon,
      top_entropy_quantile=args.top_entropy_quantile,
      off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=args.use_vllm,
      max_completion_length=T, current_gradient_accumulation_steps=1, accelerator=_Accel(),
      _entropy_bonus_enabled=False, aux_loss_enabled=False,
      model=types.SimpleNamespace(training=True),
      _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
  me._get_per_token_logps_and_entropies = types.MethodType(
      GRPOTrainer._get_per_token_logps_and_entropies, me)
  return me


def logps(me, m) -> torch.Tensor:
  with torch.no_grad():
    return me._get_per_token_logps_and_entropies(
        m, torch.cat([prompt_ids, completion_ids], 1),
        torch.cat([torch.ones(N, P, dtype=torch.long), completion_mask], 1), T)[0]


def case(states, temperature, beta, loss_type, level, with_old):
  args = GRPOConfig(output_dir="/tmp/grpo_fixture", use_cpu=True, bf16=False, report_to=[],
                    temperature=temperature, beta=beta, loss_type=loss_type,
                    importance_sampling_level=level, max_completion_length=T,
                    num_generations=G)
  me = trainer(args)
  policy = model(states["policy"], temperature)
  inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones(N, P, dtype=torch.long),
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": advantages(args.scale_rewards),
            "num_items_in_batch": completion_mask.sum()}
  if beta:
    inputs["ref_per_token_logps"] = logps(me, model(states["reference"], temperature))
  if with_old:
    inputs["old_per_token_logps"] = logps(me, model(states["old"], temperature))
  loss = GRPOTrainer._compute_loss(me, policy, inputs)
  loss.backward()
  m = me._metrics["train"]
  grads = {k: p.grad.detach().clone() for k, p in policy.named_parameters()}
  return {"temperature": temperature, "beta": beta, "loss_type": loss_type,
          "importance_sampling_level": level, "with_old": with_old,
          "epsilon_low": me.epsilon_low, "epsilon_high": me.epsilon_high,
          "use_bias_correction_kl": args.use_bias_correction_kl,
          "scale_rewards": args.scale_rewards, "loss": loss.item(),
          "kl": m["kl"][0] if m["kl"] else 0.0, "clip_ratio": m["clip_ratio/region_mean"][0],
          "logp": logps(me, policy).tolist()}, grads


def main():
  states = checkpoints()
  for name, state in states.items():
    m = LlamaForCausalLM(CONFIG)
    m.load_state_dict(state)
    m.save_pretrained(os.path.join(OUT, name))
    gen_cfg = os.path.join(OUT, name, "generation_config.json")
    if os.path.exists(gen_cfg):
      os.remove(gen_cfg)
  cases, grads, names = [], [], None
  for temperature in (0.7, 1.0):
    for beta in (0.0, 0.04):
      for loss_type, level in (("grpo", "token"), ("dr_grpo", "token"), ("dapo", "token"),
                               ("grpo", "sequence")):
        for with_old in (False, True):
          c, g = case(states, temperature, beta, loss_type, level, with_old)
          names = names or list(g)
          cases.append(c)
          grads.append(np.concatenate([g[k].numpy().reshape(-1) for k in names]))
  me = trainer(GRPOConfig(output_dir="/tmp/grpo_fixture", use_cpu=True, bf16=False))
  scored = {str(t): {k: logps(me, model(states[k], t)).tolist() for k in ("old", "reference")}
            for t in (0.7, 1.0)}
  fixture = {"group_size": G, "prompt_len": P, "max_completion_length": T,
             "prompt_ids": prompt_ids.tolist(), "completion_ids": completion_ids.tolist(),
             "completion_mask": completion_mask.tolist(), "rewards": rewards.tolist(),
             "advantages": {s: advantages(s).tolist() for s in ("group", "batch", "none")},
             "scored": scored, "grad_names": names,
             "grad_shapes": [list(states["policy"][k].shape) for k in names], "cases": cases}
  with open(os.path.join(OUT, "trl.json"), "w") as f:
    json.dump(fixture, f)
  np.save(os.path.join(OUT, "trl_grads.npy"), np.stack(grads).astype(np.float32))
  for c in cases:
    print(c["temperature"], c["beta"], c["loss_type"], c["importance_sampling_level"],
          c["with_old"], f"loss {c['loss']:.6f} kl {c['kl']:.6f} clip {c['clip_ratio']:.4f}")


if __name__ == "__main__":
  main()
