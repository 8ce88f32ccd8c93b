"""Hugging Face interop: checkpoints, tokenizers and PEFT adapters in and out (safetensors,
numpy; no torch).

The pure mapping (Imports: the shared modules, `core`, `layers`):
  family.py          the `Family` contract: a family's fields, tensor names, LoRA targets
  llama.py qwen3.py moe.py gemma3.py deepseek.py
                     one module per family (moe: Mixtral and Qwen3-MoE; deepseek: V2, V3)
  families.py        every family by config.json model_type; its fields and experiments
  rope.py            RoPE of a HF config (transformers 4's and 5's layouts)
  convert.py         the generic conversion: HF tensors <-> spmdtask's logical params
  model_overrides.py model_overrides.txt: the --fdl_set lines of a HF config's model
  peft.py            PEFT LoRA adapters in and out; merge.py: adapters merged into the base
  files.py           HF directories: config.json, safetensors (single or sharded), writing
  trees.py           nested param dicts by '/' paths
`jobs/` (above `run`): HF dirs as job dirs and back (`imports.from_hf`, `exports.to_hf`), the published
experiment of an architecture; tools/convert_hf.py is the command.

Anything a checkpoint or adapter sets that spmdtask cannot express exactly is refused by
name (a ConfigError, exit 2), never replaced by a default. Converting in and out gives
bit-identical tensors (float32, bfloat16 and float16 weights are exact in float32).
"""
