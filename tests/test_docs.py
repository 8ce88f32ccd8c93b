"""Every shell command of README.md and docs/ runs as written or is checked.

Unmarked ```bash blocks run as written, one bash subprocess per block, a page's blocks in order
(later ones read earlier ones' outputs), from the repo root on one CPU device, with `/tmp/`
moved under a fresh temporary dir. Marked blocks (`# needs: ...`, tools/docs_check.py) are not
run; for every block, marked or not, each `--flag` must exist for the program it is given to
(spmdtask.main's absl flags, a tools/ or benchmarks/ script's argparse or absl flags; after a
standalone `--`, spmdtask.main's), each `--exp=NAME` must resolve in the registry, and each
repo path must exist. `pytest -rP tests/test_docs.py` prints which blocks ran and which are
marked, and why.

The fine-tuning page's recipe (docs/fine_tuning.md, on examples/tiny_chat) is checked beyond
its exit codes: the loss falls, decode stops at end-of-turn, the adapter is PEFT's and holds the
trained adapters over the untouched base.
"""
import functools
import json
import os
import re
import subprocess
import time

import numpy as np
import pytest
from absl import flags

from spmdtask import registry
from spmdtask.errors import ConfigError
from spmdtask.hf import files, model_overrides, peft
from spmdtask.hf.jobs import checkpoints as hf_checkpoints
from spmdtask.hf.jobs import imports
from spmdtask.run import checkpoints
from tests import subproc as h
from tools import docs_check

PAGES = docs_check.pages(h.REPO)


def blocks(page: str) -> list[docs_check.Block]:
  text = open(os.path.join(h.REPO, page), encoding="utf-8").read()
  return docs_check.bash_blocks(text, page)


@functools.cache
def main_flags() -> frozenset[str]:
  import spmdtask.main  # pylint: disable=g-import-not-at-top,unused-import  (defines its flags)
  return frozenset(flags.FLAGS) | {"flagfile", "undefok"}


def _unknown(names: list[str], known) -> list[str]:
  return [n for n in names if n not in known and not (n.startswith("no") and n[2:] in known)]


def problems(block: docs_check.Block) -> list[str]:
  """What a block names that does not exist: flags, experiments, repo files."""
  where = f"{block.page}:{block.line}"
  out = []
  for words in docs_check.commands(block.text):
    out += [f"{where}: {p} does not exist in the repo" for p in docs_check.repo_paths(words)
            if docs_check.missing_path(p, h.REPO)]
    name, args, main_args = docs_check.program(words)
    if name is None:
      continue  # pip, gcloud, pytest, ...: not ours
    if name != "spmdtask.main" and docs_check.missing_path(name, h.REPO):
      continue  # reported above as a missing repo path
    known = main_flags() if name == "spmdtask.main" else docs_check.script_flags(name)
    out += [f"{where}: {name} has no flag --{f}" for f in _unknown(docs_check.flag_names(args), known)]
    out += [f"{where}: spmdtask.main (after `--`) has no flag --{f}"
            for f in _unknown(docs_check.flag_names(main_args), main_flags())]
    for a in args + main_args:
      if a.startswith("--exp="):
        try:
          registry.get(a[len("--exp="):])
        except ConfigError as e:
          out.append(f"{where}: {e}")
  return out


def test_every_block_names_flags_experiments_and_files_that_exist():
  found, listing = [], []
  for page in PAGES:
    for b in blocks(page):
      found += problems(b)
      listing.append(f"{b.page}:{b.line}: " + (f"MARKED (needs: {' '.join(b.needs)})"
                                                 if b.needs else "RUN"))
    text = open(os.path.join(h.REPO, page), encoding="utf-8").read()
    found += [f"{page}: names {p}, which does not exist in the repo"
              for p in docs_check.missing_repo_paths(text, h.REPO)]
  print("\n".join(listing))
  assert not found, "\n".join(found)
  assert any(not b.needs for p in PAGES for b in blocks(p))


