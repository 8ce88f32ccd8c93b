"""spmdtask/recipe/runner.py: the commands a recipe runs, and the chain end to end on
examples/tiny_chat's Llama: import -> SFT with LoRA -> DPO with LoRA from it -> GRPO with
LoRA from that on a prompts file with a reward from a user's file -> the merged export,
SIGKILLed mid-DPO and rerun, whose greedy tokens in transformers spmdtask decodes (and the
same chain, shorter, on tiny Qwen3 and Qwen3-MoE, from the same prepared data)."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from spmdtask import main, overrides
from spmdtask.core import program as program_lib
from spmdtask.core import train_state
from spmdtask.hf import convert, files
from spmdtask.recipe import recipe_file, runner
from spmdtask.run import checkpoint_io, checkpoints, rollout
from tests import subproc as h
from tests.hf.jobs import test_exports
from tools import prepare_chat_data, prepare_pref_data, prepare_prompt_data

EXAMPLE = os.path.join(h.REPO, "examples", "tiny_chat")
PREFS = os.path.join(h.REPO, "tests", "tools", "data", "dpo", "prefs.jsonl")
CHAIN_EXPORT = os.path.join(h.REPO, "tests", "recipe", "data", "chain_export", "expected.json")
REWARD = '''\
def digits(prompts, completions, answers):
  return [sum(ch.isdigit() for ch in c) / (1 + len(c)) for c in completions]
'''
EVERY_STEP = ["task.train.summary_interval_steps=1", "task.train.log_interval_steps=1"]
# The Llama chain's SFT, DPO and GRPO steps (tests/recipe/data/chain_export: its export's
# greedy tokens in transformers). examples/tiny_chat/recipe.toml trains the same steps and
# shapes, so the docs test of that recipe and this chain compile the same programs: whichever
# runs second loads them from the persistent XLA cache (tests/subproc.py). Keep them alike.
LLAMA_STEPS = (4, 4, 1)
PROMPTS = "".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": a + b}) + "\n"
                  for a, b in ((1, 2), (3, 4), (2, 1), (5, 1)))


def _recipe(tmp_path, body: str) -> str:
  path = tmp_path / "recipe.toml"
  path.write_text(body)
  return str(path)


def test_the_commands_chain_each_stage_from_the_one_before(tmp_path):
  path = _recipe(tmp_path, f'root = "{tmp_path}/r"\n[model]\njob = "/imp"\n'
                 '[[stage]]\nkind = "sft"\ndata = "/chat"\nlora_rank = 8\n'
                 '[[stage]]\nkind = "dpo"\nname = "align"\ninput = "/p.jsonl"\nmax_len = 9\n'
                 'fdl_set = ["task.train.num_train_steps=3"]\n'
                 f'[export]\nhf = "{tmp_path}/out"\n')
  got = [runner.shown(s.argv) for s in runner.steps(recipe_file.load(path))]
  r = f"{tmp_path}/r"
  assert got == [
      f"python -m spmdtask.main --exp=stages.Sft --job_log_dir={r}/sft --init_from=/imp "
      "--data_dir=/chat --lora_rank=8",
      f"python tools/prepare_pref_data.py --input=/p.jsonl --tokenizer=/imp "
      f"--output_dir={r}/align_data --max_len=9",
      f"python -m spmdtask.main --exp=stages.Dpo --job_log_dir={r}/align --init_from={r}/sft "
      f"--data_dir={r}/align_data --fdl_set=task.train.num_train_steps=3",
      f"python tools/convert_hf.py --job_log_dir={r}/align --to_hf={tmp_path}/out"]


def _wait_for_checkpoint(directory: str, proc, seconds: float) -> int | None:
  """The first complete checkpoint step in `directory` while `proc` runs, or None. Polled
  every 20 ms: a tiny stage's next steps and save take well over that, where half a second
  let a fast machine's stage reach its last checkpoint before the caller's kill."""
  end = time.time() + seconds
  while time.time() < end and proc.poll() is None:
    if os.path.isdir(directory):
      steps = checkpoint_io.complete_steps(directory)
      if steps:
        return steps[0]
    time.sleep(0.02)
  return None


def _program(exp: str, init_from: str, rank: int, data_dir: str | None = None):
  run = main.build(main.resolved_config(exp, [], data_dir,
                                        start=overrides.start_of(init_from, None), lora_rank=rank))
  return program_lib.setup(run.task, rollout.example(run), jax.devices()[:1])


def _params(job: str, program):
  return jax.device_get(program.to_canonical(checkpoints.restore_state(job, program)[0]).params)


def _chain(tmp_path, model_dir: str, sft_steps: int, dpo_steps: int, grpo_steps: int,
           data: dict | None = None) -> str:
  """A recipe: `model_dir` imported, SFT, DPO and GRPO with LoRA rank 4, a merged export;
  each stage's data prepared from its `input` by the recipe, or `data[kind]` (a dir)."""
  (tmp_path / "my_rewards.py").write_text(REWARD)
  (tmp_path / "prompts.jsonl").write_text(PROMPTS)
  inputs = {"sft": f'input = "{EXAMPLE}/conversations.jsonl"\nmax_len = 96',
            "dpo": f'input = "{PREFS}"\nmax_len = 96',
            "grpo": f'input = "{tmp_path}/prompts.jsonl"'}
  if data is not None:
    inputs = {kind: f'data = "{d}"' for kind, d in data.items()}
  return _recipe(tmp_path, f'''\
root = "{tmp_path / 'run'}"
[model]
hf = "{model_dir}"
[[stage]]
kind = "sft"
{inputs["sft"]}
lora_rank = 4
fdl_set = {json.dumps(EVERY_STEP + [f"task.train.num_train_steps={sft_steps}",
                                     "task.train.learning_rate.peak_value=1e-2"])}
[[stage]]
kind = "dpo"
{inputs["dpo"]}
lora_rank = 4
fdl_set = {json.dumps(EVERY_STEP + [f"task.train.num_train_steps={dpo_steps}",
                                     "task.train.save_interval_steps=2",
                                     "task.train.learning_rate.peak_value=1e-2"])}
[[stage]]
kind = "grpo"
{inputs["grpo"]}
lora_rank = 4
reward = ["{tmp_path}/my_rewards.py:digits"]
fdl_set = {json.dumps(EVERY_STEP + [f"task.train.num_train_steps={grpo_steps}",
                                     "datasets['train'].batch_size=2",
                                     "task.objective.max_new_tokens=6"])}
[export]
hf = "{tmp_path}/export"
''')


def _check_chain(tmp_path, model_dir: str, sft_steps: int, dpo_steps: int,
                 grpo_data: str | None = None):
  """Losses fall, each reference is its start, the export is the last job merged."""
  root = tmp_path / "run"
  sft, dpo = (h.train_losses(str(root / n)) for n in ("sft", "dpo"))
  assert sft[sft_steps] < sft[1], sft  # SFT learns the conversations
  # DPO's reference is its start (SFT merged, the new adapters off): at step 1 the policy
  # is the reference, so the loss is ln 2 exactly; it falls as the pairs are learned.
  assert abs(dpo[1] - np.log(2)) < 1e-6 and dpo[dpo_steps] < dpo[1] - 1e-3, dpo
  grpo = h.scalars(str(root / "grpo" / "summaries" / "train"))
  assert grpo["kl"][1] < 1e-9 and np.isfinite(grpo["loss"][1]), grpo  # its reference: the start
  # The export is the GRPO job's params with every stage's adapters merged in.
  grpo_program = _program("stages.Grpo", str(root / "dpo"), 4,
                          grpo_data or str(root / "grpo_data"))
  want = train_state.merged_adapters(_params(str(root / "grpo"), grpo_program), 2.0)  # alpha 8 / rank 4
  cfg, tensors = files.read_hf(str(tmp_path / "export"))
  got = convert.to_params(cfg, tensors)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), got, want)
  base = convert.to_params(*files.read_hf(model_dir))  # ... not the import's
  assert max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base))
             ) > 1e-3


@pytest.mark.slow
def test_the_chain_end_to_end_killed_mid_stage_and_rerun(tmp_path):
  root = tmp_path / "run"
  path = _chain(tmp_path, f"{EXAMPLE}/model", *LLAMA_STEPS)
  python, env = h.python(1)
  cmd = [python, "-m", "spmdtask.recipe", f"--recipe={path}"]
  # Killed (the whole process group, SIGKILL) once DPO committed its first checkpoint.
  proc = subprocess.Popen(cmd, env=env, cwd=h.REPO, start_new_session=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    killed_at = _wait_for_checkpoint(str(root / "dpo" / "checkpoints"), proc, 1200)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    first = proc.communicate()[0]
  newest = max(checkpoint_io.complete_steps(str(root / "dpo" / "checkpoints")))
  assert killed_at == 2 and newest < 4 and not (root / "dpo" / runner.DONE_FILE).exists(), \
      first[-3000:]
  r = subprocess.run(cmd, env=env, cwd=h.REPO, capture_output=True, text=True, timeout=1800,
                     check=False)
  assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
  for step in ("import", "sft data", "sft", "dpo data"):  # finished: skipped
    assert f"recipe: {step}: done" in r.stdout, r.stdout[-3000:]
  assert f"Resuming from the checkpoint at step {newest}; training to step 4." in r.stdout, \
      r.stdout[-3000:]

  _check_chain(tmp_path, f"{EXAMPLE}/model", *LLAMA_STEPS[:2])

  # transformers loads the merged export with its own tokenizer and chat template, and its
  # greedy tokens (tests/recipe/data/chain_export, made offline from this chain) are
  # spmdtask's decode of the same prompts on the export.
  with open(CHAIN_EXPORT) as f:
    want = json.load(f)
  # As many new tokens as tests/hf/jobs/test_exports.py decodes from the same tiny Llama: one
  # decode program for both (the persistent XLA cache); the first n tokens are checked.
  rows = test_exports.decode_export(str(tmp_path / "export"), str(tmp_path / "decoded"),
                                    max(24, *(len(hf["output_ids"]) for hf in want)))
  for row, hf in zip(rows, want, strict=True):
    # No near-tie: float32 logits of this size differ by ~1e-5 between two implementations.
    assert min(hf["margins"]) > 1e-3, hf
    assert row["prompt_ids"] == hf["prompt_ids"]  # the export's template, rendered alike
    n = len(hf["output_ids"])  # transformers' stop: the end-of-turn token or NEW_TOKENS
    assert row["output_ids"][:n] == hf["output_ids"], (row, hf)

  # The resumed DPO ends where an uninterrupted run of the same command ends.
  again = str(tmp_path / "dpo_straight")
  command = shlex.split((root / "dpo" / runner.DONE_FILE).read_text())[1:]
  command = [a.replace(f"--job_log_dir={root}/dpo", f"--job_log_dir={again}") for a in command]
  s = h.run([sys.executable, *command], 1, timeout=900)
  assert s.returncode == 0, s.stderr[-3000:]
  dpo_program = _program("stages.Dpo", str(root / "sft"), 4)
  resumed, straight = _params(str(root / "dpo"), dpo_program), _params(again, dpo_program)
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)  # bitwise


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, str]:
  """Each stage's data dir as the Llama chain's recipe prepares it from examples/tiny_chat's
  tokenizer and template (the tiny Qwen3 and Qwen3-MoE carry the same files), read-only to
  the family chains: their own preparing would repeat the Llama chain's, byte for byte."""
  d = tmp_path_factory.mktemp("chain_data")
  (d / "prompts.jsonl").write_text(PROMPTS)
  model = f"{EXAMPLE}/model"
  out = {k: str(d / f"{k}_data") for k in ("sft", "dpo", "grpo")}
  prepare_chat_data.prepare(f"{EXAMPLE}/conversations.jsonl", model, out["sft"], 96)
  prepare_pref_data.prepare(PREFS, model, out["dpo"], 96)
  prepare_prompt_data.prepare(str(d / "prompts.jsonl"), model, out["grpo"])
  return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_chain_for_other_families(tmp_path, family, prepared):
  """The same chain, fewer steps, on tiny Qwen3 and Qwen3-MoE chat models (tests/data/
  tiny_chat_families: transformers' own, examples/tiny_chat's tokenizer and template), on
  the Llama chain's prepared data."""
  model_dir = os.path.join(h.REPO, "tests", "data", "tiny_chat_families", family)
  names = files.present(model_dir, files.TOKENIZER_FILES)  # the Llama's data is this model's
  assert names and names == files.present(f"{EXAMPLE}/model", files.TOKENIZER_FILES), names
  for name in names:
    with open(os.path.join(model_dir, name), "rb") as a, open(
        os.path.join(EXAMPLE, "model", name), "rb") as b:
      assert a.read() == b.read(), name
  r = h.run([sys.executable, "-m", "spmdtask.recipe",
             f"--recipe={_chain(tmp_path, model_dir, 3, 2, 1, prepared)}"], 1, timeout=1800)
  assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
  _check_chain(tmp_path, model_dir, 3, 2, prepared["grpo"])
