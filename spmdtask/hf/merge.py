"""A LoRA model's adapters merged into its base weights: the params of a plain model, for a
merged export (`--to_hf --merge_lora`). Pure numpy; any family, any target (the routed
experts' adapters too).
"""
import numpy as np

from spmdtask.core.train_state import ADAPTER_SUFFIXES


def merged_weight(w, a, b, scale: float) -> np.ndarray:
  """W + scale·A·B in float32: A [*lead, *in, r], B [*lead, r, *out] beside W [*lead, *in,
  *out], the leading dims (a stack's layers, an MoE's experts) those all three share."""
  w, a, b = (np.asarray(x, np.float32) for x in (w, a, b))
  lead = a.ndim + b.ndim - 2 - w.ndim
  r = a.shape[-1]
  delta = np.einsum("gir,gro->gio", a.reshape(-1, int(np.prod(a.shape[lead:-1])), r),
                    b.reshape(-1, r, int(np.prod(b.shape[lead + 1:]))))
  return w + np.float32(scale) * delta.reshape(w.shape)


def merged(lora: dict, params: dict) -> dict:
  """`params` (nested dicts) with every adapted weight X as `merged_weight` of X and its
  X_lora_a, X_lora_b (scale alpha / rank of LoraConfig fields `lora`), the adapters left
  out: a plain model's params."""
  scale = lora["alpha"] / lora["rank"]

  def walk(tree):
    out = {}
    for k, v in tree.items():
      if k.endswith(ADAPTER_SUFFIXES):
        continue
      a, b = (tree.get(k + s) for s in ADAPTER_SUFFIXES)
      out[k] = walk(v) if isinstance(v, dict) else v if a is None else merged_weight(
          v, a, b, scale)
    return out
  return walk(params)
