"""A job's params in and out of its checkpoints, through spmdtask's checkpoint module (the
one place that knows the checkpoint layout), for a model given as an experiment and its
override lines.
"""
import fiddle as fdl
import jax

from spmdtask import main
from spmdtask.core import program as program_lib
from spmdtask.hf import trees
from spmdtask.run import checkpoints


def program(lines: list[str], exp: str):
  """The program of `exp` with the override `lines`; ConfigError for a model they cannot
  build (e.g. a LoRA rank above a weight's dims), before anything is written."""
  run = fdl.build(main.resolved_config(exp, lines))
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def write_checkpoint(job_log_dir: str, lines: list[str], params: dict, prog) -> None:
  """A step-0 train state of `prog` (`program(lines, exp)`) with `params` (logical) and
  a fresh optimizer state."""
  # In the model's dtypes (a LoRA model may store its frozen base in bfloat16).
  targets = prog.canonical_targets().params
  if trees.covers(params, targets):  # every weight given: no random init to replace
    state = program_lib.fresh_state(prog, trees.filled(params, targets))
  else:  # adapters `params` lacks (a new LoRA) keep their fresh init (PEFT's: B = 0)
    canonical = prog.to_canonical(prog.init())
    params = trees.filled(params, jax.device_get(canonical.params))
    state = prog.from_canonical(canonical._replace(params=params))
  ckpt = checkpoints.Checkpointer(job_log_dir, prog, 1, None,
                                  {"config": "\n".join(lines) + "\n"})
  ckpt.save(0, state, None)
  ckpt.close()


def read_checkpoint(job_log_dir: str, lines: list[str], exp: str) -> dict:
  """The logical params of the latest checkpoint of `job_log_dir` (its model: `exp` with
  the override `lines`), as numpy."""
  return latest(job_log_dir, lines, exp)[0]


def latest(job_log_dir: str, lines: list[str], exp: str) -> tuple[dict, int]:
  """(`read_checkpoint`'s params, the checkpoint's step)."""
  prog = program(lines, exp)
  state, step = checkpoints.restore_state(job_log_dir, prog)
  return jax.device_get(prog.to_canonical(state).params), step
