"""A QLoRA job's copy of its quantized base (`job_log_dir/quantized_base/`), saved once.

A LoRA job's checkpoints hold only its adapters and name the base it started from
(run.lora_base); a restore reads the frozen params back from that base. For a QLoRA job
(`train_state.base_storage`) that read is the float base, quantized again on every restore
(a 70B: 140 GB of bfloat16 read to make 37 GB of codes). So the job saves its frozen params
as it holds them (the codes and scales, the float embedding, norms and head) once, at its
first save, beside its checkpoints, and its restores read that copy: the packed bytes, no
quantization, the float base no longer needed. The copy's `meta` names the base and the
storage it was made from; a copy of another base or storage is not read, nor is a damaged
one (a console line says so): the base then is, as before."""
import orbax.checkpoint as ocp

from spmdtask import console, fs
from spmdtask.core import train_state
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_io, fingerprints, lora_base

DIR = "quantized_base"
STEP = 0  # the copy's one checkpoint


def _made_from(base: lora_base.Base, storage) -> dict:
  return {"base": base.record(), "storage": {"kind": storage.kind, "group": storage.group}}


def _directory(job_log_dir: str) -> str:
  return fs.join(fs.absolute(job_log_dir), DIR)


def _meta(job_log_dir: str) -> dict | None:
  """The copy's meta, None where there is no committed copy."""
  if not fs.isdir(_directory(job_log_dir)):
    return None
  mngr = checkpoint_io.manager(_directory(job_log_dir), read_only=True)
  try:
    return checkpoint_io.read_meta(mngr, STEP) if mngr.latest_step() == STEP else None
  finally:
    mngr.close()


def read(job_log_dir: str, program, base: lora_base.Base | None):
  """The frozen params (canonical) of the job's copy made from `base` with the model's
  storage, on `program.mesh`; None where the model is not QLoRA, there is no base, or no
  such copy. Every process calls it."""
  storage = train_state.base_storage(program.model)
  if storage is None or base is None:
    return None
  meta = _meta(job_log_dir)
  if meta is None or {k: meta.get(k) for k in ("base", "storage")} != _made_from(base, storage):
    return None
  targets = lora_base.without_adapters(program.canonical_targets().params)
  try:
    return checkpoint_io.read_params(
        _directory(job_log_dir), STEP, program, targets,
        meta.get(fingerprints.KEY),
        f"This job's copy of its quantized base is left as it is; its base ({base.dir}) is "
        "read and quantized instead.")
  except ConfigError as e:  # the base it was made from is still the truth: read that
    console.say("%s", e)
    return None


class Saver:
  """Saves a QLoRA job's copy once (`save`, async; `wait` for it), unless the job dir
  already holds one (a resumed job's; one of another base is left as it is, and unread)."""

  def __init__(self, job_log_dir: str, program):
    self.job_log_dir, self.program = job_log_dir, program
    self._storage = train_state.base_storage(program.model)
    self._mngr = None
    self._done = self._storage is None

  def save(self, base: lora_base.Base, params) -> None:
    """Starts the copy's save from the canonical `params` (adapters left out), once."""
    if self._done:
      return
    self._done = True
    if _meta(self.job_log_dir) is not None:  # a resumed job's (never overwritten)
      return
    frozen = lora_base.without_adapters(params)
    meta = {**_made_from(base, self._storage),
            fingerprints.KEY: fingerprints.of({"params": frozen}, self.program.mesh)}
    self._mngr = checkpoint_io.manager(_directory(self.job_log_dir))
    self._mngr.save(STEP, args=ocp.args.Composite(params=ocp.args.StandardSave(frozen),
                                                  meta=ocp.args.JsonSave(meta)), force=True)

  def wait(self) -> None:
    if self._mngr is not None:
      self._mngr.wait_until_finished()

  def close(self) -> None:
    if self._mngr is not None:
      mngr, self._mngr = self._mngr, None
      try:
        mngr.wait_until_finished()
      finally:
        mngr.close()
