"""One checkpoint dir's orbax manager and checked reads (used by `checkpoints` and
`lora_base`): which steps are complete, which step to restore, and a read of a step's items
that checks its files, its arrays' shapes and their fingerprints.

What a step's `params` item holds is in its `meta`: the whole params, or (HELD_KEY =
ADAPTERS, a LoRA job warm-started from a base: `lora_base`) the adapters alone; a read
takes the model's targets for what it holds.
"""
from typing import Any, Callable, Protocol

import jax
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint._src.metadata import array_metadata_store  # the default handler's

from spmdtask import console, fs
from spmdtask.core import sharding, train_state
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_check, fingerprints

ARRAY_ITEMS = ("params", "opt_state")
JSON_ITEMS = ("inputs", "meta")
COMMIT_FILE = "commit_success.txt"
HELD_KEY, ADAPTERS = "params_held", "adapters"  # meta[HELD_KEY]; absent: the whole params


class ArrayFormat(Protocol):
  """How a tier's manager writes and reads the array items (`params`, `opt_state`)."""

  def save_args(self, tree) -> ocp.args.CheckpointArgs: ...

  def restore_args(self, target) -> ocp.args.CheckpointArgs: ...


class Standard:
  """The job dir's format: orbax's StandardCheckpointHandler (one replica of each shard,
  written by the process that holds it into a directory every process sees)."""

  def save_args(self, tree) -> ocp.args.CheckpointArgs:
    return ocp.args.StandardSave(tree)

  def restore_args(self, target) -> ocp.args.CheckpointArgs:
    return ocp.args.StandardRestore(target)


STANDARD = Standard()

# orbax saves a replicated array replica-parallel: each replica transfers and writes a slice
# of it, cut by an eager slice op per replica (one program per slice shape). Worth it for a
# large array (transfers from many devices at once); for a small one the cutting costs more
# than it saves (on a tiny model, most of a save's CPU). Below this size a slice is not cut:
# one replica writes the whole array.
MIN_REPLICA_SLICE_BYTES = 1 << 20
ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES), override=True)


def agreed_alone(why: str | None) -> str | None:
  """The default `agree` of a read: a directory every process sees gives one answer."""
  return why


def checkpoint_dir(job_log_dir: str) -> str:
  return fs.join(fs.absolute(job_log_dir), "checkpoints")