def test_a_broken_flag_experiment_or_path_fails_the_check(tmp_path):
  page = tmp_path / "broken.md"
  page.write_text("Needs a pod, so marked:\n```bash\n# needs: tpu\n"
                  "python -m spmdtask.main --exp=lm.TinyLm --job_log_dir=/tmp/x --no_such_flag=1\n"
                  "python tools/launch_local.py --num_processes=2 -- --exp=lm.NoSuchLm --bogus\n"
                  "python tools/plan_pipeline.py --stages=2 --stagez=3\n"
                  "python tools/no_such_tool.py --input=examples/no_such_dir\n```\n")
  (block,) = docs_check.bash_blocks(page.read_text(), "broken.md")
  assert block.needs == ("tpu",)
  found = "\n".join(problems(block))
  for expected in ("spmdtask.main has no flag --no_such_flag", "'lm.NoSuchLm' names no registered",
                   "spmdtask.main (after `--`) has no flag --bogus",
                   "tools/plan_pipeline.py has no flag --stagez",
                   "tools/no_such_tool.py does not exist", "examples/no_such_dir does not exist"):
    assert expected in found, found
  assert "--job_log_dir" not in found and "--num_processes" not in found, found
  # The build's hook: a code span naming a missing repo file.
  assert docs_check.missing_repo_paths("See `tools/convert_hf.py` and `tools/gone.py`.",
                                       h.REPO) == ["tools/gone.py"]
  with pytest.raises(docs_check.DocsError, match="tpus"):
    docs_check.bash_blocks("```bash\n# needs: tpus\nls\n```\n", "typo.md")


def test_every_page_is_in_the_readme_index_and_the_nav():
  readme = open(os.path.join(h.REPO, "README.md"), encoding="utf-8").read()
  nav = open(os.path.join(h.REPO, "mkdocs.yml"), encoding="utf-8").read()
  linked = set(re.findall(r"\]\(([^)#]+)", readme))
  assert all(os.path.exists(os.path.join(h.REPO, p)) for p in linked), linked
  for page in PAGES[1:]:
    rel = os.path.relpath(page, "docs")
    assert rel == "index.md" or page in linked, f"{page} is not in README.md's index"
    assert re.search(rf":\s*{re.escape(rel)}\s*$", nav, re.M), f"{rel} is not in mkdocs.yml's nav"


def run_page(page: str, tmp: str) -> list[tuple[int, float, str]]:
  """Runs the page's unmarked blocks in order; returns (line, wall s, stdout) of each."""
  # `python` forks spmdtask's commands from one process that imported it (subproc.python).
  python, env = h.python(1)
  env["PATH"] = os.path.dirname(python) + os.pathsep + env["PATH"]
  ran, before = [], _tree()
  for b in blocks(page):
    if b.needs:
      continue
    start = time.time()
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", b.text.replace("/tmp/", f"{tmp}/")],
                       env=env, cwd=h.REPO, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, (f"{page}:{b.line} exited {r.returncode}:\n{b.text}\n"
                               f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    ran.append((b.line, time.time() - start, r.stdout))
  assert _tree() == before, (f"{page}'s commands wrote into the repo (write under /tmp), or "
                             "the tree changed while they ran")
  return ran


def _tree() -> str:
  return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=h.REPO,
                        capture_output=True, text=True, check=False).stdout  # no git: ""


RUN_PAGES = [p for p in PAGES if any(not b.needs for b in blocks(p))]


# README's own commands run in the default tier (CI's); the other pages' are end-to-end runs.
@pytest.mark.parametrize("page", [
    p if p == "README.md" else pytest.param(p, marks=pytest.mark.slow) for p in RUN_PAGES])
def test_the_unmarked_blocks_run_as_written(page, tmp_path):
  ran = run_page(page, str(tmp_path))
  print("\n".join(f"{page}:{line}: ran in {s:.1f} s" for line, s, _ in ran))
  if page in AFTER:
    AFTER[page](str(tmp_path), "".join(out for *_, out in ran))


