"""The binary: config.txt, overrides, and a clear one-paragraph error for each user mistake."""
import os

from absl import flags
import pytest

from spmdtask import main
from tests import subproc

SPLIT = "task.model.weight_split_dims_mapping.mlp_in"


# spmdtask.main, then whether TensorFlow was ever imported (a synthetic-data run needs none).
MAIN_THEN_TF = """
import atexit, sys
from absl import app
from spmdtask import main
atexit.register(lambda: print("tensorflow imported:", "tensorflow" in sys.modules))
sys.argv = ["spmdtask.main"] + sys.argv[1:]
app.run(main.main)
"""


def test_train_writes_config_and_logs(tmp_path):
  cmd = subproc.main_cmd("lm.TinyLm", str(tmp_path), flags=[
      "--fdl_set=task.train.num_train_steps=4", "--fdl_set=task.train.log_interval_steps=2",
      "--fdl_set=task.train.summary_interval_steps=2", "--alsologtostderr"])
  out = subproc.run([cmd[0], "-c", MAIN_THEN_TF] + cmd[3:], timeout=300, forked=False)
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines()[-1] == "tensorflow imported: False"
  config = (tmp_path / "config.txt").read_text()
  assert "task.train.num_train_steps = 4" in config
  assert "task.model.d_model = 128" in config
  # The MFU is against a CPU's default peak, and the console says so.
  assert "MFU against 130 GFLOP/s per device (cpu: no chip facts" in out.stderr
  logged = [l for l in out.stderr.splitlines() if "loss" in l and "tokens/s" in l]
  assert [l.split("step ")[1].split()[0] for l in logged] == ["2/4", "4/4"]
  assert all(float(l.split("loss ")[1].split()[0]) > 0 for l in logged)
  assert all("% of 130 GFLOP/s" in l for l in logged)
  # TensorBoard events (tensorboard's own writer) with the loss and the MFU.
  written = subproc.scalars(str(tmp_path / "summaries" / "train"))
  for tag in ("loss", "mfu"):
    assert sorted(written[tag]) == [2, 4] and all(v > 0 for v in written[tag].values())
  mfu_in_line = float(logged[-1].split("MFU ")[1].split("%")[0])
  assert mfu_in_line == pytest.approx(100 * written["mfu"][4], abs=0.051)


# (flags, --exp, what the one error line must say)
BAD_INPUT = [
    (["--fdl_set=task.ici_mesh_shape=(2, 2, 4)"], "lm.TinyLm",
     ["task.ici_mesh_shape", "16 devices, but 8 are available"]),
    ([f"--fdl_set={SPLIT}=('fsdp', 'modle')"], "lm.TinyLm", [SPLIT, "'modle'"]),
    ([f"--fdl_set={SPLIT}=('fsdp',)"], "lm.TinyLm", [SPLIT, "rank 2"]),
    ([f"--fdl_set={SPLIT}=('model', 'model')"], "lm.TinyLm", [SPLIT, "more than one dim"]),
    (["--fdl_set=datasets['train'].batch_size=12"], "lm.TinyLm",
     ["datasets['train'].batch_size=12 does not divide", "inputs_split_mapping", "size 12",
      "multiple of 8"]),
    (["--fdl_set=task.train.inputs_split_mapping={'map_1d': ('data',)}"], "lm.TinyLm",
     ["task.train.inputs_split_mapping", "'map_2d'"]),
    ([], "lm.TinyLn", ["--exp='lm.TinyLn'", "configs.lm.TinyLm"]),
    (["--fdl_set=task.train.num_train_stepz=3"], "lm.TinyLm",
     ["--fdl_set='task.train.num_train_stepz=3'", "num_train_stepz"]),
    (["--fdl_set=task.train.num_train_steps=(3"], "lm.TinyLm",
     ["--fdl_set='task.train.num_train_steps=(3'", "Python literal"]),
    # Checked before JAX starts (jax.distributed.initialize raises a ValueError).
    (["--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=5"],
     "lm.TinyLm", ["--process_id=5 is not an index of --num_processes=2", "from 0 to 1"]),
    # GRPO: a prompt that leaves no room for the completion (found before anything compiles)
    (["--fdl_set=task.model.max_seq_len=6"], "TinyLmGrpo",
     ["task.objective.max_new_tokens=4", "task.model.max_seq_len=6", "at most 2"]),
    (["--mode=decode", "--fdl_set=decode_datasets['prompts'].tokenizer="
      "'sentencepiece:/nonexistent/tokenizer.model'"], "lm.TinyLm",
     ["decode_datasets['prompts'].tokenizer=", "no file '/nonexistent/tokenizer.model'"]),
    # A question for a job without a chat template (synthetic data, no tokenizer).
    (["--mode=decode", "--chat=What is 1 + 2?"], "lm.TinyLm",
     ["--chat='What is 1 + 2?'", "--exp=lm.TinyLm has none", "--prompt=TEXT --raw_prompt"]),
]


