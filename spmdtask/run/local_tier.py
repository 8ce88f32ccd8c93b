"""The local checkpoint tier: frequent saves to each host's own disk or RAM disk.

The persistent tier (`checkpoints`, the job dir, often a bucket) is written seldom; this
tier is written every `task.train.local_save_interval_steps` into
`local_checkpoint_dir/spmdtask-<job key>/<host>_<rank>/` (`slot_name`: the process's host
and its rank among the job's processes there), one directory per process that holds only
that process's shards (orbax's array handler with no primary host: each process
writes every shard its devices hold; JSON items are written by every process into its own
directory). A step counts as complete when every process committed it (agreed across
processes), so a host that lost its disk makes the step unusable for all. Shards stay
where their devices were: a local step restores onto the layout that saved it, or onto any
other whose devices on each process need only blocks of the arrays that process wrote
(each step's `meta` lists them: `HELD_KEY`). That is how a job shrunk onto the slices left
(`run.elastic`) resumes from its newest local step: where the state is replicated across
slices (a data axis over DCN), every surviving slice holds a whole copy.

Where it is sharded across slices (FSDP over DCN), each process also writes a peer copy:
the blocks its counterpart on the next slice holds (`run.peer_copies`: the `PEER_ITEM`
item, its blocks in `PEER_KEY`). One lost slice then loses no block: a survivor restores
what it needs from its own blocks, filling the rest from its peer copy.
Any other restore reads the persistent tier.

The job key is a hash of the job dir's path, and each step's `meta` names the job dir and
the job's `job_id` (a token the job dir keeps in `checkpoints/local_tier_job_id`): a local
step of another job, or of an earlier job in a deleted and re-made job dir, is never
restored. The tier is a cache of the persistent one: steps that are not usable are deleted
when a restore meets them, and steps past the one a run restored are deleted before it
trains on.
"""
import copy
import hashlib
import os
import re
import socket
import uuid

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_utils, type_handlers

from spmdtask import console, fs
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_io as io, fingerprints, peer_copies

FIELD = "task.train.local_checkpoint_dir"
JOB_ID_FILE = "local_tier_job_id"
LAYOUT_KEYS = ("mesh_shape", "mesh_axis_names", "device_count", "process_count")
HELD_KEY = "held_blocks"  # meta: {"item/array/path": [[[start, stop] per dim] per block]}
PEER_KEY = "peer_blocks"  # meta: as HELD_KEY, of the peer copies (PEER_ITEM, in key order)
PEER_ITEM = "peer"
MOVED = ("; a local step restores onto another layout only where each process's devices "
         "need only blocks it wrote, itself or as a peer copy (restore from the persistent "
         "tier, the job dir)")


class _OwnBlocks(type_handlers.ArrayHandler):
  """orbax's array handler, reading a chunk its directory lacks as the fill value: a read
  onto another layout may ask for blocks this process did not write, which its peer copies
  fill (`peer_copies.filled`). Damage still shows: every restored array's fingerprint is checked."""

  async def deserialize(self, infos, args=None):
    infos = [copy.copy(info) for info in infos]
    for info in infos:
      info.raise_array_data_missing_error = False
    return await super().deserialize(infos, args)


class PerProcess:
  """Arrays written shard by shard by the process that holds them, none skipped as a
  replica: each process's directory then holds everything its devices need."""

  def __init__(self, multiprocessing: ocp.options.MultiprocessingOptions):
    self.multiprocessing = multiprocessing
    self.registry = type_handlers.create_type_handler_registry(
        (jax.Array, _OwnBlocks(primary_host=None, replica_id=None, use_replica_parallel=False)))

  def handler(self) -> ocp.PyTreeCheckpointHandler:
    return ocp.PyTreeCheckpointHandler(use_ocdbt=True,
                                       multiprocessing_options=self.multiprocessing,
                                       type_handler_registry=self.registry)

  def save_args(self, tree) -> ocp.args.CheckpointArgs:
    return ocp.args.PyTreeSave(tree)

  def restore_args(self, target) -> ocp.args.CheckpointArgs:
    return ocp.args.PyTreeRestore(target, restore_args=checkpoint_utils.construct_restore_args(
        target))


