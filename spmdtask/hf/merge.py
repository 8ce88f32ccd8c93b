"""A LoRA model's adapters merged into its base weights: the params of a plain model, for a
merged export (`--to_hf --merge_lora`). On the host in numpy (a big model's weights never
touch a device); any family, any target (the routed experts' adapters too).
"""
import numpy as np

from spmdtask.core import train_state
from spmdtask.layers import qlora


def merged(lora: dict, params: dict) -> dict:
  """`params` (nested dicts) with every adapted weight merged (`train_state.merged_adapters`,
  scale alpha / rank of LoraConfig fields `lora`), the adapters left out: a plain model's
  params."""
  return train_state.merged_adapters(params, lora["alpha"] / lora["rank"], np)


def dequantized(lora: dict | None, params: dict) -> dict:
  """`params` with a QLoRA base (LoraConfig fields `lora`: base_quantization, group_size)
  dequantized to float32 under its float names (`qlora.Storage.dequantized`): what a merged
  export merges into and a PEFT export reads the base's shapes from."""
  kind = None if lora is None else lora.get("base_quantization")
  return params if kind is None else qlora.Storage(kind, lora["group_size"]).dequantized(params)
