"""The spmdtask binary: `python -m spmdtask.main --exp=NAME --job_log_dir=DIR --mode=train`."""
# pylint: disable=wrong-import-position
import time

STARTED = time.time()  # the run's start, for its goodput account
if __name__ == "__main__":
  # C++ libraries print as they load (JAX's CUDA plugin on a machine without a GPU, at
  # `import jax`; TensorFlow's oneDNN notice): fds 1 and 2 are captured before any import
  # of them (console.setup then sends the capture to logs/native.log).
  from spmdtask import native_output
  native_output.capture()

import contextlib
import dataclasses
import functools
import os
import sys

from absl import app, flags, logging
import fiddle as fdl
from fiddle import printing
# Importing fiddle.absl_flags defines --fdl_set (repeatable path=value overrides).
from fiddle import absl_flags as _  # pylint: disable=unused-import
from fiddle._src.absl_flags import utils as fdl_flag_utils

from spmdtask import console, experiment, fs, overrides as overrides_lib, registry
from spmdtask import task as task_lib
from spmdtask.harness import command as lm_eval_command  # the --mode=lm_eval flags
from spmdtask.run import elastic, interrupts  # elastic: the --live_slices flag
from spmdtask.errors import (BatchSplitError, CheckpointUnreadable, ConfigError, Interrupted,
                             PlanExceeded, TrainingError, flag_error, rerun_command,
                             restore_command)

_EXP = flags.DEFINE_string("exp", None, "Experiment: a registered name, a unique dotted suffix "
                           "of one (lm.TinyLm), or an importable module.Class.")
_JOB_LOG_DIR = flags.DEFINE_string("job_log_dir", None, "Where config, logs, summaries, "
                                   "checkpoints and decoder output go.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "decode", "plan", "goodput",
                                           "lm_eval"],
                          "What to run; plan: the train step's memory / FLOPs / collectives, "
                          "compiled, not run (job_log_dir/plan.json); goodput: where the wall "
                          "time of --job_log_dir's training went (no --exp); lm_eval: "
                          "lm-evaluation-harness --tasks on a checkpoint (job_log_dir/lm_eval).")
_RESTORE_STEP = flags.DEFINE_integer("restore_step", None, "The checkpoint step of "
                                     "--job_log_dir to resume training from, or to evaluate / "
                                     "decode; default: the latest.")
_CONTINUOUS_EVAL = flags.DEFINE_bool("continuous_eval", False, "--mode=eval: wait for new "
                                     "checkpoints and evaluate each once, until the one at "
                                     "num_train_steps (or --continuous_eval_timeout_s idle).")
_EVAL_TIMEOUT = flags.DEFINE_float("continuous_eval_timeout_s", 3600.0, "Continuous eval ends "
                                   "after this long without a new checkpoint.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 of a multi-process job; needs "
    "--num_processes and --process_id. Every process runs the same command.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0-based.")
_MULTIHOST = flags.DEFINE_enum(
    "multihost", "auto", ["auto", "true", "false"], "Join a multi-process job found by JAX's "
    "own cluster detection (Cloud TPU pod, SLURM srun, Open MPI, Kubernetes JobSet): auto = "
    "when one is found, else one process; true = require one; false = never. Explicit "
    "--coordinator_address/--num_processes/--process_id win.")
_PLAN_DEVICES = flags.DEFINE_integer(
    "plan_devices", None, "--mode=plan: plan for this many devices, emulated on the CPU in a "
    "subprocess (no accelerator needed); default: the devices present.")
_PLAN_TOPOLOGY = flags.DEFINE_string(
    "plan_topology", None, "--mode=plan: plan for this TPU topology (libtpu's name, e.g. "
    "v5e:16x16, v6e:8x8, v4:4x4x4, v5p:4x4x8; needs libtpu: pip install 'spmdtask[tpu]') or "
    "GPUs (h100:8, h100:4x8; needs pip install 'spmdtask[gpu_plan]'), compiled on this "
    "machine; adds the roofline estimate.")
_PLAN_SLICES = flags.DEFINE_integer(
    "plan_slices", 1, "--mode=plan with --plan_topology: this many slices of that topology "
    "joined by DCN (task.dcn_mesh_shape must span them).")
_DEVICE_MEMORY_GIB = flags.DEFINE_float(
    "device_memory_gib", None, "--mode=plan: fail (exit 4), saying what fills a device and the "
    "fixes that apply, when the estimated peak memory of one device exceeds this many GiB "
    "(2**30 bytes: the unit plans print, and in which chips' HBM is given, e.g. 16 for a "
    "v5e); with --plan_topology the default is the chip's HBM.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", None, "Run on this many devices emulated on the host CPU (JAX's cpu "
    "platform, set before JAX starts), e.g. 8 to try an 8-device mesh on a laptop.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "Sets `data_dir` of every dataset and decode dataset that reads one "
    "(e.g. lm.TextLm's train, eval and prompts), before the --fdl_set overrides.")
