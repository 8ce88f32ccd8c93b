"""Checkpoints: an orbax CheckpointManager under `job_log_dir/checkpoints/`.

A checkpoint step dir holds four orbax items:
  params, opt_state  the train state in the CANONICAL layout (`program.Program`): logical
                     (unpadded) arrays, layers stacked [L, ...], whatever the mesh and
                     the pipeline strategy that trained them (StandardSave);
  inputs             the train input iterator's state (JsonSave);
  meta               step, resolved config text, the saving layout's facts (mesh,
                     pipeline, microbatches), device/process count, and the arrays'
                     `fingerprints`, computed on the devices before the save.
Because the arrays are canonical, a restore onto any mesh, device count or pipeline
strategy works: they are read with shardings of the new mesh, then converted to the
new live layout by `program.from_canonical`. Every process calls save/restore (orbax
coordinates); JSON items are written by the primary process.

A step dir counts as complete when orbax committed it (`commit_success.txt`, every
item dir present). Incomplete ones are never restored: the previous complete step is
used, with a warning. A committed one that is damaged is not used: its files (told from
its metadata and file sizes before any restore: `checkpoint_check`), orbax's restore, or
the restored arrays' fingerprints (recomputed on the devices and compared with the stored
ones, before the first step) say so. CheckpointUnreadable names the file or array and the
newest intact step (checked the same way, only then); training from that step with
--restore_step moves the damaged later steps into `checkpoints_unreadable/` (nothing is
deleted). A checkpoint written before fingerprints existed restores as before, unchecked.
"""
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp
from absl import logging

from spmdtask import console, fs
from spmdtask.core import sharding, train_state
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_check, fingerprints, lora_base
from spmdtask.core.train_state import TrainState

ARRAY_ITEMS = ("params", "opt_state")
JSON_ITEMS = ("inputs", "meta")
COMMIT_FILE = "commit_success.txt"


def checkpoint_dir(job_log_dir: str) -> str:
  return fs.join(fs.absolute(job_log_dir), "checkpoints")


def ensure_writable(job_log_dir: str) -> None:
  """Creates job_log_dir (process 0) and checks it is writable; ConfigError if not."""
  if jax.process_index() != 0:
    return
  probe = fs.join(job_log_dir, f".write_probe_{os.getpid()}")
  try:
    fs.makedirs(job_log_dir)
    fs.write_text(probe, "ok")
    fs.rm(probe)
  except Exception as e:  # pylint: disable=broad-except  # OSError, or gcsfs' HTTP errors
    raise ConfigError(
        f"--job_log_dir={job_log_dir!r} is not a writable directory ({type(e).__name__}: "
        f"{getattr(e, 'strerror', None) or e}). Pass a directory you can create and write "
        "to; config.txt, checkpoints/ and summaries/ go there.") from None


def _manager(directory: str, save_interval_steps: int = 1, max_to_keep: int | None = None,
             read_only: bool = False) -> ocp.CheckpointManager:
  handlers = {**{k: ocp.StandardCheckpointHandler() for k in ARRAY_ITEMS},
              **{k: ocp.JsonCheckpointHandler() for k in JSON_ITEMS}}
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=0 if read_only else max(1, save_interval_steps),
      max_to_keep=max_to_keep,
      create=not read_only, read_only=read_only, cleanup_tmp_directories=not read_only,
      enable_async_checkpointing=True)
  with console.libraries_to_log():  # orbax logs a damaged step's metadata bytes
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _is_complete(step_dir: str) -> bool:
  names = set(fs.listdir(step_dir))
  return COMMIT_FILE in names and all(k in names for k in ARRAY_ITEMS + JSON_ITEMS)


def _step_dirs(directory: str) -> dict[int, str]:
  return {int(n): fs.join(directory, n) for n in fs.listdir(directory) if n.isdigit()}


def complete_steps(directory: str) -> list[int]:
  """Sorted steps of committed checkpoints; warns about each incomplete step dir."""
  steps = []
  for step, path in sorted(_step_dirs(directory).items()):
    if _is_complete(path):
      steps.append(step)
    else:
      logging.warning("Checkpoint %s is incomplete (never committed, e.g. the job died during "
                      "its save); it is skipped.", path)
  return steps


# ---------------------------------------------------------------- layouts and conversions

