"""A job's params in and out of its checkpoints, through spmdtask's checkpoint module (the
one place that knows the checkpoint layout), for a model given as an experiment and its
override lines.
"""
import fiddle as fdl
import jax
import numpy as np

from spmdtask import main
from spmdtask.core import program as program_lib, train_state
from spmdtask.errors import ConfigError
from spmdtask.hf import convert, trees
from spmdtask.run import checkpoints, fingerprints, streamed_checkpoint


def program(lines: list[str], exp: str):
  """The program of `exp` with the override `lines`; ConfigError for a model they cannot
  build (e.g. a LoRA rank above a weight's dims), before anything is written."""
  run = fdl.build(main.resolved_config(exp, lines))
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def prepared(lines: list[str], params: dict, prog) -> dict:
  """What `write_prepared` writes: a step-0 state of `prog` (`program(lines, exp)`) with
  `params` (logical: `convert.Leaf`s or arrays, every weight; a new LoRA's adapters may be
  missing: they take the model's fresh init, PEFT's B = 0) in the model's dtypes, and a
  fresh optimizer state, each array made one HF tensor at a time
  (`run.streamed_checkpoint`). Reads every tensor once (the fingerprints): an unreadable
  input fails here, before anything is written."""
  targets = prog.canonical_targets().params
  opt_state = streamed_checkpoint.fresh_opt_state(prog)
  if opt_state is None:  # the optimizer's init reads the weights: the state made whole
    params = trees.copy(params, np.asarray)
    if trees.covers(params, targets):  # every weight given: no random init to replace
      state = program_lib.fresh_state(prog, trees.filled(params, targets))
    else:
      canonical = prog.to_canonical(prog.init())
      params = trees.filled(params, jax.device_get(canonical.params))
      state = prog.from_canonical(canonical._replace(params=params))
    canonical = jax.device_get(prog.to_canonical(state))
    arrays = {"params": canonical.params, "opt_state": canonical.opt_state}
  else:
    adapters = {}
    if not trees.covers(params, targets):  # new adapters: the model's init (on the devices)
      adapters = jax.device_get(train_state.adapters(prog.to_canonical(prog.init()).params))
    arrays = {"params": _stored(params, targets, adapters), "opt_state": opt_state}
  meta = {"step": 0, **checkpoints.meta_of(prog, {"config": "\n".join(lines) + "\n"}),
          fingerprints.KEY: streamed_checkpoint.fingerprinted(arrays)}
  return {"arrays": arrays, "meta": meta}


def write_prepared(job_log_dir: str, ready: dict) -> None:
  """Writes `prepared`'s step 0 into the job's checkpoints/."""
  streamed_checkpoint.write(checkpoints.checkpoint_dir(job_log_dir), ready["arrays"],
                            ready["meta"])


def write_checkpoint(job_log_dir: str, lines: list[str], params: dict, prog) -> None:
  """`prepared` then `write_prepared`: step 0 of `prog` with `params`."""
  write_prepared(job_log_dir, prepared(lines, params, prog))


def _stored(params: dict, targets: dict, adapters: dict) -> dict:
  """`params` as `targets` store them (their dtypes), `Leaf`s streamed; a missing adapter
  from `adapters`."""
  out = {}
  for key, want in targets.items():
    if isinstance(want, dict):
      out[key] = _stored(params.get(key, {}), want, adapters.get(key, {}))
      continue
    x = params[key] if key in params else adapters[key]
    if tuple(np.shape(x)) != tuple(want.shape):
      raise ConfigError(f"The converted weight {key!r} is {list(np.shape(x))}, the model's "
                        f"{list(want.shape)}: config.json and the tensors disagree.")
    if isinstance(x, convert.Leaf):
      out[key] = streamed_checkpoint.cast(
          streamed_checkpoint.Streamed(x.shape, x.dtype, x.chunk, x.blocks), want.dtype)
    else:
      out[key] = np.asarray(x).astype(want.dtype)
  return out


def read_checkpoint(job_log_dir: str, lines: list[str], exp: str) -> dict:
  """The logical params of the latest checkpoint of `job_log_dir` (its model: `exp` with
  the override `lines`), as numpy."""
  return latest(job_log_dir, lines, exp)[0]


def latest(job_log_dir: str, lines: list[str], exp: str) -> tuple[dict, int]:
  """(`read_checkpoint`'s params, the checkpoint's step)."""
  prog = program(lines, exp)
  state, step = checkpoints.restore_state(job_log_dir, prog)
  return jax.device_get(prog.to_canonical(state).params), step