_PROMPT = flags.DEFINE_multi_string(
    "prompt", None, "--mode=decode: answer this text (repeatable) instead of the decode "
    "datasets' prompts: a user message in the job's chat template where it has one, else "
    "continued; written to decoder_out/own_prompts_step<N>.jsonl and printed.")
_PROMPTS_FILE = flags.DEFINE_string(
    "prompts_file", None, "--mode=decode: a text file of prompts, one per line (with or "
    "instead of --prompt).")
_CHAT_PROMPTS = flags.DEFINE_string(
    "chat_prompts", None, "--mode=decode: a JSONL file of conversations ({\"messages\": [...]} "
    "a line) to answer, rendered with --data_dir's chat template; sets task.decode.eos_id to "
    "its end-of-turn token.")
_RAW_PROMPT = flags.DEFINE_bool(
    "raw_prompt", False, "--mode=decode: --prompt / --prompts_file texts through the "
    "tokenizer as written (no chat template), stopped at task.decode.eos_id.")
_CHAT = flags.DEFINE_string(
    "chat", None, "--mode=decode: ask this one question (a user message in the job's chat "
    "template: its chat data's, or its import's) and print the answer.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Start from this job dir: an import's (tools/convert_hf.py --from_hf) "
    "or a previous stage's, full or LoRA (its adapters merged in): its model_overrides.txt "
    "sets the model, and task.train.init_checkpoint_dir is it.")
_FAMILY = flags.DEFINE_string(
    "family", None, "The imported model's family (an import's model_overrides.txt sets it): "
    "the stage experiments (stages.Sft, stages.Dpo, stages.Grpo) build that family's model.")
_LORA_RANK = flags.DEFINE_integer(
    "lora_rank", None, "New LoRA adapters of this rank (alpha 2 x rank) on every weight LoRA "
    "can adapt; only they train. Default: every param trains.")
_REWARD = flags.DEFINE_multi_string(
    "reward", None, "GRPO: a reward, NAME[:WEIGHT] (registered) or PATH.py:FN[:WEIGHT] (a "
    "function (prompts, completions, answers) -> list[float] of your own file); repeatable, "
    "summed with the weights (default 1). Sets task.objective.rewards and reward_weights.")
_LIST = flags.DEFINE_bool("list_experiments", False, "Print the registered experiments by "
                          "group, each with its purpose, and exit.")


def resolved_config(exp_name: str, overrides: list[str], data_dir: str | None = None,
                    chat_prompts: str | None = None, reward: list[str] | None = None,
                    start: overrides_lib.Start | None = None,
                    lora_rank: int | None = None) -> fdl.Config:
  """The experiment's root config (a stage experiment on `start`'s family) with `data_dir`
  (--data_dir), `start`'s overrides (--init_from), `lora_rank`'s adapters, every `--fdl_set`
  override, `chat_prompts` (--chat_prompts: its eos_id wins over a flagfile's) and `reward`
  (--reward, over the experiment's rewards) applied, in order."""
  start = start or overrides_lib.Start(None, [])
  exp = _experiment(exp_name, start)
  cfg = experiment.run_config(exp)
  if data_dir is not None:
    overrides_lib.set_data_dirs(cfg, data_dir, exp_name)
  for assignment in start.overrides():
    _set(cfg, assignment)
  if lora_rank is not None:
    if not isinstance(exp, experiment.ForFamily):
      raise ConfigError(f"--lora_rank={lora_rank}: --exp={exp_name} is not a stage experiment "
                        "(stages.Sft, stages.Dpo, stages.Grpo); set its task.model.lora fields "
                        "with --fdl_set instead.")
    exp.with_lora(cfg, lora_rank)
  for assignment in overrides:
    _set(cfg, assignment)
  if chat_prompts is not None:
    overrides_lib.set_chat_prompts(cfg, chat_prompts, exp_name)
  if reward:
    overrides_lib.set_rewards(cfg, reward, exp_name)
  overrides_lib.check_import_flagfile(cfg, experiment.run_config(_experiment(exp_name, start)),
                                      exp_name)
  return cfg


def _experiment(exp_name: str, start: overrides_lib.Start) -> experiment.Experiment:
  """A fresh instance of the experiment (a stage experiment: on `start`'s family)."""
  exp = registry.get(exp_name)()
  return exp.for_family(start.family) if isinstance(exp, experiment.ForFamily) else exp