def _recipe(tmp: str, stdout: str) -> None:
  """docs/fine_tuning.md's recipe, beyond exit codes."""
  out = os.path.join(tmp, "chat")
  base = os.path.join(tmp, "tiny_chat_run", "import")  # the recipe's import, the LoRA's base
  lora, adapter = (os.path.join(out, n) for n in ("lora", "adapter"))
  model = os.path.join(h.REPO, "examples", "tiny_chat", "model")
  eot = 6  # <|eot_id|> of the tiny model's tokenizer

  # Training: the masked loss falls over the 10 steps; eval ran on the eval split.
  losses = h.train_losses(lora)
  assert max(losses) == 10 and losses[max(losses)] < losses[min(losses)] - 0.25, losses
  evals = [json.loads(l) for l in open(os.path.join(lora, "eval_metrics.jsonl"))]
  assert evals[-1]["dataset"] == "eval" and evals[-1]["step"] == 10, evals
  assert evals[-1]["weight"] > 0 and np.isfinite(evals[-1]["loss"]), evals

  # Decode: every prompt rendered with the template, stopped at end-of-turn or the length.
  rows = [json.loads(l) for l in open(os.path.join(lora, "decoder_out",
                                                   "own_prompts_step10.jsonl"))]
  prompts = [json.loads(l)["messages"][-1]["content"] for l in open(
      os.path.join(h.REPO, "examples", "tiny_chat", "prompts.jsonl"))]
  assert [r["id"] for r in rows] == [0, 1, 2, 3]
  for r, asked in zip(rows, prompts):
    assert r["prompt_text"] == (f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>"
                                f"\n\n{asked}<|eot_id|><|start_header_id|>assistant"
                                "<|end_header_id|>\n\n"), r
    ids, stopped = r["output_ids"], r["output_text"].endswith("<|eot_id|>")
    assert eot not in ids[:-1] and (ids[-1] == eot) == stopped, r
    assert stopped or len(r["prompt_ids"]) + len(ids) == 64, r
    assert asked in stdout  # the console shows each prompt and its answer
  # --chat: one user message rendered with the import's template, stopped the same way.
  [asked] = [json.loads(l) for l in open(os.path.join(lora, "decoder_out",
                                                      "own_prompts_step10_2.jsonl"))]
  assert asked["prompt_text"] == rows[0]["prompt_text"].replace(prompts[0], "What is 1 + 2?")
  assert eot not in asked["output_ids"][:-1]
  assert stdout.count("  prompt ") == 5

  # The adapter: PEFT's keys and shapes, rank 8, trained (B no longer 0).
  cfg, tensors = peft.read(adapter)
  assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0
  assert {k: v.shape for k, v in tensors.items()} == _peft_shapes()
  assert all(np.abs(v).max() > 0 for k, v in tensors.items() if "lora_B" in k)

  # The LoRA job's checkpoints hold only the adapters and name the import as their base;
  # restored, its frozen params are the import's, bit for bit.
  meta = checkpoints.read_meta(lora)
  assert meta["params_held"] == "adapters" and meta["lora_base"]["dir"].endswith("import"), meta
  hf_cfg = files.read_hf(model)[0]
  imported = hf_checkpoints.read_checkpoint(base, model_overrides.overrides(hf_cfg),
                                            "llama.LlamaImport")
  trained = hf_checkpoints.read_checkpoint(lora, model_overrides.overrides(
      hf_cfg, lora=peft.lora_fields(hf_cfg, cfg, adapter)), "finetune.LlamaLoraImport")
  flat_base, flat_lora = dict(_flatten(imported)), dict(_flatten(trained))
  assert set(flat_base) < set(flat_lora)
  for path, value in flat_base.items():
    assert flat_lora[path].dtype == value.dtype and flat_lora[path].tobytes() == value.tobytes(), path
  # The exported adapter read back (--from_hf --adapter) is the trained one.
  again = os.path.join(out, "again")
  back = hf_checkpoints.read_checkpoint(again, imports.from_hf(model, again, adapter),
                                        "finetune.LlamaLoraImport")
  for path, value in _flatten(back):
    np.testing.assert_allclose(value, flat_lora[path], rtol=0, atol=1e-6, err_msg=path)


AFTER = {"docs/fine_tuning.md": _recipe}


def _peft_shapes() -> dict[str, tuple[int, int]]:
  """PEFT's key -> shape for rank 8 on every linear of the tiny model (2 layers, d 64,
  4 heads / 2 KV heads of 16, MLP 128)."""
  dims = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32),
          "self_attn.v_proj": (64, 32), "self_attn.o_proj": (64, 64),
          "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128), "mlp.down_proj": (128, 64)}
  out = {}
  for layer in range(2):
    for module, (d_in, d_out) in dims.items():
      key = f"base_model.model.model.layers.{layer}.{module}"
      out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = (8, d_in), (d_out, 8)
  return out


def _flatten(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flatten(v, f"{prefix}{k}/")
    else:
      yield f"{prefix}{k}", np.asarray(v)