def ensure_writable(local_dir: str) -> None:
  """ConfigError (naming the field), on every process, unless every process can create and
  write `local_dir`."""
  why = _unwritable(local_dir)
  bad = _all_agree(int(why is not None))
  if bad.any():
    why = why or f"process {int(np.argmax(bad))} cannot write it; see its log"
    raise ConfigError(
        f"{FIELD}={local_dir!r} is not a writable directory on this host ({why}). Give a "
        "directory on each host's local disk or RAM disk that the job can create and write "
        "(e.g. /dev/shm/spmdtask or /tmp/spmdtask), or None for no local tier.")


def _unwritable(local_dir: str) -> str | None:
  """Why this process cannot create and write `local_dir`, or None."""
  try:
    if fs.is_remote(local_dir):
      raise OSError(f"{local_dir!r} is a URL, not a path on this host's disk")
    os.makedirs(local_dir, exist_ok=True)
    probe = os.path.join(local_dir, f".write_probe_{os.getpid()}")
    with open(probe, "w", encoding="utf-8") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    return f"{type(e).__name__}: {e.strerror or e}"
  return None


def _job_id(job_log_dir: str) -> str:
  """The job dir's token (made by process 0 on first use); every process reads it."""
  path = fs.join(io.checkpoint_dir(job_log_dir), JOB_ID_FILE)
  if jax.process_index() == 0 and not fs.exists(path):
    fs.makedirs(io.checkpoint_dir(job_log_dir))
    fs.write_text(path, uuid.uuid4().hex)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("spmdtask_local_tier_job_id")
  return fs.read_text(path).strip()


def slot_name(hosts, index: int) -> str:
  """The local directory of process `index` of a job whose processes run on `hosts` (host
  names, in process order): its host and its rank among the job's processes there. A host
  keeps it when a restart renumbers the processes (the slices before it lost), so its
  survivors find the local steps they wrote; on one machine it follows the process order."""
  host = re.sub(r"[^A-Za-z0-9.-]", "-", hosts[index]) or "host"
  return f"{host}_{sum(h == hosts[index] for h in hosts[:index])}"


def _hosts() -> list[str]:
  """Every process's host name, in process order (collective)."""
  name = socket.gethostname()
  if jax.process_count() == 1:
    return [name]
  raw = np.zeros(256, np.uint8)
  encoded = name.encode()[:256]
  raw[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  every = np.asarray(multihost_utils.process_allgather(raw)).reshape(-1, 256)
  return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]


def _all_agree(value: int) -> np.ndarray:
  """Every process's `value`, in process order."""
  if jax.process_count() == 1:
    return np.asarray([value])
  return np.asarray(multihost_utils.process_allgather(np.asarray(value, np.int64)))