def test_bad_input_is_one_clear_paragraph(tmp_path):
  """Each BAD_INPUT command line, run as the binary (one import of spmdtask.main for all,
  each in its own forked process: subproc.run_mains), exits 2 with one error line."""
  cmds = [subproc.main_cmd(exp, str(tmp_path / str(i)), flags=args)
          for i, (args, exp, _) in enumerate(BAD_INPUT)]
  for i, ((args, exp, needles), out) in enumerate(zip(BAD_INPUT, subproc.run_mains(cmds))):
    case = f"{exp} {args}: {out.stderr[-2000:]}"
    assert out.returncode == 2, case
    assert "Traceback" not in out.stderr, case
    error = [l for l in out.stderr.splitlines() if l.startswith("spmdtask: config error:")]
    assert len(error) == 1, case
    for needle in needles:
      assert needle in error[0], case
    assert not (tmp_path / str(i) / "config.txt").exists()
    assert not (tmp_path / str(i) / "config_decode.txt").exists()


def test_restore_command_replaces_any_restore_step():
  argv = ["main.py", "--exp=lm.TinyLm", "--restore_step", "3",
          "--fdl_set=task.ici_mesh_shape=(2, 4)", "--restore_step=5"]
  assert main.restore_command(argv, 8) == (
      "python -m spmdtask.main --exp=lm.TinyLm '--fdl_set=task.ici_mesh_shape=(2, 4)' "
      "--restore_step=8")


def test_a_flag_absl_cannot_parse_is_one_paragraph():
  """The paragraph `parse_flags` prints (exit 2) for absl's own parse errors."""
  values = flags.FlagValues()
  flags.DEFINE_enum("mode", "train", ["train", "eval", "decode", "plan"], "", flag_values=values)
  flags.DEFINE_integer("restore_step", None, "", flag_values=values)
  with pytest.raises(flags.Error) as e:
    values(["main.py", "--mode=trian"])
  assert main.flag_error(e.value) == (
      "--mode='trian' is not one of its values: train, eval, decode, plan. Pass one of them, "
      "e.g. --mode=train (--helpshort describes each).")
  with pytest.raises(flags.Error) as e:
    values(["main.py", "--restore_stp=3"])
  assert main.flag_error(e.value).startswith(
      "Unknown command line flag 'restore_stp'. Did you mean: restore_step? Fix or remove")


def test_task_xla_flags_go_before_the_environments_own(monkeypatch):
  cfg = main.resolved_config("lm.TinyLm", [
      "task.xla_flags={'tpu': '--xla_tpu_scoped_vmem_limit_kib=98304', "
      "'gpu': '--xla_gpu_enable_latency_hiding_scheduler=true'}"])
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert main.use_xla_flags(cfg) == cfg.task.xla_flags
  # The environment's flag comes last: libtpu and XLA take the last value of a flag.
  assert os.environ["LIBTPU_INIT_ARGS"] == ("--xla_tpu_scoped_vmem_limit_kib=98304 "
                                            "--xla_tpu_scoped_vmem_limit_kib=65536")
  assert os.environ["XLA_FLAGS"] == ("--xla_gpu_enable_latency_hiding_scheduler=true "
                                     "--xla_force_host_platform_device_count=8")
  bad = main.resolved_config("lm.TinyLm", ["task.xla_flags={'cpu': '--x'}"])
  with pytest.raises(main.ConfigError, match="task.xla_flags has a key 'cpu'"):
    main.use_xla_flags(bad)


def test_a_start_without_a_checkpoint_is_exit_2_and_leaves_no_job_dir(tmp_path):
  """--init_from=DIR / task.train.init_checkpoint_dir of a dir without a checkpoint: one
  paragraph naming the field, before the job dir is made."""
  empty = tmp_path / "import"
  empty.mkdir()
  (empty / "model_overrides.txt").write_text("--family=llama\n")
  job = tmp_path / "job"
  cases = (("stages.Sft", [f"--init_from={empty}"], "(--init_from) holds no complete checkpoint"),
           ("lm.TinyLm", [f"--fdl_set=task.train.init_checkpoint_dir='{tmp_path}/gone'"],
            "holds no complete checkpoint"))
  runs = subproc.run_mains([subproc.main_cmd(exp, str(job), flags=f) for exp, f, _ in cases],
                           num_devices=1)
  for (_, _, field), r in zip(cases, runs):
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("spmdtask: config error: task.train.init_checkpoint_dir=") and \
        field in line, r.stderr[-2000:]
    assert not job.exists()
