"""Every user mistake is one ConfigError paragraph naming the field (table-driven, in-process),
and the binary turns it into exit status 2 without a traceback (a few subprocess checks)."""
import glob
import os

import pytest

import dataclasses
import shlex

import fiddle as fdl

from spmdtask.run import checkpoints, loop
from spmdtask import main, overrides
from spmdtask.core import program as program_lib
from spmdtask.errors import BatchSplitError, CheckpointUnreadable, ConfigError
from tests import subproc, util
from tools import prepare_text_data

M = "task.model"


def config_error(exp: str, overrides) -> str:
  """The ConfigError message of building `exp` with overrides and setting its program up."""
  with pytest.raises(ConfigError) as err:
    run = main.build(main.resolved_config(exp, list(overrides)))
    program_lib.setup(run.task, run.datasets["train"].batch_at(0))
  return str(err.value)


CASES = [
    ("lm.TinyLm", [f"{M}.num_kv_heads=3"], ["num_heads=4", "num_kv_heads=3", "divisor"]),
    ("lm.TinyLm", [f"{M}.head_dim=33"], [f"{M}.head_dim=33", "even"]),
    ("lm.TinyLm", [f"{M}.d_model=0"], [f"{M}.d_model=0", "positive"]),
    ("lm.TinyLm", [f"{M}.num_layers=-2"], [f"{M}.num_layers=-2", "positive"]),
    ("lm.TinyLm", [f"{M}.remat_policy='save_nothing'"], ["remat_policy", "nothing_saveable"]),
    ("lm.TinyLm", [f"{M}.fprop_dtype='float33'"], ["fprop_dtype", "bfloat16"]),
    ("lm.TinyLm", [f"{M}.mlp_activation='relu'"], ["mlp_activation", "swiglu"]),
    ("lm.TinyLm", [f"{M}.dropout_rate=1.5"], ["dropout_rate=1.5"]),
    ("lm.TinyLm", ["task.train.num_train_steps='abc'"], ["num_train_steps='abc'", "int"]),
    ("lm.TinyLm", [f"{M}.d_model=128.5"], [f"{M}.d_model=128.5", "int"]),
    ("lm.TinyLm", ["task.train.learning_rate=-1.0"], ["learning_rate=-1.0"]),
    ("lm.TinyLm", ["task.train.clip_grad_norm=-1.0"], ["clip_grad_norm=-1.0"]),
    ("lm.TinyLm", ["task.train.log_interval_steps=0"], ["log_interval_steps=0", "positive"]),
    ("lm.TinyLm", ["task.train.save_interval_steps=0"], ["save_interval_steps=0"]),
    ("lm.TinyLm", ["task.train.init_adapters='merged'"],
     ["task.train.init_adapters='merged'", "'merge'", "'continue'"]),
    ("lm.TinyLm", ["task.train.profile_steps=(0, 2)"], ["profile_steps=(0, 2)", "START"]),
    ("lm.TinyLm", ["task.train.num_microbatches=3"], ["num_microbatches=3"]),
    ("lm.TinyLm", ["task.decode.top_p=0.0"], ["task.decode.top_p=0.0"]),
    ("lm.TinyLm", ["task.decode.temperature=-1.0"], ["task.decode.temperature=-1.0"]),
    ("lm.TinyLm", ["task.decode.max_decode_len=0"], ["max_decode_len=0"]),
    ("lm.TinyLm", ["datasets['train'].batch_size='16'"], ["datasets['train'].batch_size"]),
    ("lm.TinyLm", [f"{M}.attention_impl='flash'"],
     [f"{M}.attention_impl='flash'", "auto, xla, splash, cudnn"]),
    ("lm.TinyLm", [f"{M}.attention_impl='cudnn'"], [f"{M}.attention_impl='cudnn'", "GPU"]),
    ("lm.TinyLm", [f"{M}.attention_impl='splash'"],  # TinyLm's 64 tokens: no splash block
     [f"{M}.attention_impl='splash'", "64", "multiple of 128"]),
    ("vit.TinyVit", [f"{M}.attention_impl='flash'"], [f"{M}.attention_impl='flash'"]),
    ("vit.TinyVit", [f"{M}.patch_size=5"], ["patch_size=5"]),
    ("vit.TinyVit", [f"{M}.num_classes=0"], [f"{M}.num_classes=0"]),
    # Mixture of Experts (TinyMoe: 8 experts over the `expert` axis of all 8 devices).
    ("TinyMoe", [f"{M}.moe.num_experts=6"], [f"{M}.moe.num_experts=6", "8 shards", "expert"]),
    ("TinyMoe", [f"{M}.moe.top_k=0"], [f"{M}.moe.top_k=0", "1 <= top_k <= 8"]),
    ("TinyMoe", [f"{M}.moe.top_k=9"], [f"{M}.moe.top_k=9", "1 <= top_k <= 8"]),
    ("TinyMoe", [f"{M}.moe.capacity_factor=0.0"], [f"{M}.moe.capacity_factor=0.0", "> 0"]),
    ("TinyMoe", [f"{M}.moe=None"], ["expert split on a dense model", f"{M}.moe is None"]),
    ("TinyMoe", [f"{M}.moe.score='relu'"], [f"{M}.moe.score='relu'", "softmax"]),
    ("TinyMoe", [f"{M}.moe.dispatch='sorted'"], [f"{M}.moe.dispatch='sorted'", "dropless"]),
    ("TinyMoe", [f"{M}.moe.first_moe_layer=4"], [f"{M}.moe.first_moe_layer=4"]),
    ("TinyMoe", [f"{M}.activation_split_dims_mapping.embed=(('data', 'fsdp'), None, None)"],
     ["expert_in[0]='expert'", "do not split the batch"]),
    # LoRA (TinyLmLora: every attention and MLP weight adapted).
    ("lm.TinyLmLora", [f"{M}.lora.rank=0"], [f"{M}.lora.rank=0", "> 0"]),
    ("lm.TinyLmLora", [f"{M}.lora.alpha=-1.0"], [f"{M}.lora.alpha=-1.0", "alpha > 0"]),
    ("lm.TinyLmLora", [f"{M}.lora.dropout=1.0"], [f"{M}.lora.dropout=1.0", "[0, 1)"]),
    ("lm.TinyLmLora", [f"{M}.lora.targets=('q', 'experts')"],
     ["'experts' matches no weight", "q, k, v, o, wi, wg, wo"]),
    ("lm.TinyLmLora", [f"{M}.lora.targets=('q_proj',)"], ["'q_proj' matches no weight"]),
]


