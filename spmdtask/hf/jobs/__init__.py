"""Hugging Face checkpoints as spmdtask jobs: `from_hf` writes a job dir (a step-0
checkpoint, model_overrides.txt, the tokenizer files, hf_source.json), `to_hf` writes a HF
dir from a job's latest checkpoint (a full or merged model, or a PEFT adapter), `published`
names the configs/ experiment of an architecture.

Imports: the pure mapping (`spmdtask.hf`), `run` (the checkpoint module), the entry's
config resolution (`main`, `registry`) and the shared modules; tools/convert_hf.py is the
command over it.
"""
