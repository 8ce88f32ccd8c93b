"""Remat policies by name: spmdtask's presets over the layers' named activations, or jax's own.

A remat policy decides which values computed inside a rematerialized layer its backward
pass keeps (saved on the device, or offloaded to host memory) and which it recomputes.
The layers tag their matmul outputs with `jax.ad_checkpoint.checkpoint_name` (the names
below); the presets pick among those names, so what they save does not depend on how
XLA happens to print a dot.

Names (per layer; shapes for batch b, sequence t, heads h, KV heads k, head dim e, model d):
  layer_input              the layer's input (the scan's carry)                [b,t,d]
  q_proj, k_proj, v_proj   the q / k / v projections before RoPE   [b,t,h,e] / [b,t,k,e]
  attn_context             attention's output before its out projection   [b,t,h,e]
  attn_out                 the attention out projection                    [b,t,d]
  mlp_up, mlp_gate         the MLP's input projections (gate: SwiGLU only) [b,t,ff]
  mlp_hidden               the activation, the out projection's input      [b,t,ff]
  mlp_out                  the MLP out projection                          [b,t,d]
  q_weight, k_weight,      the whole q / k / v weights FSDP gathered for the forward
  v_weight                 (layers.base.project)           [d,h,e] / [d,k,e], every layer

Presets (what the backward keeps besides each layer's input, which it always keeps;
everything else recomputed):
  full                    nothing (jax's `nothing_saveable`): one forward recompute per layer.
  minimal                 every matmul output no wider than the model: q/k/v_proj,
                          attn_context, attn_out, mlp_out. Recomputes the ff-wide MLP up /
                          gate projections and the attention scores.
  save_dot_except_mlp     q/k/v_proj and attn_out: the attention's weight matmuls.
  save_qkv_proj           q/k/v_proj.
  save_q_attn_out         q_proj and attn_out: save_dot_except_mlp less k/v_proj, whose
                          recompute is the cheapest per byte kept under grouped-query
                          attention (k/v are kv_heads/heads of q's width: 5 GiB of the
                          Llama-2-70B's temporaries on v5p-512 for 0.5% more matmul FLOPs).
  save_qkv_weights        q/k/v_weight: full's recompute, but the backward does not gather
                          those weights again (FSDP's "no reshard after forward" for them):
                          their whole size per device (Llama-3-8B: 48 MiB a layer) for as
                          many bytes less all-gather per step.
  <preset>_offloaded      (full, minimal, save_dot_except_mlp, save_qkv_proj) everything the
                          preset keeps, each layer's input included, moved to the host's
                          pinned memory after the forward and back for the backward
                          (`save_and_offload_only_these_names`): no per-layer activation
                          stays on the device between the forward and the backward;
                          recompute of <preset>; the transfers over the host link.
                          (`full_offloaded` moves only the layers' inputs.)
                          XLA:TPU and XLA:GPU place them on the host; jax 0.10.2 lowers a
                          memory-kind move inside jit to nothing on CPU (it registers that
                          lowering for tpu and gpu only), so on CPU the names stay where they
                          are (in host RAM already) with the same values.

Also accepted: None (no remat) and jax's ready-made policies (`nothing_saveable`,
`dots_saveable`, ...). jax's policy factories (`save_only_these_names`, ...) need
arguments a config string cannot give; they are config errors pointing at the presets.
"""
import inspect
from typing import Callable

import jax

from spmdtask.errors import ConfigError

LAYER_INPUT = "layer_input"
Q_PROJ, K_PROJ, V_PROJ = "q_proj", "k_proj", "v_proj"
ATTN_CONTEXT, ATTN_OUT = "attn_context", "attn_out"
MLP_UP, MLP_GATE, MLP_HIDDEN, MLP_OUT = "mlp_up", "mlp_gate", "mlp_hidden", "mlp_out"
# The whole weights FSDP gathered for the forward's q / k / v projections (layers.base.project).
Q_WEIGHT, K_WEIGHT, V_WEIGHT = "q_weight", "k_weight", "v_weight"
WEIGHTS = (Q_WEIGHT, K_WEIGHT, V_WEIGHT)
NAMES = (LAYER_INPUT, Q_PROJ, K_PROJ, V_PROJ, ATTN_CONTEXT, ATTN_OUT, MLP_UP, MLP_GATE, MLP_HIDDEN,
         MLP_OUT) + WEIGHTS

OFFLOADED = "_offloaded"
_QKV = (Q_PROJ, K_PROJ, V_PROJ)
# Preset -> the names its backward keeps (on the device, or on the host when offloaded).
SAVED = {
    "full": (),
    "minimal": _QKV + (ATTN_CONTEXT, ATTN_OUT, MLP_OUT),
    "save_dot_except_mlp": _QKV + (ATTN_OUT,),
    "save_qkv_proj": _QKV,
    "save_q_attn_out": (Q_PROJ, ATTN_OUT),
    "save_qkv_weights": WEIGHTS,
}
OFFLOADABLE = ("full", "minimal", "save_dot_except_mlp", "save_qkv_proj")
PRESETS = tuple(SAVED) + tuple(p + OFFLOADED for p in OFFLOADABLE)


def _is_policy(fn) -> bool:
  """jax calls a policy as `policy(prim, *args, **params)`; a factory takes its own arguments."""
  params = inspect.signature(fn).parameters.values()
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def jax_policies() -> tuple[str, ...]:
  """The ready-made policies of `jax.checkpoint_policies` (not the factories)."""
  return tuple(sorted(n for n in dir(jax.checkpoint_policies)
                      if not n.startswith("_") and _is_policy(getattr(jax.checkpoint_policies, n))))


def choices() -> tuple[str, ...]:
  """Every accepted name: spmdtask's presets, then jax's policies."""
  return PRESETS + jax_policies()


def check(field: str, name) -> None:
  """ConfigError naming `field` unless `name` is None, a preset or a jax policy."""
  if name is None or (isinstance(name, str) and name in choices()):
    return
  factory = (isinstance(name, str) and not name.startswith("_")
             and callable(getattr(jax.checkpoint_policies, name, None)))
  why = (f"{field}={name!r} is a jax.checkpoint_policies factory that needs arguments a "
         "config string cannot give; pick a preset over the layers' named activations "
         "instead" if factory else f"{field}={name!r} is not a remat policy")
  raise ConfigError(
      f"{why}. Use None (no remat), one of spmdtask's presets ({', '.join(PRESETS)}: see "
      f"spmdtask/core/remat.py for what each saves) or a jax.checkpoint_policies policy "
      f"({', '.join(jax_policies())}).")


def offloads(name: str | None) -> bool:
  """Whether the policy moves saved activations to host memory."""
  return bool(name) and name.endswith(OFFLOADED) and name in PRESETS


def policy(name: str | None) -> Callable | None:
  """The jax policy for a checked name (see `check`); None for no remat."""
  if not name:
    return None
  if name in SAVED:
    return (jax.checkpoint_policies.nothing_saveable if not SAVED[name]
            else jax.checkpoint_policies.save_only_these_names(*SAVED[name]))
  if offloads(name):
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        # The layer's input among them: its only use is through the name (Block), so the
        # scan's carry is not kept on the device either.
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[LAYER_INPUT, *SAVED[name[:-len(OFFLOADED)]]],
        offload_src="device", offload_dst="pinned_host")
  return getattr(jax.checkpoint_policies, name)