def _set(cfg: fdl.Config, assignment: str) -> None:
  """One `--fdl_set` override; ConfigError naming it where it sets no field or cannot."""
  if "=" not in assignment:
    raise ConfigError(f"--fdl_set={assignment!r} is not of the form path=value, e.g. "
                      "--fdl_set=task.train.num_train_steps=5.")
  overrides_lib.check_path(assignment, overrides_lib.field_paths(cfg))
  try:
    fdl_flag_utils.set_value(cfg, assignment)
  except Exception as e:  # fiddle raises several types for a bad path or value
    raise ConfigError(
        f"--fdl_set={assignment!r} could not be applied: {type(e).__name__}: {e}. The path "
        "starts at task, datasets or decode_datasets (see the resolved config in "
        "job_log_dir/config.txt, one `path = value` a line); the value is a Python literal "
        "(quote strings).") from None


def plan_emulated(num_devices: int) -> bool:
  """True in the subprocess that `plan.reexec_emulated` started for `num_devices` devices."""
  return os.environ.get("SPMDTASK_PLAN_DEVICES") == str(num_devices)


def use_cpu_devices(num_devices: int | None) -> None:
  """`--cpu_devices=N`: JAX runs on N emulated CPU devices (before its backends start)."""
  if num_devices is None:
    return
  if num_devices < 1:
    raise ConfigError(f"--cpu_devices={num_devices}: give a positive device count, e.g. "
                      "--cpu_devices=8.")
  if _PLAN_DEVICES.value:
    raise ConfigError("--cpu_devices and --plan_devices both emulate devices; --mode=plan "
                      "takes --plan_devices=N alone.")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", num_devices)


def use_xla_flags(cfg: fdl.Config) -> dict[str, str]:
  """`task.xla_flags` into LIBTPU_INIT_ARGS / XLA_FLAGS, before JAX starts its backends (the
  environment's own flags after them: where both give one, the environment's wins)."""
  by_kind = dict(cfg.task.xla_flags or {})
  task_lib.check_xla_flags(by_kind)
  for kind, line in by_kind.items():
    variable = task_lib.XLA_FLAG_VARIABLES[kind]
    os.environ[variable] = f"{line} {os.environ.get(variable, '')}".strip()
  return by_kind


def init_distributed():
  """Joins the multi-process job before any JAX computation, if one is asked for or found."""
  from spmdtask.run import cluster  # pylint: disable=g-import-not-at-top
  # The emulated-plan subprocess is a single process whatever cluster it runs in.
  multihost = "false" if os.environ.get("SPMDTASK_PLAN_DEVICES") else _MULTIHOST.value
  return cluster.join(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, multihost)


def build(cfg: fdl.Config):
  overrides_lib.check_field_types(cfg, "")
  try:
    run_cfg = fdl.build(cfg)
    run_cfg.task.validate()
    return run_cfg
  except (TypeError, ValueError) as e:  # ConfigError too: drop fiddle's argument reprs
    raise overrides_lib.build_error(e) from None


