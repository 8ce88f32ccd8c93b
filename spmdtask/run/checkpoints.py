"""Checkpoints: an orbax CheckpointManager under `job_log_dir/checkpoints/`.

A checkpoint step dir holds four orbax items:
  params, opt_state  the train state in the CANONICAL layout (`program.Program`): logical
                     (unpadded) arrays, layers stacked [L, ...], whatever the mesh and
                     the pipeline strategy that trained them (StandardSave); a LoRA job
                     warm-started from a base holds only the adapters in `params`, and
                     restores read its frozen params from that base (`lora_base`);
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

With a local tier (`local_tier`: frequent saves to each host's own disk), the job dir is
the persistent tier, saved every `save_interval_steps`, at the end of training and, without
a local tier, on a stop; the local tier is saved every `local_save_interval_steps` and on a
stop (SIGTERM, Ctrl-C: the fastest tier). A resume takes the newest complete step of either
tier: local steps newer than the persistent tier's newest are tried newest first (checked as
above, and only if they belong to this job and its layout); one that fails is deleted and
the next is tried, down to the persistent tier. The console names the tier and step.
"""
import os
import time

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp
from absl import logging

from spmdtask import console, fs
from spmdtask.core import program as program_lib, sharding, train_state
from spmdtask.errors import ConfigError
from spmdtask.run import (checkpoint_check, elastic, fingerprints, goodput_events, local_tier,
                          lora_base, quantized_base)
from spmdtask.run import checkpoint_io as io
from spmdtask.run.checkpoint_io import (  # pylint: disable=unused-import  # the module's API
    ARRAY_ITEMS, COMMIT_FILE, checkpoint_dir, complete_steps)
from spmdtask.core.train_state import TrainState


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


# ---------------------------------------------------------------- restores

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
  step = io.pick_step(directory, job_log_dir, step)
  mngr = io.manager(directory, read_only=True)
  try:
    got = io.restore(mngr, directory, program, step, ARRAY_ITEMS)
  finally:
    mngr.close()
  frozen = quantized_base.read(job_log_dir, program, lora_base.Base.of(got["meta"]))
  return _live(program, step, lora_base.whole_params(program, got, frozen),
               got["opt_state"]), step


def read_meta(job_log_dir: str, step: int | None = None) -> dict:
  """The `meta` item (step, config, layout facts) of a checkpoint; the latest by default."""
  directory = checkpoint_dir(job_log_dir)
  step = io.pick_step(directory, job_log_dir, step)
  mngr = io.manager(directory, read_only=True)
  try:
    return io.read_meta(mngr, step)
  finally:
    mngr.close()


def warm_start(init_dir: str, program, init_adapters: str = "merge") -> TrainState:
  """`program`'s step-0 state with params from the latest checkpoint of job `init_dir` and a
  fresh optimizer state. A LoRA model takes its frozen params from it (`run.lora_base`), its
  adapters fresh."""
  return _warm_start(init_dir, program, init_adapters)[0]


def _warm_start(init_dir: str, program, init_adapters: str = "merge"
                ) -> tuple[TrainState, lora_base.Base | None]:
  """(warm_start's state, the base a LoRA model's checkpoints then name, else None). A LoRA
  job's checkpoint in `init_dir` starts the model with its adapters merged in
  (`lora_base.read`), or, with `init_adapters` 'continue', a LoRA model with those adapters
  on the start's own base. Only new adapters (a LoRA model on a merged start) take the
  program's random init; otherwise the start's params are every weight, and the state is
  built from them alone (`program.fresh_state`: no random init to replace)."""
  lora = train_state.adapters_only(program.model)
  keep = init_adapters == "continue"
  if keep and not lora:
    raise ConfigError("task.train.init_adapters='continue' trains the start's own LoRA "
                      "adapters, and this model has none: give it LoRA of the start's rank "
                      "(--lora_rank=R), or leave init_adapters 'merge'.")
  base, params = lora_base.read(init_dir, program, merge=not keep)
  logging.info("Warm start: params from %s step %d; fresh optimizer state.", init_dir,
               base.step)
  base = base if lora else None  # a LoRA model's saves name the base
  targets = program.canonical_targets().params
  if lora and not keep:  # new adapters: the model's fresh init (PEFT's: B = 0)
    canonical = program.to_canonical(program.init())
    return _live(program, 0, lora_base.merged(canonical.params, params),
                 canonical.opt_state), base
  adapters = None
  if keep:
    adapters = train_state.adapters(params)
    _check_adapters(adapters, train_state.adapters(targets), init_dir)
  # In the model's dtypes (`merged`); every leaf the start's, so no init to replace.
  return program_lib.fresh_state(program, lora_base.merged(targets, params, adapters)), base


