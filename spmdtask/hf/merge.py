"""A LoRA model's adapters merged into its base weights: the params of a plain model, for a
merged export (`--to_hf --merge_lora`). Pure numpy.
"""
import numpy as np

from spmdtask.hf import peft
from spmdtask.hf.trees import copy, node


def merged(cfg: dict, lora: dict, params: dict) -> dict:
  """`params` with every adapted weight W + (alpha / r)·a·b in float32 and the adapters
  dropped: a plain model's params."""
  scale, out = lora["alpha"] / lora["rank"], copy(params)
  for t in lora["targets"]:
    path = peft.modules(cfg, 0, (t,))[t][0]
    parent, name = node(out, path)
    a, b = parent.pop(name + peft.A_SUFFIX), parent.pop(name + peft.B_SUFFIX)
    w = np.asarray(parent[name], np.float32)
    L, r = w.shape[0], lora["rank"]
    delta = np.einsum("lir,lro->lio", np.asarray(a, np.float32).reshape(L, -1, r),
                      np.asarray(b, np.float32).reshape(L, r, -1))
    parent[name] = w + np.float32(scale) * delta.reshape(w.shape)
  return out