def run(argv) -> None:
  del argv
  if _LIST.value:
    print("\n".join(registry.listing()))
    return
  if _MODE.value == "goodput":  # reads the job dir: no --exp, no JAX
    from spmdtask.run import goodput  # pylint: disable=g-import-not-at-top
    if not _JOB_LOG_DIR.value:
      raise ConfigError("--mode=goodput needs --job_log_dir: the job dir of a training, e.g. "
                        "--mode=goodput --job_log_dir=/tmp/tinylm.")
    fs.check_reachable(_JOB_LOG_DIR.value, "--job_log_dir")
    print("\n".join(goodput.account(goodput.job_report(_JOB_LOG_DIR.value), _JOB_LOG_DIR.value)))
    return
  if not _EXP.value or not _JOB_LOG_DIR.value:
    raise ConfigError("Both --exp and --job_log_dir are required, e.g. "
                      "--exp=lm.TinyLm --job_log_dir=/tmp/tinylm.")
  fs.check_reachable(_JOB_LOG_DIR.value, "--job_log_dir")  # fail fast, before JAX starts
  if _PLAN_TOPOLOGY.value and _PLAN_DEVICES.value:
    raise ConfigError("--plan_topology and --plan_devices both name the devices to plan for: "
                      "give one (a TPU topology, or N emulated CPU devices).")
  if (_PLAN_TOPOLOGY.value or _PLAN_DEVICES.value) and _MODE.value != "plan":
    raise ConfigError("--plan_topology / --plan_devices only apply to --mode=plan.")
  if ((_PROMPT.value or _PROMPTS_FILE.value or _CHAT_PROMPTS.value or _CHAT.value
       or _RAW_PROMPT.value) and _MODE.value != "decode"):
    raise ConfigError("--prompt / --prompts_file / --chat / --raw_prompt / --chat_prompts only "
                      "apply to --mode=decode.")
  lm_eval_command.check_mode(_MODE.value)
  if _MODE.value == "plan" and _PLAN_TOPOLOGY.value:
    # JAX itself stays on the CPU (no TPU client, even where libtpu finds no chip): the
    # topology's devices are compile-only, from libtpu loaded as a plugin.
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_platforms", "cpu")
  use_cpu_devices(_CPU_DEVICES.value)
  start = overrides_lib.start_of(_INIT_FROM.value, _FAMILY.value)
  cfg = resolved_config(_EXP.value, flags.FLAGS.fdl_set or [], _DATA_DIR.value,
                        _CHAT_PROMPTS.value, _REWARD.value, start, _LORA_RANK.value)
  xla_flags = use_xla_flags(cfg)
  joined = init_distributed()
  backend_log = console.init_backends()
  if joined is not None:
    from spmdtask.run import peers  # pylint: disable=g-import-not-at-top
    peers.watch(_JOB_LOG_DIR.value, rerun_command(sys.argv))  # a lost one stops the others
  run_cfg, elastic_line = elastic.asked(build(cfg), planning=_MODE.value == "plan")
  if _MODE.value == "decode":  # your prompts' mistakes refused before the job dir is touched
    from spmdtask.run import decoding  # pylint: disable=g-import-not-at-top
    texts = decoding.read_prompts(_PROMPT.value, _PROMPTS_FILE.value)
    if texts or _CHAT.value is not None:
      run_cfg = overrides_lib.own_prompts(run_cfg, texts, _CHAT.value, _RAW_PROMPT.value, _EXP.value)
  from spmdtask.run import checkpoints, joblock  # pylint: disable=g-import-not-at-top
  config_text = printing.as_str_flattened(cfg, include_types=False) + "\n"
  init_dir = run_cfg.task.train.init_checkpoint_dir
  if _MODE.value == "train" and init_dir and not fs.isdir(
      checkpoints.checkpoint_dir(_JOB_LOG_DIR.value)):  # a new job: its start must be there
    overrides_lib.check_start(init_dir)
  checkpoints.ensure_writable(_JOB_LOG_DIR.value)
  # One training per job dir, held before anything (the log included) is written there.
  with (joblock.held(_JOB_LOG_DIR.value) if _MODE.value == "train"
        else contextlib.nullcontext()) as took_over:
    console.setup(_JOB_LOG_DIR.value, console.verbose_flags_given())
    if joined is not None:
      from spmdtask.run import cluster  # pylint: disable=g-import-not-at-top
      console.say("%s", cluster.describe(joined))
    for line in filter(None, (took_over, elastic_line)):  # a lock taken over, fewer slices
      console.say("%s", line)
    for kind, line in xla_flags.items():
      console.say("XLA flags for %s (task.xla_flags, in %s): %s", kind,
                  task_lib.XLA_FLAG_VARIABLES[kind], line)
    if backend_log:
      logging.info("While JAX initialized its backends: %s", backend_log)
    import jax  # pylint: disable=g-import-not-at-top
    if _MODE.value == "train" and start.family and jax.process_index() == 0:
      fs.write_text(fs.join(_JOB_LOG_DIR.value, overrides_lib.OVERRIDES_FILE),  # next stage's
                    start.file_text(flags.FLAGS.fdl_set or []))
    run_mode(run_cfg, config_text)


def run_mode(run_cfg, config_text: str) -> None:
  """--mode's work, once the console is set up (and, for train, the job dir locked)."""
  import jax  # pylint: disable=g-import-not-at-top
  from spmdtask.run import loop, rollout_plan  # pylint: disable=g-import-not-at-top
  if _MODE.value == "train":
    # Writes config.txt itself, once the checkpoint (if any) proved compatible.
    loop.train(run_cfg, job_log_dir=_JOB_LOG_DIR.value, restore_step=_RESTORE_STEP.value,
               config_text=config_text, name=_EXP.value, started=STARTED,
               hooks=lm_eval_command.train_hooks(run_cfg, _JOB_LOG_DIR.value))
    return
  if _MODE.value == "plan":
    from spmdtask.plan import planner as plan  # pylint: disable=g-import-not-at-top
    plan.run_plan(run_cfg, _JOB_LOG_DIR.value, _EXP.value, _PLAN_DEVICES.value,
                  _DEVICE_MEMORY_GIB.value, _PLAN_TOPOLOGY.value, _PLAN_SLICES.value,
                  *rollout_plan.plan_inputs(run_cfg))  # GRPO: its batch, its sampling programs
    return
  if jax.process_index() == 0:  # the training job's config.txt stays as it was
    fs.write_text(fs.join(_JOB_LOG_DIR.value, f"config_{_MODE.value}.txt"), config_text)
  if _MODE.value == "lm_eval":
    return lm_eval_command.run(run_cfg, _JOB_LOG_DIR.value, _RESTORE_STEP.value)
  run_eval_or_decode(run_cfg, _JOB_LOG_DIR.value)