def _check_adapters(start, model, init_dir: str) -> None:
  """ConfigError where the start's adapters are not the model's (none, or other shapes)."""
  shapes = [{sharding.path_str(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
            for t in (start, model)]
  if shapes[0] != shapes[1]:
    rank = {k.split("/")[-1]: v[-1] for k, v in shapes[0].items() if k.endswith("_lora_a")}
    have = f"rank {sorted(set(rank.values()))[0]}" if rank else "no adapters"
    raise ConfigError(
        f"task.train.init_adapters='continue', but task.train.init_checkpoint_dir={init_dir!r} "
        f"holds {have} on other weights or of another rank than this model's adapters: give "
        "the model the start's LoRA (its config.txt's task.model.lora), or leave "
        "init_adapters 'merge' (new adapters on the start merged).")


def meta_of(program, metadata: dict | None = None) -> dict:
  """What every step's `meta` of a job of `program` holds beside the step, what its
  params hold and their fingerprints: the layout's facts, device and process counts,
  `metadata` (e.g. the config text) and a LoRA model's scale."""
  meta = {**program.layout_facts(), "device_count": jax.device_count(),
          "process_count": jax.process_count(), **(metadata or {})}
  if train_state.adapters_only(program.model):  # what a stage starting here merges by
    meta[lora_base.SCALE_KEY] = program.model.lora.scale
  return meta


class Checkpointer:
  """Saves and restores one job's train state, input position and metadata. A LoRA job
  warm-started from a base (`base`, set by `initial_state` or by the restored checkpoint's
  meta) saves only the adapters with their optimizer state; restores read the frozen params
  from the base (`lora_base.whole_params`).

  Args:
    job_log_dir: checkpoints go to `job_log_dir/checkpoints/`.
    program: the `program.Program` whose state is saved.
    save_interval_steps: save when `step % save_interval_steps == 0` (and when forced).
    max_to_keep: the newest checkpoints kept; None = all.
    metadata: JSON-able extras stored in `meta` (e.g. {'config': resolved config text}).
    record: times the restores, saves and the wait for the last save (goodput).
    local: the local tier, or None (the job dir is then the only tier).
  """

  def __init__(self, job_log_dir: str, program, save_interval_steps: int,
               max_to_keep: int | None, metadata: dict | None = None,
               record: goodput_events.Recorder = goodput_events.OFF,
               local: local_tier.LocalTier | None = None):
    self.job_log_dir, self.program, self.record = job_log_dir, program, record
    self.local = local
    self.directory = checkpoint_dir(job_log_dir)
    self.interval = max(1, save_interval_steps)
    self._mngr = io.manager(self.directory, self.interval, max_to_keep)
    self._meta = meta_of(program, metadata)
    self.save_seconds: list[float] = []  # blocking part of each save
    self.checked: set[int] = set()  # steps written by this run or whose fingerprints matched
    # What the saves hold: the whole params, or (a LoRA job warm-started from a base, known
    # once the start state is) the adapters alone, the base named in `meta`.
    self.base: lora_base.Base | None = None
    self._quantized = quantized_base.Saver(job_log_dir, program)  # a QLoRA base's copy

  def latest_step(self) -> int | None:
    """The newest complete step of either tier (collective with a local tier)."""
    steps = complete_steps(self.directory) + (self.local.job_steps() if self.local else [])
    return max(steps) if steps else None

  def restore(self, step: int | None = None) -> tuple[TrainState, int, dict | None]:
    """(padded state, step, input iterator state) of a checkpoint of this job."""
    with self.record.phase("restore"):
      return self._restore(step)

  def _restore(self, step: int | None) -> tuple[TrainState, int, dict | None]:
    if self.local is not None:
      if step is None:
        got, step = self.local.newest(self.program, complete_steps(self.directory))
        if got is not None:
          self._drop_incomplete()
          return self._resumed(got, step, f"the local tier ({self.local.directory})")
      state, step, inputs = self._restore_persistent(step)
      self.local.drop([s for s in self.local.complete_steps() if s > step])
      return state, step, inputs
    return self._restore_persistent(step)

  def _restore_persistent(self, step: int | None) -> tuple[TrainState, int, dict | None]:
    step = io.pick_step(self.directory, self.job_log_dir, step)
    later = [s for s in complete_steps(self.directory) if s > step]
    # Later steps are checked as a restore checks them (newest first), and moved aside only
    # when all are damaged.
    intact = next((s for s in reversed(later) if io.checked_read(
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
    got = io.restore(self._mngr, self.directory, self.program, step, resume=True)
    return self._resumed(got, step, self.directory if self.local is None else
                         f"the persistent tier ({self.directory})")

  def _resumed(self, got: dict, step: int, where: str) -> tuple[TrainState, int, dict | None]:
    """The restore's result from a checked read `got` of `step` in `where`."""
    self.base = lora_base.Base.of(got["meta"])
    if fingerprints.KEY in got["meta"]:
      self.checked.add(step)
    say = console.say if self.local is not None else logging.info
    say("Restored step %d from %s (saved on mesh %s; %s).", step, where,
        dict(zip(got["meta"]["mesh_axis_names"], got["meta"]["mesh_shape"])),
        "fingerprints checked" if step in self.checked else "no fingerprints: unchecked")
    frozen = quantized_base.read(self.job_log_dir, self.program, self.base)
    params = lora_base.whole_params(self.program, got, frozen)
    return _live(self.program, step, params, got["opt_state"]), step, got["inputs"]

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
    for step, path in io.step_dirs(self.directory).items():
      if not io.is_complete(path):
        logging.warning("Removing incomplete checkpoint %s.", path)
        fs.rm(path, recursive=True)
    with console.libraries_to_log():
      self._mngr.reload()

  def reached_preemption(self, step: int) -> bool:
    """JAX's multi-host preemption sync point: True at the same step on every process."""
    return self._mngr.reached_preemption(step)

  def should_save(self, step: int) -> bool:
    """Whether either tier saves at `step` (a step the loop must check before saving)."""
    return step % self.interval == 0 or (self.local is not None and self.local.should_save(step))

  def save(self, step: int, state: TrainState, input_state: dict | None, last: bool = False,
           stop: bool = False) -> None:
    """Starts an async save of `state` (padded) at `step`; returns once arrays are copied.
    Without a local tier it goes to the job dir. With one: to the job dir at its interval
    and at the `last` step unless that is a `stop` (preemption, Ctrl-C), and to the local
    tier at its interval and on a stop."""
    local = self.local is not None and (self.local.should_save(step) or stop)
    persistent = (self.local is None or step % self.interval == 0 or (last and not stop))
    if stop and local and fs.exists(fs.join(self.directory, elastic.GROW_STOP_FILE)):
      # a shrunk job stopped to grow back: its new processes hold no local copy
      local, persistent = self.local.should_save(step), True
    with self.record.phase("save"):
      self._save(step, state, input_state, persistent, local)

  def _save(self, step: int, state: TrainState, input_state: dict | None,
            persistent: bool = True, local: bool = False) -> None:
    t0 = time.perf_counter()
    logical = self.program.to_canonical(state)
    held = {}
    if self.base is not None:  # the frozen params stay in the base
      held = {lora_base.META_KEY: self.base.record(), io.HELD_KEY: io.ADAPTERS}
    arrays = {"params": train_state.adapters(logical.params) if held else logical.params,
              "opt_state": logical.opt_state}
    meta = {"step": int(step), **self._meta, **held,
            fingerprints.KEY: fingerprints.of(arrays, self.program.mesh)}  # before the copy
    if persistent:
      args = ocp.args.Composite(**{k: io.STANDARD.save_args(v) for k, v in arrays.items()},
                                inputs=ocp.args.JsonSave(input_state or {}),
                                meta=ocp.args.JsonSave(meta))
      self._mngr.save(step, args=args, force=True)
      if self.base is not None:
        self._quantized.save(self.base, logical.params)
    if local:
      self.local.save(step, arrays, input_state or {}, meta)
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
    self._quantized.wait()
    if self.local is not None:
      self.local.wait()

  def close(self) -> None:
    """Waits for the last save; closes the manager (its threads end). Idempotent."""
    if self._mngr is not None:
      mngr, self._mngr = self._mngr, None
      try:
        with self.record.phase("save"):
          mngr.wait_until_finished()
          self._quantized.wait()
          if self.local is not None:
            self.local.wait()
      finally:
        mngr.close()
        self._quantized.close()
        if self.local is not None:
          self.local.close()


def initial_state(ckpt: Checkpointer | None, program, inputs, restore_step: int | None = None,
                  init_checkpoint_dir: str | None = None, init_adapters: str = "merge"
                  ) -> TrainState:
  """The padded state a train run starts from, with `inputs` positioned to match.

  Resumes from this job's checkpoint (`restore_step`, else the latest complete one) when
  there is one; else a fresh init, with params from `init_checkpoint_dir` when given (a
  LoRA model's frozen params: then `ckpt`'s saves hold only the adapters and name that base).
  """
  if ckpt is not None and (restore_step is not None or ckpt.latest_step() is not None):
    state, _, input_state = ckpt.restore(restore_step)
    if input_state and hasattr(inputs, "set_state"):
      inputs.set_state(input_state)
    return state
  if not init_checkpoint_dir:
    return program.init()
  state, base = _warm_start(init_checkpoint_dir, program, init_adapters)
  if ckpt is not None:
    ckpt.base = base
  return state
