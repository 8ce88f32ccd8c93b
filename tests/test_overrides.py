"""Command-line changes to a config: an import's checkpoint without its --flagfile."""
import pytest

from spmdtask import main, overrides
from spmdtask.errors import ConfigError
from tests import subproc

IMPORT_LINES = ["task.model.vocab_size=300", "task.model.d_model=64", "task.model.num_layers=2",
                "task.model.num_heads=4", "task.model.rope_scaling=None",
                "decode_datasets['prompts'].default.vocab_size=300", "task.model.lora.rank=4"]


def _import_dir(tmp_path):
  """What tools/convert_hf.py --from_hf --lora_rank=4 leaves beside its checkpoint."""
  imp = tmp_path / "imp"
  imp.mkdir()
  (imp / "model_overrides.txt").write_text("".join(f"--fdl_set={l}\n" for l in IMPORT_LINES))
  return imp


def test_an_import_without_its_flagfile_is_named_before_anything_builds(tmp_path):
  imp = _import_dir(tmp_path)
  init = f"task.train.init_checkpoint_dir='{imp}'"
  with pytest.raises(ConfigError) as e:
    main.resolved_config("finetune.LlamaLoraImport", [init])
  assert str(e.value) == (
      f"task.train.init_checkpoint_dir='{imp}' is an import whose model differs from "
      "--exp=finetune.LlamaLoraImport's own (task.model.vocab_size=300 where it has 128256; "
      "task.model.d_model=64 where it has 2048; task.model.num_layers=2 where it has 16; ...), "
      "and no model field was set to the import's: pass "
      f"--flagfile={imp}/model_overrides.txt (it sets every model field, the data vocabulary, "
      "eos and the tokenizer to the import's).")
  # With the flagfile's lines, or any of the import's model fields set on purpose
  # (max_seq_len changed after them too), the run goes on.
  cfg = main.resolved_config("finetune.LlamaLoraImport", [*IMPORT_LINES, init,
                                                          "task.model.max_seq_len=64"])
  assert cfg.task.model.vocab_size == 300
  main.resolved_config("finetune.LlamaLoraImport", ["task.model.d_model=64", init])
  # No import there (no model_overrides.txt), or the same model: nothing to say.
  main.resolved_config("finetune.LlamaLoraImport",
                       [f"task.train.init_checkpoint_dir='{tmp_path}'"])
  main.resolved_config("lm.TinyLm", [f"task.train.init_checkpoint_dir='{imp}'",
                                     "task.model.vocab_size=300", "task.model.d_model=64"])


def test_the_binary_exits_2_with_the_flagfile_and_writes_nothing(tmp_path):
  imp, job = _import_dir(tmp_path), tmp_path / "job"
  out = subproc.run(subproc.main_cmd(
      "finetune.LlamaLoraImport", str(job), f"task.train.init_checkpoint_dir='{imp}'"),
      num_devices=1, timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  error = [l for l in out.stderr.splitlines() if l.startswith("spmdtask: config error:")]
  assert len(error) == 1 and f"pass --flagfile={imp}/model_overrides.txt" in error[0]
  assert "Traceback" not in out.stderr and not job.exists()


def test_chat_with_raw_prompt_or_without_a_template_or_empty_says_which_flag_to_drop():
  run = main.build(main.resolved_config("lm.TinyLm", []))
  with pytest.raises(ConfigError, match=r"--chat renders its question with the job's chat "
                     r"template and --raw_prompt asks for no template"):
    overrides.own_prompts(run, [], "What is 1 + 2?", True, "lm.TinyLm")
  with pytest.raises(ConfigError, match=r"--exp=lm.TinyLm has none: .* --prompt=TEXT "
                     r"--raw_prompt"):
    overrides.own_prompts(run, [], "What is 1 + 2?", False, "lm.TinyLm")