@pytest.mark.parametrize("exp,overrides,needles", CASES)
def test_config_mistakes_name_the_field(exp, overrides, needles):
  message = config_error(exp, overrides)
  for needle in needles:
    assert needle in message, message


def test_token_ids_outside_the_vocabulary_are_an_error():
  run = util.build_run("lm.TinyLm", ["datasets['train'].vocab_size=300",
                                     "task.train.num_train_steps=1"])
  with pytest.raises(ConfigError, match=r"outside task.model.vocab_size=256"):
    loop.train(run)


def test_corrupt_checkpoint_names_its_step_and_an_earlier_one(tmp_path):
  # Steps 1 and 2 as training saves them (the fresh state: no train step to compile).
  program, state = util.program_and_state("lm.TinyLm", 8)
  saver = checkpoints.Checkpointer(str(tmp_path), program, 1, None)
  try:
    for step in (1, 2):
      saver.save(step, state, {"step": step})
  finally:
    saver.close()
  for f in glob.glob(str(tmp_path / "checkpoints" / "2" / "params" / "**" / "*"),
                     recursive=True):
    if os.path.isfile(f):
      with open(f, "wb") as out:
        out.write(b"garbage")
  with pytest.raises(CheckpointUnreadable) as err:
    checkpoints.restore_state(str(tmp_path), program)
  message = str(err.value)
  assert (err.value.step, err.value.intact_step) == (2, 1)
  assert "step 2" in message and "newest intact checkpoint is step 1" in message, message
  assert "Traceback" not in message


BINARY_CASES = [  # (--exp, an override, what the one error line says)
    ("lm.TinyLm", "task.train.num_train_steps='abc'", "task.train.num_train_steps='abc'"),
    ("lm.TinyLm", f"{M}.num_kv_heads=3", "num_kv_heads=3"),
    ("lm.TinyLm", f"{M}.remat_policy='offload_dot_with_no_batch_dims'",
     f"{M}.remat_policy='offload_dot_with_no_batch_dims' is a jax.checkpoint_policies factory"),
    ("lm.TinyLm", f"{M}.remat_policy='minimal_offload'",
     f"{M}.remat_policy='minimal_offload' is not a"),
    ("lm.TinyLm", f"{M}.attention_impl='flash'", f"{M}.attention_impl='flash'"),
    ("lm.TinyLmLora", f"{M}.lora.rank=0", f"{M}.lora.rank=0"),
    ("TinyMoe", f"{M}.moe.top_k=9", f"{M}.moe.top_k=9"),
]


