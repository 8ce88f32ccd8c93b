"""Where a stage starts: `--init_from=DIR`, `--family` and `--lora_rank` of the binary.

A stage experiment (configs/stages.py: `stages.Sft`, `stages.Dpo`, `stages.Grpo`) builds the
model of one imported family. That family, and every model field, come from a job dir's
model_overrides.txt, an absl flagfile written by tools/convert_hf.py --from_hf (an import)
and by every stage's training (beside its checkpoints): a `--family=` line, then one
`--fdl_set=` line a field (model fields, eos, the tokenizer; never a dataset's: the
experiments derive the data's vocabulary from the model). So the next stage starts with
`--init_from=DIR` alone (the lines applied first, then task.train.init_checkpoint_dir=DIR),
or `--flagfile=DIR/model_overrides.txt` (then init_checkpoint_dir is the user's).

`--lora_rank=R` gives the stage's model new LoRA adapters (alpha 2R) on every weight LoRA
can adapt in it; without it the stage trains every param. A start that is itself a LoRA job
is read with its adapters merged into its base (run/lora_base.py).
"""
import fiddle as fdl

from spmdtask import fs
from spmdtask.errors import ConfigError

OVERRIDES_FILE = "model_overrides.txt"
INIT_FIELD = "task.train.init_checkpoint_dir"
# Lines of an import's model_overrides.txt a stage sets itself (--lora_rank, its own).
_STAGE_OWN = ("task.model.lora.",)


class Start:
  """What `--init_from=DIR` / `--family` give a run: the family and the override lines."""

  def __init__(self, family: str | None, lines: list[str], init_dir: str | None = None):
    self.family, self.lines, self.init_dir = family, lines, init_dir

  def overrides(self) -> list[str]:
    """The --fdl_set assignments, init_checkpoint_dir last (before the user's own)."""
    out = list(self.lines)
    if self.init_dir is not None:
      out.append(f"{INIT_FIELD}={self.init_dir!r}")
    return out

  def file_text(self, user_overrides: list[str]) -> str:
    """The model_overrides.txt a stage job writes for the stage after it: its family and
    model lines (those --init_from read, or the user's --fdl_set of task.model.*,
    task.decode.eos_id and the decode tokenizer), without its own LoRA."""
    lines = self.lines or [a for a in user_overrides if _is_model_line(a)]
    head = [f"--family={self.family}"] if self.family else []
    return "".join(f"{line}\n" for line in head + [f"--fdl_set={a}" for a in lines])


def _is_model_line(assignment: str) -> bool:
  path = assignment.split("=", 1)[0]
  return (path.startswith("task.model.") and not path.startswith(_STAGE_OWN)
          or path in ("task.decode.eos_id", "decode_datasets['prompts'].default.tokenizer"))


def read(init_from: str | None, family: str | None) -> Start:
  """The Start of `--init_from` (a job dir) and `--family` (given, e.g. by a flagfile).
  ConfigError, before anything is written, where DIR has no model_overrides.txt or no
  complete checkpoint, or its family is not --family's."""
  if init_from is None:
    return Start(family, [])
  fs.check_reachable(init_from, "--init_from")
  init_dir = fs.absolute(init_from)
  path = fs.join(init_dir, OVERRIDES_FILE)
  if not fs.isfile(path):
    raise ConfigError(
        f"--init_from={init_from!r} has no {OVERRIDES_FILE}, so the model it holds is "
        "unknown. Name the job dir of an import (tools/convert_hf.py --from_hf=HF_DIR "
        "--job_log_dir=DIR writes one) or of a stage trained from one (stages.Sft, stages.Dpo, "
        "stages.Grpo); nothing was written.")
  own_family, lines = None, []
  for n, raw in enumerate(fs.read_text(path).splitlines(), 1):
    line = raw.strip()
    if not line or line.startswith("#"):
      continue
    if line.startswith("--family="):
      own_family = line.split("=", 1)[1]
    elif line.startswith("--fdl_set="):
      assignment = line.split("=", 1)[1]
      if not assignment.startswith(_STAGE_OWN):
        lines.append(assignment)
    else:
      raise ConfigError(f"{path}:{n}: {line!r} is neither --family=... nor --fdl_set=...; "
                        f"{OVERRIDES_FILE} holds only those (tools/convert_hf.py --from_hf "
                        "writes it). Restore the file or import the model again.")
  if family is not None and own_family is not None and family != own_family:
    raise ConfigError(f"--family={family} but --init_from={init_from!r} holds a {own_family} "
                      f"model ({path}); drop --family (or the --flagfile of another import).")
  check_start(init_dir, "--init_from")
  return Start(own_family or family, lines, init_dir)


def check_start(init_dir: str, flag: str = INIT_FIELD) -> None:
  """ConfigError naming `flag` and INIT_FIELD where `init_dir` holds no complete
  checkpoint to start from; called before the job dir is made."""
  from spmdtask.run import checkpoint_io  # pylint: disable=g-import-not-at-top  # JAX's
  fs.check_reachable(init_dir, flag)
  directory = checkpoint_io.checkpoint_dir(init_dir)
  if not fs.isdir(directory) or not checkpoint_io.complete_steps(directory):
    raise ConfigError(
        f"{INIT_FIELD}={init_dir!r}{' (--init_from)' if flag == '--init_from' else ''} holds "
        f"no complete checkpoint (looked in {directory}), so there are no params to start "
        "from. Name an import's job dir (tools/convert_hf.py --from_hf) or a trained job's; "
        "nothing was written.")


def add_lora(cfg: fdl.Config, rank: int | None, targets: tuple[str, ...]) -> None:
  """`--lora_rank=R`: new adapters of rank R, alpha 2R, on `targets` (every weight of the
  model LoRA can adapt) with a float32 base; ConfigError for a rank below 1."""
  if rank is None:
    return
  if rank < 1:
    raise ConfigError(f"--lora_rank={rank}: the adapters' rank must be >= 1 (e.g. 8 or 16); "
                      "leave the flag out to train every param.")
  from spmdtask.layers.lora import LoraConfig  # pylint: disable=g-import-not-at-top
  cfg.task.model.lora = fdl.Config(LoraConfig, rank=rank, alpha=2.0 * rank, targets=targets)