class LocalTier:
  """One job's local tier on this process: saves, complete steps, checked reads.

  Args:
    local_dir: the host-local root (`task.train.local_checkpoint_dir`).
    job_log_dir: the job; its path and token tie the local steps to it.
    interval: save when `step % interval == 0`.
    max_to_keep: the newest local steps kept.
    dcn: the job's mesh axes' DCN sizes (name -> `task.dcn_mesh_shape`'s): where the mesh
      spans slices, arrays sharded across them get peer copies (`peer_copies`).
  Every process must call every method (the saves, the step agreement and the reads are
  collective).
  """

  def __init__(self, local_dir: str, job_log_dir: str, interval: int, max_to_keep: int,
               dcn: dict[str, int] | None = None):
    ensure_writable(local_dir)
    job = fs.absolute(job_log_dir)
    key = hashlib.sha256(job.encode()).hexdigest()[:16]
    self.directory = os.path.join(os.path.abspath(local_dir), f"spmdtask-{key}",
                                  slot_name(_hosts(), jax.process_index()))
    os.makedirs(self.directory, exist_ok=True)
    self.root, self.interval, self.max_to_keep = local_dir, interval, max_to_keep
    self.dcn = dcn or {}
    self.job = {"job_log_dir": job, "job_id": _job_id(job_log_dir)}
    mp = ocp.options.MultiprocessingOptions(
        primary_host=None, active_processes=set(range(jax.process_count())),
        barrier_sync_key_prefix="spmdtask_local")
    self.fmt = PerProcess(mp)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=False, cleanup_tmp_directories=True,
        multiprocessing_options=mp, enable_async_checkpointing=True, save_root_metadata=False,
        enable_per_process_directory_creation=True)
    handlers = {**{k: self.fmt.handler() for k in io.ARRAY_ITEMS + (PEER_ITEM,)},
                **{k: ocp.JsonCheckpointHandler(multiprocessing_options=mp)
                   for k in io.JSON_ITEMS}}
    self.mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def should_save(self, step: int) -> bool:
    return step % self.interval == 0

  def save(self, step: int, arrays: dict, input_state: dict, meta: dict) -> None:
    """Starts an async save of `arrays` (canonical) at `step`; returns once they are copied."""
    named = fingerprints.named(arrays)
    held = {name: peer_copies.blocks(x.sharding, x.shape) for name, x in named}
    meshes = {x.sharding.mesh for _, x in named if isinstance(x.sharding, NamedSharding)}
    rolled = (peer_copies.peer_mesh(next(iter(meshes)), self.dcn) if len(meshes) == 1
              else None)
    peers = peer_copies.copies(named, rolled, held)
    items = {k: self.fmt.save_args(v) for k, v in arrays.items()}
    if peers:  # (orbax refuses an empty item)
      items[PEER_ITEM] = self.fmt.save_args([peers[k] for k in sorted(peers)])
    peer_blocks = {k: peer_copies.blocks(peers[k].sharding, peers[k].shape)
                   for k in sorted(peers)}
    args = ocp.args.Composite(**items, inputs=ocp.args.JsonSave(input_state),
                              meta=ocp.args.JsonSave({**meta, **self.job, HELD_KEY: held,
                                                      PEER_KEY: peer_blocks}))
    self.mngr.save(step, args=args, force=True)

  def complete_steps(self) -> list[int]:
    """Sorted steps committed by every process (collective)."""
    mine = io.complete_steps(self.directory)
    if jax.process_count() == 1:
      return mine
    width = int(_all_agree(len(mine)).max())
    if width == 0:
      return []
    padded = np.full(width, -1, np.int64)
    padded[:len(mine)] = mine
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, width)
    return sorted(set.intersection(*(set(int(s) for s in row if s >= 0) for row in every)))

  def job_steps(self) -> list[int]:
    """Sorted complete steps of this job (collective); steps of another job (another job
    dir's token: a deleted and re-made job dir) are deleted."""
    steps, other = [], []
    for step in self.complete_steps():
      try:
        with console.libraries_to_log():
          meta = io.read_meta(self.mngr, step)
        mine = all(meta.get(k) == v for k, v in self.job.items())
      except Exception:  # pylint: disable=broad-except  # orbax, json, OS: read() says why
        mine = True
      (steps if _all_agree(int(mine)).all() else other).append(step)
    if other:
      logging.warning("Local checkpoint steps %s in %s belong to another job (%s holds "
                      "another token); they are deleted.", other, self.directory,
                      self.job["job_log_dir"])
      self.drop(other)
    return steps

  def agree(self, why: str | None) -> str | None:
    """A read's answer made one: the first process's complaint, if any process has one."""
    bad = _all_agree(int(why is not None))
    if not bad.any():
      return None
    first = int(np.argmax(bad))
    return why if jax.process_index() == first and why else (
        f"process {first}'s copy of the step is damaged (see its log)")

  def usable(self, meta: dict, program) -> str | None:
    """None if a local step of this job with `meta` restores onto `program`'s layout: the
    one that saved it, or one whose devices on this process need only blocks this process
    wrote (its `HELD_KEY`, with its peer copies: `PEER_KEY`); else why not."""
    return self._plan(meta, program)[0]

  def _plan(self, meta: dict, program) -> tuple[str | None, list[str]]:
    """(`usable`'s answer, the arrays whose blocks on this process's devices need its peer
    copies)."""
    facts = {**program.layout_facts(), "device_count": jax.device_count(),
             "process_count": jax.process_count()}
    changed = [k for k in LAYOUT_KEYS if k in facts and meta.get(k) != facts[k]]
    if not changed:
      return None, []
    held, peer = meta.get(HELD_KEY), meta.get(PEER_KEY) or {}
    targets = program.canonical_targets()
    need = {name: peer_copies.blocks(t.sharding, t.shape)
            for name, t in fingerprints.named({k: getattr(targets, k) for k in io.ARRAY_ITEMS})}
    if held is not None and all(name in held for name in need):
      fill = [name for name, want in need.items()
              if not peer_copies.covered(want, held[name])]
      if all(peer_copies.covered(need[name], held[name] + peer.get(name, []))
             for name in fill):
        return None, fill
    return f"it was saved with another {', '.join(changed)}{MOVED}", []

  def _fill_from_peers(self, step: int, program, fill: list[str]):
    """`checked_read`'s mend of a step read where this process's devices need blocks of
    the arrays `fill` that only its peer copies hold (none: the read as it is)."""
    def mend(got: dict) -> dict:
      if not fill:
        return got
      meta = got["meta"]
      names = sorted(meta[PEER_KEY])
      targets = dict(fingerprints.named({k: getattr(program.canonical_targets(), k)
                                         for k in io.ARRAY_ITEMS}))
      peers = self.mngr.restore(step, args=ocp.args.Composite(**{
          PEER_ITEM: self.fmt.restore_args([targets[k] for k in names])}))[PEER_ITEM]
      return peer_copies.completed(got, io.ARRAY_ITEMS, dict(zip(names, peers)),
                                   meta[HELD_KEY], fill)
    return mend

  def read(self, step: int, program) -> tuple[dict | None, str | None]:
    """(the checked items of local step `step`, None), or (None, why it cannot be used)."""
    fill = []
    try:
      with console.libraries_to_log():
        why, fill = self._plan(io.read_meta(self.mngr, step), program)
    except Exception as e:  # pylint: disable=broad-except  # orbax, json, OS
      why = f"its meta cannot be read ({type(e).__name__})"
    why = self.agree(why)
    if why:
      return None, why
    return io.checked_read(self.mngr, self.directory, program, step,
                           io.ARRAY_ITEMS + io.JSON_ITEMS, fmt=self.fmt, agree=self.agree,
                           mend=self._fill_from_peers(step, program, fill))

  def newest(self, program, persistent: list[int]) -> tuple[dict | None, int | None]:
    """(the checked items, step) of the newest usable local step newer than every step of
    the `persistent` tier, or (None, None). Newer local steps that cannot be used are
    deleted (saves will make those steps again); when the local tier held the job's only
    steps and none can be used, ConfigError (nothing deleted)."""
    failed, got, found = {}, None, None
    for step in reversed(self.job_steps()):
      if step <= max(persistent, default=-1):
        break
      got, why = self.read(step, program)
      if got is not None:
        found = step
        break
      failed[step] = why
    if got is None and failed and not persistent:
      raise ConfigError(
          f"{FIELD}={self.root!r} holds this job's only checkpoints, and none can be restored "
          "here (" + "; ".join(f"step {s}: {w}" for s, w in failed.items()) + f"); the job "
          f"dir {self.job['job_log_dir']} has none. Where a layout changed, rerun on the one "
          "that saved them; else train from the start in a new --job_log_dir.")
    for step, why in failed.items():
      logging.warning("Local checkpoint step %d in %s is not used: %s; it is deleted.", step,
                      self.directory, why)
    self.drop(failed)
    return got, found

  def drop(self, steps) -> None:
    """Deletes local steps `steps` (this process's copies)."""
    for step in steps:
      path = os.path.join(self.directory, str(step))
      if os.path.exists(path):
        logging.info("Removing local checkpoint %s.", path)
        fs.rm(path, recursive=True)
    with console.libraries_to_log():
      self.mngr.reload()

  def wait(self) -> None:
    self.mngr.wait_until_finished()

  def close(self) -> None:
    self.mngr.wait_until_finished()
    self.mngr.close()
