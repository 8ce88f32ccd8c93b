"""spmdtask/recipe/recipe_file.py: every bad key is exit 2 naming the key and its line,
nothing written; the fine-tuning page shows the example recipe as it is."""
import os
import tomllib

import pytest

from spmdtask.recipe import runner
from tests import subproc as h

EXAMPLE = os.path.join(h.REPO, "examples", "tiny_chat")


def _recipe(tmp_path, body: str) -> str:
  path = tmp_path / "recipe.toml"
  path.write_text(body)
  return str(path)


def _exit_2(capsys, path: str) -> str:
  with pytest.raises(SystemExit) as e:
    runner.main([f"--recipe={path}"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("recipe: config error: ") and err.count("\n") == 1, err
  return err


@pytest.mark.parametrize("body, want", [
    ('root = "R"\n[model]\nhf = "M"\n[[stage]]\nkind = "sft"\ndata = "D"\nlora = 8\n',
     r":7: 'lora' is not a recipe key of [stage]; it takes data, fdl_set"),
    ('root = "R"\n[model]\nhf = "M"\n[[stage]]\nkind = "sft"\ndata = "D"\n[[stage]]\n'
     'kind = "ppo"\ndata = "D"\n', ":8: [[stage]] #2 kind = 'ppo': a stage is one of sft, dpo"),
    ('[model]\nhf = "M"\n[[stage]]\nkind = "sft"\ndata = "D"\n', ":1: root is missing"),
    ('root = "R"\n[model]\nhf = "M"\njob = "J"\n[[stage]]\nkind = "sft"\ndata = "D"\n',
     ":3: [model] names the model by hf"),
    ('root = "R"\n[model]\nhf = "M"\n[[stage]]\nkind = "dpo"\ninput = "p.jsonl"\n',
     ":6: [[stage]] #1: input = 'p.jsonl' is prepared with tools/prepare_pref_data.py "
     "--max_len: add max_len"),
    ('root = "R"\n[model]\nhf = "M"\n[[stage]]\nkind = "sft"\ndata = "D"\nlora_rank = "8"\n',
     ":7: [[stage]] #1 lora_rank = '8' is not an integer."),
    ('root = "R"\n[model]\nhf = "M"\n[[stage]]\nkind = "sft"\ndata = "D"\nreward = ["f.py:g"]\n',
     ":7: [[stage]] #1 (sft): reward scores GRPO's samples"),
    ('root = "R"\n[model]\nhf = "M"\n[[stage]]\nkind = "sft"\ndata = "D"\n[[stage]]\n'
     'kind = "sft"\ndata = "E"\n', ":7: [[stage]] #2: its job dir name 'sft' is taken"),
    ('root = "R"\n[model]\nhf = "M"\n[[stage]]\nkind = "sft"\ndata = "D"\nfdl_set = ["x"]\n',
     ":7: [[stage]] #1 fdl_set holds 'x'; give path=value strings."),
    ('root = "R"\n[model\nhf = "M"\n', "is not valid TOML"),
], ids=["unknown_key", "kind", "no_root", "two_models", "no_max_len", "rank_type",
        "reward_not_grpo", "same_name", "fdl_set", "toml"])
def test_a_bad_key_is_exit_2_naming_it_and_its_line(tmp_path, capsys, body, want):
  path = _recipe(tmp_path, body.replace('"R"', f'"{tmp_path}/root"'))
  assert want in _exit_2(capsys, path)
  assert not (tmp_path / "root").exists()  # nothing written


def test_the_fine_tuning_page_shows_the_example_recipe():
  page = open(os.path.join(h.REPO, "docs", "fine_tuning.md")).read()
  shown_toml = page.split("```toml\n", 1)[1].split("```", 1)[0]
  with open(os.path.join(EXAMPLE, "recipe.toml"), "rb") as f:
    assert tomllib.loads(shown_toml) == tomllib.load(f)
