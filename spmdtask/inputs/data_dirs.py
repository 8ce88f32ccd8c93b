"""Prepared data dirs: what a dir holds (its kind, decided here from meta.json once) and
writing a new one (never over a user's files).

Kinds: 'text' (tools/prepare_text_data.py: documents), 'chat' (prepare_chat_data.py:
conversations with target masks), 'preferences' (prepare_pref_data.py: DPO's pairs),
'prompts' (prepare_prompt_data.py: GRPO's prompts with answers). The
tools write meta.json's "kind"; a dir prepared before that is known by its other fields.
An input that reads one kind refuses another (`check_kind`): a preference dir trained on as
conversations would teach the rejected answers too.

Writing: `check_output_dir` (before anything is read) refuses an --output_dir that holds
files unless it is a prepared data dir and --overwrite is given; `write` writes the new dir
beside the old one and swaps it in (a local dir) or uploads it (gs://), so a failure leaves
the old dir as it was.
"""
import dataclasses
import os
import shutil
import tempfile

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.inputs import tokenizers


@dataclasses.dataclass(frozen=True)
class Kind:
  what: str  # what the dir holds, in words
  tool: str  # the tool that writes it
  experiment: str  # the experiment that trains on it


KINDS = {
    "text": Kind("plain text documents", "tools/prepare_text_data.py", "lm.TextLm"),
    "chat": Kind("conversations", "tools/prepare_chat_data.py", "stages.Sft"),
    "preferences": Kind("preference pairs", "tools/prepare_pref_data.py", "stages.Dpo"),
    "prompts": Kind("prompts with answers", "tools/prepare_prompt_data.py",
                    "grpo.LlamaGrpoImport"),
}


def kind(meta: dict) -> str:
  """The kind of a data dir with this meta.json."""
  if "kind" in meta:
    return meta["kind"]
  if meta.get("preferences"):
    return "preferences"
  return "chat" if "chat" in meta else "text"


def check_kind(meta: dict, data_dir: str, field: str, accepted: tuple[str, ...],
               why: str = "") -> None:
  """ConfigError naming `field`, the dir, its kind and the experiment that takes it, unless
  its kind is one of `accepted` (`why`: what reading it anyway would do, in words)."""
  got = kind(meta)
  if got in accepted:
    return
  have, want = KINDS.get(got), KINDS[accepted[0]]
  held = (f"{have.what} (its {tokenizers.META_FILE} says so; {have.tool} wrote it), which "
          f"--exp={have.experiment} trains on" if have else
          f"data of kind {got!r} (its {tokenizers.META_FILE})")
  raise ConfigError(
      f"{field}={data_dir!r} (--data_dir) holds {held}; this input reads "
      f"{' or '.join(KINDS[a].what for a in accepted)}{why}. Give it a dir written by "
      f"{want.tool}" + (f", or train on this one with --exp={have.experiment}." if have else "."))


def check_output_dir(output_dir: str, overwrite: bool, field: str = "--output_dir") -> None:
  """ConfigError unless `output_dir` is missing or empty, or (with `overwrite`) a prepared
  data dir; checked before anything is read or written."""
  fs.check_reachable(output_dir, field)
  names = fs.listdir(output_dir) if fs.isdir(output_dir) else []
  if not names:
    if fs.exists(output_dir) and not fs.isdir(output_dir):
      raise ConfigError(f"{field}={output_dir!r} is a file; give a new or empty dir.")
    return
  prepared = tokenizers.META_FILE in names
  if prepared and overwrite:
    return
  if prepared:
    raise ConfigError(f"{field}={output_dir!r} already holds a prepared data dir "
                      f"({tokenizers.META_FILE}); give a new dir, or pass --overwrite to "
                      "replace it.")
  shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
  raise ConfigError(f"{field}={output_dir!r} is not empty ({shown}) and is no prepared data "
                    f"dir (no {tokenizers.META_FILE}), so writing there could mix or replace "
                    "your files" + (" (--overwrite only replaces a prepared data dir)"
                                    if overwrite else "") + "; give a new or empty dir.")


def write(output_dir: str, write_fn, overwrite: bool = False):
  """`write_fn(local_dir)` into a fresh dir that then becomes `output_dir` (a prepared dir
  there is replaced only with `overwrite`, as `check_output_dir` allowed); returns what
  `write_fn` returns. A failure leaves `output_dir` as it was."""
  if fs.is_remote(output_dir):
    return _write_remote(output_dir, write_fn, overwrite)
  output_dir = os.path.abspath(output_dir)
  os.makedirs(os.path.dirname(output_dir), exist_ok=True)
  staged = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.partial-",
                            dir=os.path.dirname(output_dir))
  try:
    out = write_fn(staged)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise
  os.chmod(staged, 0o777 & ~_umask())  # mkdtemp's 0700, as a new dir would be made
  if os.path.isdir(output_dir):
    try:  # asked again: the dir may have been filled since
      check_output_dir(output_dir, overwrite)
    except ConfigError:
      shutil.rmtree(staged, ignore_errors=True)
      raise
    shutil.rmtree(output_dir)
  os.rename(staged, output_dir)
  return out


def _write_remote(output_dir: str, write_fn, overwrite: bool):
  staged = fs.Staged(output_dir, "spmdtask_data_")
  try:
    out = write_fn(staged.local)
  except BaseException:
    staged.close(upload=False)
    raise
  if overwrite:
    fs.rm(output_dir, recursive=True)
  staged.close()
  return out


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask
