"""configs/stages.py: DPO from an import with the reference another import, no hand editing
(the first loss equals TRL's DPOTrainer's on tests/tools/data/dpo's pairs), each family's
model from its import's model_overrides.txt alone, and a stage without a model or a start
refused by name before anything is written."""
import json
import os

import fiddle as fdl
import jax
import pytest

from spmdtask import main, overrides
from spmdtask.errors import ConfigError
from spmdtask.inputs import text, tokenizers
from spmdtask.run import loop
from tests import subproc as h
from spmdtask.hf import families, model_overrides
from spmdtask.hf.jobs import imports

DATA = os.path.join(h.REPO, "tests", "tools", "data")
FAMILIES = ("llama", "qwen3", "gemma3", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def _pairs_dir(path: str) -> dict:
  """The fixture's 4 pairs (token ids) as a preference data dir (train and eval: all 4), as
  tools/prepare_pref_data.py lays one out; returns the fixture (TRL's numbers)."""
  with open(os.path.join(DATA, "dpo", "pairs.json")) as f:
    fix = json.load(f)
  docs, masks = [], []
  for p in fix["pairs"]:
    for k in ("chosen_ids", "rejected_ids"):
      docs.append(p["prompt_ids"] + p[k])
      masks.append([0] * len(p["prompt_ids"]) + [1] * len(p[k]))
  os.makedirs(path)
  splits = {s: {"files": text.write_split(path, s, docs, 1, masks), "num_pairs": 4}
            for s in ("train", "eval")}
  with open(os.path.join(path, tokenizers.META_FILE), "w") as f:
    json.dump({"kind": "preferences", "preferences": True, "target_mask": True,
               "vocab_size": 128, "splits": splits}, f)
  return fix


@pytest.mark.slow
def test_dpo_from_an_import_with_another_import_as_reference_equals_trl(tmp_path):
  policy, reference, pairs = (str(tmp_path / d) for d in ("policy", "reference", "pairs"))
  imports.from_hf(os.path.join(DATA, "llama"), policy)
  imports.from_hf(os.path.join(DATA, "dpo", "reference"), reference)
  fix = _pairs_dir(pairs)
  # docs/dpo.md's command: --exp=stages.Dpo --init_from=POLICY --data_dir=PAIRS
  #   --fdl_set=task.objective.reference_checkpoint_dir='REFERENCE'
  run = main.build(main.resolved_config(
      "stages.Dpo", [f"task.objective.reference_checkpoint_dir={reference!r}",
                     "task.train.num_train_steps=1", "datasets['train'].prepared.batch_size=4",
                     "datasets['train'].prepared.seq_len=16",
                     "datasets['eval'].prepared.batch_size=4",
                     "datasets['eval'].prepared.seq_len=16"],
      pairs, start=overrides.start_of(policy, None)))
  assert run.task.train.init_checkpoint_dir == policy
  _, _, losses = loop.train(run, str(tmp_path / "dpo"), devices=jax.devices()[:1])
  assert abs(losses[0] - fix["trl_loss"]) <= 1e-5, (losses[0], fix["trl_loss"])
  assert abs(losses[0] - 0.6931471805599453) > 5e-3  # the reference is not the policy (ln 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_built_from_its_model_overrides_alone(family):
  cfg = json.load(open(os.path.join(DATA, family, "config.json")))
  lines = model_overrides.overrides(cfg)
  want = fdl.build(main.resolved_config(families.experiment(cfg), lines).task.model)
  for exp in ("stages.Sft", "stages.Dpo", "stages.Grpo"):
    got = main.resolved_config(exp, [], start=overrides.Start(family, lines))
    assert fdl.build(got.task.model) == want, (family, exp)
  # The data's vocabulary is the model's (model_overrides.txt sets no dataset field).
  sft = main.resolved_config("stages.Sft", [], start=overrides.Start(family, lines))
  assert fdl.build(sft.datasets["train"]).vocab_size == cfg["vocab_size"]


def test_lora_rank_adapts_every_weight_the_family_has():
  cfg = json.load(open(os.path.join(DATA, "mixtral", "config.json")))
  run = fdl.build(main.resolved_config("stages.Sft", [], start=overrides.Start(
      "mixtral", model_overrides.overrides(cfg)), lora_rank=4))
  assert (run.task.model.lora.rank, run.task.model.lora.alpha) == (4, 8.0)
  assert run.task.model.lora.targets == ("q", "k", "v", "o", "experts")


def test_a_stage_without_a_model_or_a_start_is_one_paragraph_naming_it(tmp_path):
  with pytest.raises(ConfigError, match=r"--exp=stages.Dpo trains an imported model, and none "
                     r"is named: give --init_from=DIR"):
    main.resolved_config("stages.Dpo", [])
  with pytest.raises(ConfigError, match=r"--init_from='.*/nowhere' has no model_overrides.txt"):
    overrides.start_of(str(tmp_path / "nowhere"), None)
  empty = tmp_path / "import"
  empty.mkdir()
  (empty / "model_overrides.txt").write_text("--family=llama\n")
  with pytest.raises(ConfigError, match=r"task.train.init_checkpoint_dir='.*/import' "
                     r"\(--init_from\) holds no complete checkpoint"):
    overrides.start_of(str(empty), None)
  (empty / "model_overrides.txt").write_text("--family=llama\nlayers=2\n")
  with pytest.raises(ConfigError, match=r"model_overrides.txt:2: 'layers=2' is neither"):
    overrides.start_of(str(empty), None)


@pytest.mark.parametrize("rank", [0, -4])
def test_a_lora_rank_below_1_is_refused_by_its_flag(rank):
  lines = model_overrides.overrides(json.load(open(os.path.join(DATA, "mixtral", "config.json"))))
  with pytest.raises(ConfigError, match=rf"--lora_rank={rank}: the adapters' rank must be >= 1"):
    main.resolved_config("stages.Sft", [], start=overrides.Start("mixtral", lines),
                         lora_rank=rank)


def test_lora_rank_on_an_experiment_that_is_no_stage_names_the_fields_to_set():
  with pytest.raises(ConfigError, match=r"--lora_rank=4: --exp=lm.TinyLm is not a stage "
                     r"experiment .* set its task.model.lora fields with --fdl_set"):
    main.resolved_config("lm.TinyLm", [], lora_rank=4)


def test_a_family_flag_that_disagrees_with_the_start_is_refused_naming_both(tmp_path):
  start = tmp_path / "import"
  start.mkdir()
  (start / "model_overrides.txt").write_text("--family=qwen3\n")
  with pytest.raises(ConfigError, match=r"--family=llama but --init_from='.*/import' holds a "
                     r"qwen3 model .* drop --family"):
    overrides.start_of(str(start), "llama")
