"""Hugging Face checkpoints in and out of spmdtask: Llama, Qwen3, Gemma 3 (text), Mixtral,
Qwen3-MoE, DeepSeek-V2 and V3 (safetensors, numpy; no torch).

    python tools/convert_hf.py --from_hf=/models/llama --job_log_dir=/tmp/llama
    python -m spmdtask.main --exp=llama.LlamaImport --job_log_dir=/tmp/llama --mode=decode \
        --flagfile=/tmp/llama/model_overrides.txt
    python tools/convert_hf.py --job_log_dir=/tmp/llama --to_hf=/models/llama_out

(`tools/convert_llama.py`, the older name, runs this same command.) --from_hf reads
config.json and the safetensors weights and writes, into --job_log_dir: a step-0
checkpoint that --mode=decode, --mode=train and task.train.init_checkpoint_dir accept on
any mesh; model_overrides.txt, one `--fdl_set=...` per line (an absl --flagfile) that makes
the family's import experiment build the matching model; the tokenizer files; and
hf_source.json (the HF config and tensor dtypes) for --to_hf, which writes config.json and
model.safetensors from the latest checkpoint.

LoRA (every family; spmdtask.hf.peft says which modules): `--from_hf --adapter=DIR`
loads a PEFT adapter, or `--lora_rank=R` makes fresh ones.
`--to_hf` of a LoRA job (that one, or one warm-started from an import: --base_job, default
its task.train.init_checkpoint_dir) writes the adapter in PEFT's format, `--merge_lora` the
merged model as a plain checkpoint. A full or merged export is a chat model transformers
loads from that dir alone: config.json, model.safetensors, the import's tokenizer files and
chat template, and generation_config.json (eos: the end-of-turn token).

Never over your files: --from_hf into a dir that holds a job, and --to_hf into a non-empty
dir, exit 2 writing nothing, unless --overwrite (then the line says what was replaced).
The console shows a line per weights file (tensors, bytes; an export's with seconds) and the
checkpoint step exported; what C++ libraries print goes to JOB/logs/native.log. An import
holds one tensor at a time, not the model (spmdtask.run.streamed_checkpoint). The library
is the package spmdtask.hf (its docstring says which module does what).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
from spmdtask import fs, native_output
from spmdtask.errors import ConfigError
from spmdtask.hf import families
from spmdtask.hf.jobs.imports import from_hf, source
from spmdtask.hf.jobs.published import published_experiment
from spmdtask.hf.jobs.exports import to_hf
from spmdtask.hf.model_overrides import OVERRIDES_FILE


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--job_log_dir", required=True)
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--from_hf", help="a Hugging Face model directory to read")
  group.add_argument("--to_hf", help="a directory to write the Hugging Face model into")
  parser.add_argument("--adapter", help="with --from_hf: a PEFT LoRA adapter directory "
                      "(adapter_config.json + adapter_model.safetensors) of that model")
  parser.add_argument("--lora_rank", type=int, help="with --from_hf: add fresh LoRA adapters "
                      "of this rank to every attention and MLP weight (PEFT's init: B = 0)")
  parser.add_argument("--lora_alpha", type=float, help="with --lora_rank (default 2 x rank)")
  parser.add_argument("--merge_lora", action="store_true", help="with --to_hf of a LoRA job: "
                      "write the merged model (base + alpha/r A B), not the PEFT adapter")
  parser.add_argument("--skip_mtp", action="store_true", help="with --from_hf of a "
                      "DeepSeek-V3: leave its multi-token-prediction layers out")
  parser.add_argument("--base_job", help="with --to_hf of a job trained elsewhere: the "
                      "--from_hf job it started from (default: found through its "
                      "init_checkpoint_dir)")
  parser.add_argument("--overwrite", action="store_true", help="replace the job in "
                      "--job_log_dir (--from_hf) or the model files in --to_hf")
  return parser


def _say(line: str) -> None:
  print(line, flush=True)


def _keep_native_log(job_log_dir: str) -> None:
  """What C++ libraries printed (captured by console.start_tool) into the job's logs/."""
  if not fs.is_remote(job_log_dir) and fs.isdir(job_log_dir):
    fs.makedirs(fs.join(job_log_dir, "logs"))
    native_output.log_to(fs.join(job_log_dir, "logs", "native.log"))


def _import(args) -> None:
  lora = args.adapter or args.lora_rank is not None
  new = None if args.lora_rank is None else {
      "r": args.lora_rank, "target_modules": "all-linear",
      "lora_alpha": 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha}
  from_hf(args.from_hf, args.job_log_dir, args.adapter, new, args.skip_mtp, args.overwrite,
          _say)
  src = source(args.job_log_dir)
  cfg = families.of(src["config"]).held(src["config"], src["dtypes"])[0]
  exp = families.lora_experiment(cfg) if lora else families.experiment(cfg)
  published = None if lora else published_experiment(cfg)
  _say(f"wrote {args.job_log_dir}: checkpoint step 0"
        f"{' (base + LoRA adapters)' if lora else ''}, {OVERRIDES_FILE} "
        f"(--exp={exp} --flagfile={fs.join(args.job_log_dir, OVERRIDES_FILE)})")
  if published:
    _say(f"the architecture of --exp={published}, which decodes or trains it as it is "
          "(its mesh and batch; add the --flagfile for the tokenizer's text)")
  print("Fine-tune it (stages.Dpo and stages.Grpo take --init_from the same way; or one "
        "recipe: docs/fine_tuning.md):\n  python -m spmdtask.main --exp=stages.Sft "
        f"--init_from={args.job_log_dir} --job_log_dir={args.job_log_dir.rstrip('/')}_sft "
        "--data_dir=CHAT_DATA")


def main():
  args = _parser().parse_args()
  try:
    lora = args.adapter or args.lora_rank is not None
    if (lora and not args.from_hf or (args.merge_lora or args.base_job) and not args.to_hf
        or args.adapter and args.lora_rank is not None):
      raise ConfigError("--adapter (an adapter of that model) or else --lora_rank (new "
                        "adapters), not both, goes with --from_hf; --merge_lora with --to_hf "
                        "(of a LoRA job).")
    if args.from_hf:
      _import(args)
    else:
      files = to_hf(args.job_log_dir, args.to_hf, args.merge_lora, args.base_job,
                    args.overwrite, _say)
      _say(f"wrote {args.to_hf}: {', '.join(files)}")
    _keep_native_log(args.job_log_dir)
  except ConfigError as e:
    print(f"{os.path.basename(sys.argv[0]).removesuffix('.py')}: config error: {e}",
          file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