def _flat_shapes(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {sharding.path_str(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves}


def _check_shapes(item: str, saved_metadata, expected, where: str) -> None:
  """ConfigError listing every variable whose shape/dtype differs, is missing or is extra."""
  saved = _flat_shapes(saved_metadata.tree if hasattr(saved_metadata, "tree")
                       else saved_metadata)
  want = _flat_shapes(expected)
  bad = [f"{k}: checkpoint {saved[k][0]} {saved[k][1]}, model {want[k][0]} {want[k][1]}"
         for k in sorted(saved.keys() & want.keys()) if saved[k] != want[k]]
  bad += [f"{k}: missing from the checkpoint" for k in sorted(want.keys() - saved.keys())]
  bad += [f"{k}: in the checkpoint, not in the model" for k in sorted(saved.keys() - want.keys())]
  if bad:
    shown = "; ".join(bad[:20]) + (f"; ... ({len(bad) - 20} more)" if len(bad) > 20 else "")
    raise ConfigError(
        f"The checkpoint at {where} does not match this model's {item}: {len(bad)} mismatched "
        f"variable(s): {shown}. Restore it with the model config it was trained with (see its "
        "config.txt), or point task.train.init_checkpoint_dir / --job_log_dir elsewhere.")


def _pick_step(directory: str, job_log_dir: str, step: int | None) -> int:
  steps = complete_steps(directory)
  if not steps:
    raise ConfigError(f"There is no complete checkpoint in job_log_dir={job_log_dir!r} (looked in "
                      f"{directory}). Train first (--mode=train), or pass the job_log_dir of a job "
                      "that saved checkpoints.")
  if step is None:
    latest = max(steps)
    if max(_step_dirs(directory)) > latest:
      logging.warning("Restoring the latest complete checkpoint, step %d, in %s.", latest,
                      directory)
    return latest
  if step not in steps:
    raise ConfigError(f"--restore_step={step}: there is no complete checkpoint at step {step} in "
                      f"{directory}. Available steps: {steps}.")
  return step


def _restore(mngr, directory: str, program, step: int, items=ARRAY_ITEMS + JSON_ITEMS,
             own: bool = True, resume: bool = False, params_targets=None) -> dict[str, Any]:
  """The items of checkpoint `step` (`params_targets`: what params to read, else the
  program's), checked; CheckpointUnreadable (ConfigError if not `own`) when damaged."""
  got, why = _checked_read(mngr, directory, program, step, items, params_targets)
  if why:
    intact = next((s for s in sorted(complete_steps(directory), reverse=True) if s < step and
                   _checked_read(mngr, directory, program, s, items, params_targets)[1] is None),
                  None)
    raise checkpoint_check.unreadable(directory, step, why, intact, own, resume)
  return got


def _checked_read(mngr, directory: str, program, step: int, items, params_targets=None
                  ) -> tuple[dict[str, Any] | None, str | None]:
  """(the items of checkpoint `step` with its `meta`, None), or (None, why) when it is
  damaged: its metadata and file sizes (`checkpoint_check`, before any read), orbax's
  restore, or its arrays' fingerprints (when it has them) say so."""
  why = checkpoint_check.problem(fs.join(directory, str(step)))
  if why:
    return None, why
  # A failure ends the run (in the binary the hooks stay: orbax's reads still in flight report).
  with console.libraries_to_log():
    try:
      got = _read(mngr, directory, program, step, tuple(dict.fromkeys((*items, "meta"))),
                  params_targets)
    except ConfigError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # orbax, tensorstore, json, OS
      logging.info("Restoring %s/%d failed:", directory, step, exc_info=e)  # logs/ only
      return None, checkpoint_check.read_failure(e)
  stored = got["meta"].get(fingerprints.KEY)
  if stored is None:  # written before checkpoints carried fingerprints: unchecked
    return got, None
  why = fingerprints.mismatch(stored, fingerprints.of(
      {k: got[k] for k in ARRAY_ITEMS if k in items}, program.mesh))
  return (None, why) if why else (got, None)


def _read(mngr, directory: str, program, step: int, items, params_targets=None) -> dict[str, Any]:
  """orbax's restore of `items` of `step`, after checking the arrays' shapes."""
  targets = program.canonical_targets()
  if params_targets is not None:
    targets = targets._replace(params=params_targets)
  metadata = mngr.item_metadata(step)
  for item in ARRAY_ITEMS:
    if item in items:
      _check_shapes(item, metadata[item], getattr(targets, item), f"{directory}/{step}")
  args = {k: ocp.args.StandardRestore(getattr(targets, k)) for k in ARRAY_ITEMS if k in items}
  args.update({k: ocp.args.JsonRestore() for k in JSON_ITEMS if k in items})
  return mngr.restore(step, args=ocp.args.Composite(**args))


def _live(program, step: int, params, opt_state) -> TrainState:
  canonical = TrainState(jnp.asarray(step, program.canonical.logical.step.dtype), params,
                         opt_state)
  return program.from_canonical(canonical)


def restore_state(job_log_dir: str, program, step: int | None = None) -> tuple[TrainState, int]:
  """The LIVE (padded) train state of a checkpoint, placed on `program.mesh`, and its step.

  Args:
    job_log_dir: the job whose `checkpoints/` to read.
    program: a `program.Program`; its mesh, layout and pipeline may differ from the
      saving job's.
    step: a checkpoint step; None = the latest complete one.
  Raises:
    ConfigError: no complete checkpoint; `step` not available (lists the steps); the
      checkpoint's variables do not match the model (names them); or it cannot be read
      (CheckpointUnreadable).
  """
  directory = checkpoint_dir(job_log_dir)
  step = _pick_step(directory, job_log_dir, step)
  mngr = _manager(directory, read_only=True)
  try:
    got = _restore(mngr, directory, program, step, ARRAY_ITEMS)
  finally:
    mngr.close()
  return _live(program, step, got["params"], got["opt_state"]), step


def read_meta(job_log_dir: str, step: int | None = None) -> dict:
  """The `meta` item (step, config, layout facts) of a checkpoint; the latest by default."""
  directory = checkpoint_dir(job_log_dir)
  step = _pick_step(directory, job_log_dir, step)
  mngr = _manager(directory, read_only=True)
  try:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  finally:
    mngr.close()


def warm_start(init_dir: str, program, state: TrainState) -> TrainState:
  """`state` with params from the latest checkpoint of job `init_dir`; opt state kept fresh.
  A LoRA model takes its frozen params from it (`run.lora_base`), its adapters fresh."""
  fs.check_reachable(init_dir, "task.train.init_checkpoint_dir")
  directory = checkpoint_dir(init_dir)
  step = _pick_step(directory, init_dir, None)
  mngr = _manager(directory, read_only=True)
  lora = train_state.adapters_only(program.model)
  try:
    targets = lora_base.targets(program.canonical_targets().params,
                                mngr.item_metadata(step)["params"], init_dir) if lora else None
    params = _restore(mngr, directory, program, step, ("params",), own=False,
                      params_targets=targets)["params"]
  finally:
    mngr.close()
  logging.info("Warm start: params from %s step %d; fresh optimizer state.", directory, step)
  fresh = jax.device_get(state.step)
  canonical = program.to_canonical(state)
  if lora:
    params = lora_base.merged(canonical.params, params)
  return _live(program, int(fresh), params, canonical.opt_state)


class Checkpointer:
  """Saves and restores one job's train state, input position and metadata.

  Args:
    job_log_dir: checkpoints go to `job_log_dir/checkpoints/`.
    program: the `program.Program` whose state is saved.
    save_interval_steps: save when `step % save_interval_steps == 0` (and when forced).
    max_to_keep: the newest checkpoints kept; None = all.
    metadata: JSON-able extras stored in `meta` (e.g. {'config': resolved config text}).
  """

  def __init__(self, job_log_dir: str, program, save_interval_steps: int,
               max_to_keep: int | None, metadata: dict | None = None):
    self.job_log_dir, self.program = job_log_dir, program
    self.directory = checkpoint_dir(job_log_dir)
    self.interval = max(1, save_interval_steps)
    self._mngr = _manager(self.directory, self.interval, max_to_keep)
    self._meta = {**program.layout_facts(), "device_count": jax.device_count(),
                  "process_count": jax.process_count(), **(metadata or {})}
    self.save_seconds: list[float] = []  # blocking part of each save
    self.checked: set[int] = set()  # steps written by this run or whose fingerprints matched

  def latest_step(self) -> int | None:
    steps = complete_steps(self.directory)
    return max(steps) if steps else None

  def restore(self, step: int | None = None) -> tuple[TrainState, int, dict | None]:
    """(padded state, step, input iterator state) of a checkpoint of this job."""
    step = _pick_step(self.directory, self.job_log_dir, step)
    later = [s for s in complete_steps(self.directory) if s > step]
    # Later steps are checked as a restore checks them (newest first), and moved aside only
    # when all are damaged.
    intact = next((s for s in reversed(later) if _checked_read(
        self._mngr, self.directory, self.program, s, ARRAY_ITEMS)[1] is None), None)
    if intact is not None:
      raise ConfigError(
          f"--restore_step={step}, but {self.directory} has a later intact checkpoint, step "
          f"{intact}; training on would overwrite it. Omit --restore_step to resume from the "
          "latest, or train in a new --job_log_dir with task.train.init_checkpoint_dir set to "
          "this job.")
    if later:
      self._move_aside(later)
    self._drop_incomplete()
    got = _restore(self._mngr, self.directory, self.program, step, resume=True)
    self._meta.update({k: v for k, v in got["meta"].items() if k == lora_base.META_KEY})
    if fingerprints.KEY in got["meta"]:
      self.checked.add(step)
    logging.info("Restored step %d from %s (saved on mesh %s; %s).", step, self.directory,
                 dict(zip(got["meta"]["mesh_axis_names"], got["meta"]["mesh_shape"])),
                 "fingerprints checked" if step in self.checked else "no fingerprints: unchecked")
    return _live(self.program, step, got["params"], got["opt_state"]), step, got["inputs"]

  def _move_aside(self, steps: list[int]) -> None:
    """Moves the unreadable checkpoints `steps` into `aside_dir` (process 0), so training
    from an earlier step can save those steps anew; nothing is deleted."""
    aside = checkpoint_check.aside_dir(self.directory)
    if jax.process_index() == 0:
      for step in steps:
        dest = fs.join(aside, str(step))
        if fs.exists(dest):  # moved aside before: keep both
          dest += time.strftime("-%Y%m%d-%H%M%S")
        fs.move(fs.join(self.directory, str(step)), dest)
      console.say("Moved the unreadable checkpoint%s at step %s into %s/ (nothing deleted).",
                  "s" if len(steps) > 1 else "", ", ".join(map(str, steps)), aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("spmdtask_unreadable_moved")
    with console.libraries_to_log():
      self._mngr.reload()

  def _drop_incomplete(self) -> None:
    """Removes uncommitted step dirs so a new save of that step can happen (process 0)."""
    if jax.process_index() != 0:
      return
    for step, path in _step_dirs(self.directory).items():
      if not _is_complete(path):
        logging.warning("Removing incomplete checkpoint %s.", path)
        fs.rm(path, recursive=True)
    with console.libraries_to_log():
      self._mngr.reload()

  def reached_preemption(self, step: int) -> bool:
    """JAX's multi-host preemption sync point: True at the same step on every process."""
    return self._mngr.reached_preemption(step)

  def should_save(self, step: int) -> bool:
    return step % self.interval == 0

  def save(self, step: int, state: TrainState, input_state: dict | None) -> None:
    """Starts an async save of `state` (padded) at `step`; returns once arrays are copied."""
    t0 = time.perf_counter()
    logical = self.program.to_canonical(state)
    arrays = {"params": logical.params, "opt_state": logical.opt_state}
    fingerprinted = fingerprints.of(arrays, self.program.mesh)  # before orbax's copy
    args = ocp.args.Composite(
        **{k: ocp.args.StandardSave(v) for k, v in arrays.items()},
        inputs=ocp.args.JsonSave(input_state or {}),
        meta=ocp.args.JsonSave({"step": int(step), **self._meta,
                                fingerprints.KEY: fingerprinted}))
    self._mngr.save(step, args=args, force=True)
    self.checked.add(step)
    self.save_seconds.append(time.perf_counter() - t0)

  def latest_checked(self) -> tuple[int | None, bool]:
    """(the latest complete step or None, whether its bytes were checked: written by this
    run or its fingerprints matched on restore), once the save in flight is committed."""
    self.wait()
    step = self.latest_step()
    return step, step in self.checked

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    """Waits for the last save; closes the manager (its threads end). Idempotent."""
    if self._mngr is not None:
      mngr, self._mngr = self._mngr, None
      try:
        mngr.wait_until_finished()
      finally:
        mngr.close()


def initial_state(ckpt: Checkpointer | None, program, inputs, restore_step: int | None = None,
                  init_checkpoint_dir: str | None = None) -> TrainState:
  """The padded state a train run starts from, with `inputs` positioned to match.

  Resumes from this job's checkpoint (`restore_step`, else the latest complete one) when
  there is one; else a fresh init, with params from `init_checkpoint_dir` when given.
  """
  if ckpt is not None and (restore_step is not None or ckpt.latest_step() is not None):
    state, _, input_state = ckpt.restore(restore_step)
    if input_state and hasattr(inputs, "set_state"):
      inputs.set_state(input_state)
    return state
  state = program.init()
  if init_checkpoint_dir:
    state = warm_start(init_checkpoint_dir, program, state)
    if ckpt is not None and train_state.adapters_only(program.model):  # its ckpts name the base
      ckpt._meta[lora_base.META_KEY] = lora_base.record(  # pylint: disable=protected-access
          init_checkpoint_dir, max(complete_steps(checkpoint_dir(init_checkpoint_dir))),
          program.canonical.logical.params)
  return state