def test_binary_exits_2_with_one_paragraph(tmp_path):
  """Each BINARY_CASES command line, run as the binary (one import of spmdtask.main for all,
  each in its own forked process: subproc.run_mains)."""
  jobs = [tmp_path / str(i) for i in range(len(BINARY_CASES))]
  outs = subproc.run_mains([subproc.main_cmd(exp, str(job), override)
                            for job, (exp, override, _) in zip(jobs, BINARY_CASES)])
  for job, (exp, override, needle), out in zip(jobs, BINARY_CASES, outs):
    case = f"{exp} {override}: {out.stderr[-2000:]}"
    assert out.returncode == 2, case
    assert "Traceback" not in out.stderr, case
    (line,) = [l for l in out.stderr.splitlines() if l.startswith("spmdtask: config error:")]
    assert needle in line, case
    assert not (job / "config.txt").exists()
    assert not (job / "checkpoints").exists()


def test_fdl_set_typo_names_the_closest_fields():
  message = config_error("lm.TinyLm", ["task.train.num_train_stepz=3"])
  assert "task.train has no field 'num_train_stepz'" in message, message
  assert "Did you mean task.train.num_train_steps" in message
  message = config_error("lm.TinyLm", ["datasets['trian'].batch_size=8"])
  assert "Did you mean datasets['train'].batch_size" in message, message


def test_a_train_batch_that_does_not_split_names_its_batch_size_first():
  run = util.build_run("lm.TinyLm", ["datasets['train'].batch_size=12"])
  with pytest.raises(BatchSplitError) as err:
    program_lib.setup(run.task, run.datasets["train"].batch_at(0))
  message = str(overrides.train_batch_error(err.value))
  assert message.startswith("datasets['train'].batch_size=12 does not divide over the data "
                            "axes (8 shards): make it a multiple of 8"), message
  assert "batch_size=16" in message


@dataclasses.dataclass
class _Picky:
  size: int
  big: tuple

  def __post_init__(self):
    if self.size < 0:
      raise ValueError(f"size={self.size} must be >= 0")


def test_a_build_error_names_the_field_not_every_argument():
  message = config_error("lm.TextLm", [])  # no data dir: the dataset's ConfigError
  assert message.startswith("datasets['train'].data_dir='' holds no meta.json"), message
  assert "--data_dir" in message and "Fiddle context" not in message
  assert "TransformerLm" not in message and len(message) < 400
  cfg = fdl.Config(dict, picky=fdl.Config(_Picky, size=-1, big=tuple(range(1000))))
  with pytest.raises(ValueError) as err:
    fdl.build(cfg)
  message = str(overrides.build_error(err.value))
  assert message.startswith("picky (_Picky) does not build: ValueError: size=-1 must be >= 0")
  assert "999" not in message, message


def test_prepare_hint_is_a_command_that_sets_every_data_dir(tmp_path):
  (tmp_path / "txt").mkdir()
  for i in range(25):  # 10 eval documents: lm.TextLm decodes 8 prompts
    (tmp_path / "txt" / f"{i}.txt").write_text(f"document {i} " * 40)
  out = str(tmp_path / "data")
  meta = prepare_text_data.prepare(str(tmp_path / "txt" / "*.txt"), out, "bytes",
                                   eval_fraction=0.4, num_shards=1)
  argv = shlex.split(prepare_text_data.train_command(out, meta))
  assert argv[:3] == ["python", "-m", "spmdtask.main"]
  args = dict(a[2:].split("=", 1) for a in argv[3:])
  assert set(args) <= set(main.flags.FLAGS) and args["data_dir"] == out
  run = main.build(main.resolved_config(args["exp"], [args["fdl_set"]], args["data_dir"]))
  dirs = [run.datasets["train"].data_dir, run.datasets["eval"].data_dir,
          run.decode_datasets["prompts"].data_dir]
  assert dirs == [out] * 3
  with pytest.raises(ConfigError, match="--data_dir='/x': no dataset of --exp=lm.TinyLm"):
    main.resolved_config("lm.TinyLm", [], "/x")
