"""Makes tests/hf/data/qlora_peft (README.md beside this file), from the repository root.

  python tests/hf/data/qlora_peft/make_qlora_peft.py adapter
      spmdtask, no torch: imports tests/tools/data/llama, trains a QLoRA job over it (nf4
      base in groups of 8, rank-4 adapters on every attention and MLP weight, 20 steps of
      the synthetic data) and writes its --to_hf PEFT adapter into adapter/.
  /work/torchenv/bin/python tests/hf/data/qlora_peft/make_qlora_peft.py reference
      torch, transformers and peft: the HF model of tests/tools/data/llama without and with
      that adapter (PeftModel.from_pretrained), in float32 and in bfloat16, on
      tests/tools/data/peft/tokens.npy: logits_*.npy.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = os.path.join("tests", "tools", "data", "llama")
TOKENS = os.path.join("tests", "tools", "data", "peft", "tokens.npy")
ADAPTER = os.path.join(HERE, "adapter")


def adapter() -> None:
  with tempfile.TemporaryDirectory() as tmp:
    start, job, out = (os.path.join(tmp, n) for n in ("import", "qlora", "adapter"))
    run = lambda *args: subprocess.run([sys.executable, *args], check=True)
    run("tools/convert_hf.py", f"--from_hf={BASE}", f"--job_log_dir={start}")
    run("-m", "spmdtask.main", "--exp=finetune.LlamaLoraImport", f"--job_log_dir={job}",
        f"--flagfile={start}/model_overrides.txt",
        f"--fdl_set=task.train.init_checkpoint_dir='{start}'",
        "--fdl_set=task.model.lora.base_quantization='nf4'",
        "--fdl_set=task.model.lora.group_size=8", "--fdl_set=task.model.lora.rank=4",
        "--fdl_set=task.train.num_train_steps=20",
        "--fdl_set=task.train.learning_rate.peak_value=0.02",
        "--fdl_set=task.train.eval_interval_steps=0")
    run("tools/convert_hf.py", f"--job_log_dir={job}", f"--to_hf={out}")
    os.makedirs(ADAPTER, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
      with open(os.path.join(out, name), "rb") as f:
        data = f.read()
      if name.endswith(".json"):  # the import's absolute path: the repository's instead
        cfg = json.loads(data)
        cfg["base_model_name_or_path"] = BASE
        data = (json.dumps(cfg, indent=2) + "\n").encode()
      with open(os.path.join(ADAPTER, name), "wb") as f:
        f.write(data)


def reference() -> None:
  import torch  # pylint: disable=import-outside-toplevel
  from peft import PeftModel  # pylint: disable=import-outside-toplevel
  from transformers import AutoModelForCausalLM  # pylint: disable=import-outside-toplevel
  tokens = torch.tensor(np.load(TOKENS), dtype=torch.long)
  for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=dtype).eval()
    with torch.no_grad():
      base = model(tokens).logits.float().numpy()
      peft_model = PeftModel.from_pretrained(model, ADAPTER).eval()
      adapted = peft_model(tokens).logits.float().numpy()
    print(name, "adapter dtype:", next(p for n, p in peft_model.named_parameters()
                                        if "lora_A" in n).dtype,
          "adapter's effect:", float(np.abs(adapted - base).max()))
    np.save(os.path.join(HERE, f"logits_base_{name}.npy"), base.astype(np.float32))
    np.save(os.path.join(HERE, f"logits_peft_{name}.npy"), adapted.astype(np.float32))


if __name__ == "__main__":
  {"adapter": adapter, "reference": reference}[sys.argv[1]]()