def manager(directory: str, save_interval_steps: int = 1, max_to_keep: int | None = None,
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


def is_complete(step_dir: str) -> bool:
  names = set(fs.listdir(step_dir))
  return COMMIT_FILE in names and all(k in names for k in ARRAY_ITEMS + JSON_ITEMS)


def step_dirs(directory: str) -> dict[int, str]:
  return {int(n): fs.join(directory, n) for n in fs.listdir(directory) if n.isdigit()}


def complete_steps(directory: str) -> list[int]:
  """Sorted steps of committed checkpoints; warns about each incomplete step dir."""
  steps = []
  for step, path in sorted(step_dirs(directory).items()):
    if is_complete(path):
      steps.append(step)
    else:
      logging.warning("Checkpoint %s is incomplete (never committed, e.g. the job died during "
                      "its save); it is skipped.", path)
  return steps


def pick_step(directory: str, job_log_dir: str, step: int | None) -> int:
  steps = complete_steps(directory)
  if not steps:
    raise ConfigError(f"There is no complete checkpoint in job_log_dir={job_log_dir!r} (looked in "
                      f"{directory}). Train first (--mode=train), or pass the job_log_dir of a job "
                      "that saved checkpoints.")
  if step is None:
    latest = max(steps)
    if max(step_dirs(directory)) > latest:
      logging.warning("Restoring the latest complete checkpoint, step %d, in %s.", latest,
                      directory)
    return latest
  if step not in steps:
    raise ConfigError(f"--restore_step={step}: there is no complete checkpoint at step {step} in "
                      f"{directory}. Available steps: {steps}.")
  return step


def read_meta(mngr, step: int) -> dict:
  return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _flat_shapes(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {sharding.path_str(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves}


def _check_shapes(item: str, saved_metadata, expected, where: str) -> None:
  """ConfigError listing every variable whose shape/dtype differs, is missing or is extra."""
  saved = _flat_shapes(saved_metadata.tree if hasattr(saved_metadata, "tree")
                       else saved_metadata)
  want = _flat_shapes(expected)
  ranks = [sorted({v[0][-1] for k, v in t.items() if k.endswith(train_state.ADAPTER_SUFFIXES[0])})
           for t in (saved, want)]
  if item == "params" and all(len(r) == 1 for r in ranks) and ranks[0] != ranks[1]:
    raise ConfigError(
        f"task.model.lora.rank={ranks[1][0]}, the checkpoint's {ranks[0][0]} (at {where}): a "
        "job's adapters keep their rank. Resume with task.model.lora.rank="
        f"{ranks[0][0]} (--lora_rank={ranks[0][0]}), or train rank {ranks[1][0]} in a new "
        "--job_log_dir started from this job (--init_from=THIS_JOB merges its adapters in); "
        "nothing was changed.")
  count, shown = differences(saved, want, 20)
  if count:
    raise ConfigError(
        f"The checkpoint at {where} does not match this model's {item}: {count} mismatched "
        f"variable(s): {shown}.{attention_kind(saved, want)} Restore it with the model config "
        "it was trained with (see its config.txt), or point task.train.init_checkpoint_dir / "
        "--job_log_dir elsewhere.")


def attention_kind(saved: dict, want: dict) -> str:
  """A sentence where one side's attention is multi-head latent attention (a DeepSeek
  model's `attn/kv_up`) and the other's is not; else ''."""
  mla = [any(k.endswith("attn/kv_up") for k in t) for t in (saved, want)]
  if mla[0] == mla[1]:
    return ""
  ckpt, model = ("multi-head latent attention (DeepSeek: task.model.mla)", "multi-head "
                 "attention") if mla[0] else ("multi-head attention", "multi-head latent "
                                              "attention (DeepSeek: task.model.mla)")
  return f" The checkpoint's attention is {ckpt}, the model's {model}: another model family."


def differences(saved: dict[str, tuple], want: dict[str, tuple], most: int) -> tuple[int, str]:
  """(how many variables differ, the first `most` of them in words) between a checkpoint's
  and a model's {path: (shape, ...)} tables: another shape or dtype, missing, or extra."""
  def words(v):
    return " ".join(str(x) for x in v)
  bad = [f"{k}: checkpoint {words(saved[k])}, model {words(want[k])}"
         for k in sorted(saved.keys() & want.keys()) if saved[k] != want[k]]
  bad += [f"{k}: missing from the checkpoint" for k in sorted(want.keys() - saved.keys())]
  bad += [f"{k}: in the checkpoint, not in the model" for k in sorted(saved.keys() - want.keys())]
  more = f"; ... ({len(bad) - most} more)" if len(bad) > most else ""
  return len(bad), "; ".join(bad[:most]) + more


def restore(mngr, directory: str, program, step: int, items=ARRAY_ITEMS + JSON_ITEMS,
            own: bool = True, resume: bool = False, params_targets=None) -> dict[str, Any]:
  """The items of checkpoint `step` with its `meta` (`params_targets`: the params a warm
  start reads, as the step holds them; else what the step holds of the program's), checked;
  CheckpointUnreadable (ConfigError if not `own`) when damaged."""
  got, why = checked_read(mngr, directory, program, step, items, params_targets)
  if why:
    intact = next((s for s in sorted(complete_steps(directory), reverse=True) if s < step and
                   checked_read(mngr, directory, program, s, items, params_targets)[1] is None),
                  None)
    raise checkpoint_check.unreadable(directory, step, why, intact, own, resume)
  return got


def read_params(directory: str, step: int, program, targets, stored_fingerprints,
                advice: str = "Start from an intact copy of it, or from another of its steps."
                ) -> Any:
  """Some of checkpoint `step`'s params: `targets` (a subtree of them, sharded
  ShapeDtypeStructs in the dtypes stored) read with orbax's partial restore, each device
  reading only its own shards of these arrays, checked as `checked_read` checks a step,
  against `stored_fingerprints` (the step's meta's; None: unchecked). What a start too big
  to hold at once reads piece by piece (a QLoRA base, run.lora_base); ConfigError when
  damaged (its last sentence `advice`). Every process calls it."""
  def read():
    args = ocp.args.PyTreeRestore(
        item=targets, partial_restore=True,
        restore_args=ocp.checkpoint_utils.construct_restore_args(targets))
    with ocp.PyTreeCheckpointer() as checkpointer:
      return checkpointer.restore(fs.join(directory, str(step), "params"), args=args)
  got, why = _checked(directory, step, program, read,
                      lambda got: (stored_fingerprints, {"params": got}))
  if why:
    raise ConfigError(f"The checkpoint at step {step} in {directory} cannot be read: {why}. "
                      f"Nothing was changed. {advice}")
  return got


def checked_read(mngr, directory: str, program, step: int, items, params_targets=None,
                 fmt: ArrayFormat = STANDARD,
                 agree: Callable[[str | None], str | None] = agreed_alone,
                 mend: Callable[[dict], dict] = lambda got: got
                 ) -> tuple[dict[str, Any] | None, str | None]:
  """(the items of checkpoint `step` with its `meta`, None), or (None, why) when it is
  damaged: its metadata and file sizes (`checkpoint_check`, before any read), orbax's
  restore, or its arrays' fingerprints (when it has them) say so. `fmt`: how the tier
  wrote the arrays; `agree`: every process's answer made one (a tier whose processes each
  read their own directory: one damaged copy makes the step damaged for all); `mend`: what
  the read gives, completed before the check (the local tier's peer copies)."""
  return _checked(
      directory, step, program,
      lambda: mend(_read(mngr, directory, program, step,
                         tuple(k for k in items if k != "meta"), params_targets, fmt)),
      lambda got: (got["meta"].get(fingerprints.KEY),
                   {k: got[k] for k in ARRAY_ITEMS if k in items}), agree)


def _checked(directory: str, step: int, program, read: Callable[[], Any],
             fingerprinted: Callable[[Any], tuple[dict | None, dict]],
             agree: Callable[[str | None], str | None] = agreed_alone
             ) -> tuple[Any, str | None]:
  """(read(), None), or (None, why) when step `step` of `directory` is damaged: its
  metadata and file sizes (`checkpoint_check`, before any read), the read, or the
  fingerprints of what it read say so (`fingerprinted(got)`: the stored fingerprints,
  None for none, and the {item: tree} read). `agree` as `checked_read`'s."""
  why = agree(checkpoint_check.problem(fs.join(directory, str(step))))
  if why:
    return None, why
  # A failure ends the run (in the binary the hooks stay: orbax's reads still in flight report).
  with console.libraries_to_log():
    try:
      got, why = read(), None
    except ConfigError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # orbax, tensorstore, json, OS
      logging.info("Restoring %s/%d failed:", directory, step, exc_info=e)  # logs/ only
      got, why = None, checkpoint_check.read_failure(e)
  why = agree(why)
  if why:
    return None, why
  stored, arrays = fingerprinted(got)
  if stored is None:  # written before checkpoints carried fingerprints: unchecked
    return got, None
  why = fingerprints.mismatch(stored, fingerprints.of(arrays, program.mesh))
  return (None, why) if why else (got, None)


def _read(mngr, directory: str, program, step: int, items, params_targets=None,
          fmt: ArrayFormat = STANDARD) -> dict[str, Any]:
  """orbax's restore of `items` (and `meta`, read first: it says what the params hold) of
  `step`, after checking the arrays' shapes."""
  meta = read_meta(mngr, step)
  targets = program.canonical_targets()
  if meta.get(HELD_KEY) == ADAPTERS and params_targets is None:  # a LoRA job's own
    params_targets = train_state.adapters(targets.params)
  if params_targets is not None:
    targets = targets._replace(params=params_targets)
  metadata = mngr.item_metadata(step)
  for item in ARRAY_ITEMS:
    if item in items:
      _check_shapes(item, metadata[item], getattr(targets, item), f"{directory}/{step}")
  args = {k: fmt.restore_args(getattr(targets, k)) for k in ARRAY_ITEMS if k in items}
  args.update({k: ocp.args.JsonRestore() for k in JSON_ITEMS if k in items})
  got = mngr.restore(step, args=ocp.args.Composite(**args)) if args else {}
  return {**{k: got[k] for k in args}, "meta": meta}