def run_eval_or_decode(run_cfg, job_log_dir: str) -> None:
  """--mode=eval / --mode=decode on the checkpoints of `job_log_dir`."""
  # pylint: disable-next=g-import-not-at-top
  from spmdtask.run import checkpoints, decoding, evaluation, reference, rollout
  from spmdtask.core import host_input as inputs_base, program as program_lib
  task = decoding.decode_task(run_cfg.task) if _MODE.value == "decode" else run_cfg.task
  example = (evaluation.example(run_cfg, rollout.example) if _MODE.value == "eval"
             else rollout.example(run_cfg))  # GRPO: a rollout's batch
  program = program_lib.setup(task, example)
  program = reference.attach(task, program) if _MODE.value == "eval" else program
  restore = functools.partial(checkpoints.restore_state, job_log_dir, program)  # (step)
  if _MODE.value == "decode":
    decoding.run_decode(run_cfg, program, restore, job_log_dir, _RESTORE_STEP.value)
  else:
    run_cfg = dataclasses.replace(run_cfg, datasets=inputs_base.reading_all(
        run_cfg.datasets, program.input_share()))
    evaluation.run_eval(
        run_cfg, program, restore, job_log_dir, _RESTORE_STEP.value, _CONTINUOUS_EVAL.value,
        available=lambda: checkpoints.complete_steps(checkpoints.checkpoint_dir(job_log_dir)),
        timeout_s=_EVAL_TIMEOUT.value)


def reexec_for_plan() -> None:
  """--mode=plan --plan_devices=N reruns the command with N emulated devices, and exits."""
  if _MODE.value == "plan" and _PLAN_DEVICES.value and not plan_emulated(_PLAN_DEVICES.value):
    from spmdtask.plan import planner as plan  # pylint: disable=g-import-not-at-top
    sys.exit(plan.reexec_emulated(_PLAN_DEVICES.value, sys.argv))  # XLA_FLAGS before jax


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, where a bad flag is a config error (exit 2, one paragraph) rather
  than absl's FATAL line (exit 1)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"spmdtask: config error: {flag_error(e)}", file=sys.stderr, flush=True)
    sys.exit(2)


def _fail(message: str, status: int, log: bool = False) -> None:
  """Ends the run with one message on stderr (held library warnings first)."""
  if log:
    logging.info("%s", message)  # into job_log_dir/logs too
  logging.flush()
  console.show_held_records()
  console.libraries_to_log()  # what they print while the process ends
  print(message, file=sys.stderr, flush=True)
  sys.exit(status)


def main(argv) -> None:
  reexec_for_plan()  # before the console setup: the rerun sets up its own
  console.start(console.verbose_flags_given())
  interrupts.watch()
  try:
    run(argv)
  except BatchSplitError as e:
    _fail(f"spmdtask: config error: {overrides_lib.train_batch_error(e)}", 2)
  except CheckpointUnreadable as e:
    restore = ("" if e.intact_step is None else
               f" Restore it with:\n  {restore_command(sys.argv, e.intact_step)}")
    _fail(f"spmdtask: config error: {e}{restore}", 2)
  except ConfigError as e:
    _fail(f"spmdtask: config error: {e}", 2)
  except TrainingError as e:
    _fail(f"spmdtask: training stopped: {e}", 3, log=True)
  except PlanExceeded as e:
    _fail(f"spmdtask: plan: {e}", 4)
  except Interrupted as e:
    _fail(interrupts.after_ctrl_c() + str(e), 130, log=True)
  except KeyboardInterrupt:
    _fail(interrupts.after_ctrl_c() + "Interrupted; exiting.", 130, log=True)
  except Exception as e:  # pylint: disable=broad-except
    from spmdtask.run import peers  # pylint: disable=g-import-not-at-top
    peers.stop_if_lost(e)  # a lost process ends the job in one line (exit 5)
    raise


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
