"""Command-line changes to an experiment's fiddle config, and the errors they can meet.

`--fdl_set=path=value` paths are checked against the config's real fields first, so a typo
names the closest ones (difflib); `--data_dir` sets the `data_dir` of every dataset that has
one; a failure while fiddle builds the config is reported by the field it was building,
without fiddle's repr of every argument (which, for a dataset, holds the whole model).

Where a stage starts (`--init_from`, `--family`; `Start`): a stage experiment
(configs/stages.py) builds the model of one imported family. That family and every model field
come from a job dir's model_overrides.txt, an absl flagfile written by tools/convert_hf.py
--from_hf and by every stage's training: a `--family=` line, then one `--fdl_set=` line a
field (model fields, eos, the tokenizer; never a dataset's: the experiments take the data's
vocabulary from the model). `--init_from=DIR` applies those lines first, then
task.train.init_checkpoint_dir=DIR; `--flagfile=DIR/model_overrides.txt` gives the same model
without the start.
"""
import difflib
import os
import re
import types
import typing

import fiddle as fdl
from fiddle._src.absl_flags import utils as fdl_flag_utils

from spmdtask import fs
from spmdtask.errors import BatchSplitError, ConfigError

_GROUPS = ("datasets", "decode_datasets")


def field_paths(node, prefix: str = "") -> list[str]:
  """Every settable path under `node`, as --fdl_set spells it (`task.train.x`,
  `datasets['train'].batch_size`): the parameters of each Buildable, set or not, and
  the keys of dicts."""
  out = []
  if isinstance(node, fdl.Buildable):
    for name in node.__signature_info__.parameters:
      path = f"{prefix}.{name}" if prefix else name
      out.append(path)
      out += field_paths(node.__arguments__.get(name), path)  # set values only
  elif isinstance(node, dict):
    for key, value in node.items():
      path = f"{prefix}[{key!r}]"
      out.append(path)
      out += field_paths(value, path)
  return out


def _normalize(path: str) -> str:
  """One spelling of subscripts: ["x"] and ['x'] alike, no spaces."""
  return re.sub(r"\[\s*\"([^\"]*)\"\s*\]", r"['\1']", path.replace(" ", ""))


def check_path(assignment: str, paths: list[str]) -> None:
  """ConfigError naming the closest real fields when `path=value` sets no real field."""
  path = _normalize(assignment.split("=", 1)[0])
  known = set(paths)
  # A known path, or an element of a tuple-valued one (e.g. `task.ici_mesh_shape[0]`).
  base = re.sub(r"(\[-?\d+\])+$", "", path)
  if path in known or base in known:
    return
  parent = path.rsplit(".", 1)[0] if "." in path else ""
  close = difflib.get_close_matches(path, paths, n=3, cutoff=0.6)
  hint = (f" Did you mean {' or '.join(close)}?" if close else
          " Paths start at task, datasets or decode_datasets.")
  where = (f"{parent} has no field {path[len(parent) + 1:]!r}" if parent in known
           else f"there is no field {path!r}")
  raise ConfigError(
      f"--fdl_set={assignment!r}: {where}.{hint} The resolved config (job_log_dir/config.txt "
      "of a run) lists every field, one `path = value` a line.")


def set_data_dirs(cfg: fdl.Config, data_dir: str, exp: str) -> list[str]:
  """`--data_dir`: sets `data_dir` on every dataset and decode dataset that has that field;
  returns their paths. ConfigError if none has one."""
  hits = []
  for group in _GROUPS:
    for name, node in (getattr(cfg, group, None) or {}).items():
      if isinstance(node, fdl.Buildable) and "data_dir" in node.__signature_info__.parameters:
        node.data_dir = data_dir
        hits.append(f"{group}[{name!r}].data_dir")
  if not hits:
    raise ConfigError(f"--data_dir={data_dir!r}: no dataset of --exp={exp} reads a data_dir "
                      "(it has no `data_dir` field). Drop --data_dir, or pick an experiment "
                      "that reads prepared data, e.g. --exp=lm.TextLm.")
  return hits


def set_chat_prompts(cfg: fdl.Config, prompts_file: str, exp: str) -> list[str]:
  """`--chat_prompts`: sets `prompts_file` on every decode dataset that has that field, and
  task.decode.eos_id to the end-of-turn id of their chat template (the meta.json of their
  `data_dir`, a tools/prepare_chat_data.py dir), so a reply stops where its turn ends; one
  such dataset becomes the only one, named as --prompt's. Returns the paths set. ConfigError if no decode dataset takes one, or its data dir is
  not prepared chat data."""
  from spmdtask.inputs import tokenizers  # pylint: disable=g-import-not-at-top
  hits, ends, chats = [], set(), []
  for name, node in (cfg.decode_datasets or {}).items():
    if not (isinstance(node, fdl.Buildable)
            and {"prompts_file", "data_dir"} <= set(node.__signature_info__.parameters)):
      continue
    node.prompts_file = prompts_file
    field = f"decode_datasets[{name!r}].data_dir"
    hits.append(field)
    chats.append(node)
    if not node.data_dir:
      raise ConfigError(f"--chat_prompts renders each conversation with the chat template of "
                        f"a prepared chat data dir, and {field} is empty: add --data_dir=DIR, "
                        "the dir tools/prepare_chat_data.py wrote (the one the job trained on).")
    meta = tokenizers.read_meta(node.data_dir, field)
    if "chat" not in meta:
      raise ConfigError(f"--chat_prompts: {field}={node.data_dir!r} holds no chat template "
                        "(it was not prepared from conversations); give --data_dir=DIR, a "
                        "dir tools/prepare_chat_data.py wrote.")
    ends.add(int(meta["chat"]["end_of_turn_id"]))
  if not hits:
    raise ConfigError(f"--chat_prompts={prompts_file!r}: no decode dataset of --exp={exp} "
                      "reads conversations (none has a `prompts_file` field). Use an "
                      "experiment that does, e.g. --exp=finetune.LlamaLoraImport.")
  if len(ends) > 1:
    raise ConfigError(f"--chat_prompts: the decode datasets' chat data dirs end a turn with "
                      f"different tokens {sorted(ends)}; give them one --data_dir.")
  cfg.task.decode.eos_id = ends.pop()
  if len(hits) == 1:  # the user's own prompts: written and printed in full as --prompt's
    from spmdtask.run.decoding import OWN_PROMPTS  # pylint: disable=g-import-not-at-top
    cfg.decode_datasets = {OWN_PROMPTS: chats[0]}
  return hits


_CONTEXT = re.compile(r"\n\nFiddle context: failed to construct or call (\S+) at "
                      r"<root>(\S*) with", re.S)


def build_error(error: Exception) -> ConfigError:
  """The ConfigError for an exception raised while fiddle built the config: the error's own
  message and the field being built; fiddle's context (every argument's repr) dropped."""
  text = str(error)
  match = _CONTEXT.search(text)
  message = text[:match.start()].strip() if match else text.split("\n\nFiddle context:")[0]
  if isinstance(error, ConfigError):
    if match:  # name the dataset where the message could only say `datasets[...]`
      path = match.group(2).lstrip(".")
      for group in _GROUPS:
        if path.startswith(group + "["):
          message = message.replace(f"{group}[...]", path)
    return ConfigError(message)
  if not match:
    return ConfigError(f"The config does not build: {type(error).__name__}: {message}. Check "
                       "the --fdl_set overrides and the experiment's fields.")
  what, path = match.group(1), match.group(2).lstrip(".") or "the config"
  return ConfigError(
      f"{path} ({what}) does not build: {type(error).__name__}: {message}. Fix that field "
      f"(--fdl_set={path}.FIELD=VALUE; job_log_dir/config.txt lists the resolved fields).")



def train_batch_error(error: BatchSplitError) -> ConfigError:
  """The batch-dim error of the train batch (every mode sets up its program on
  datasets['train']'s batches), naming the field to change first."""
  if error.dim != 0:
    return error
  up = -(-error.size // error.shards) * error.shards
  return ConfigError(
      f"datasets['train'].batch_size={error.size} does not divide over the data axes "
      f"({error.shards} shards): make it a multiple of {error.shards} (e.g. "
      f"--fdl_set=\"datasets['train'].batch_size={up}\"), or change the mesh "
      f"(task.ici_mesh_shape) or task.train.inputs_split_mapping. ({error})")


IMPORT_OVERRIDES = "model_overrides.txt"  # what tools/convert_hf.py writes beside an import


def check_import_flagfile(cfg: fdl.Config, default: fdl.Config, exp: str) -> None:
  """ConfigError where task.train.init_checkpoint_dir names an import (a dir holding
  model_overrides.txt) whose model fields differ from the experiment's defaults and the
  config still has the defaults for every one of them: its --flagfile was not passed, and the
  model built would be the experiment's own (a vocab mismatch much later, after building a
  model of another size). `default` is the experiment's config before any flag."""
  from spmdtask import fs  # pylint: disable=g-import-not-at-top
  from fiddle._src import daglish  # pylint: disable=g-import-not-at-top
  init = cfg.task.train.init_checkpoint_dir
  path = fs.join(init, IMPORT_OVERRIDES) if init else None
  if not path or not fs.isfile(path):
    return
  changed, kept = [], True  # the import's model fields that differ from the defaults
  for line in fs.read_text(path).splitlines():
    assignment = line.strip().removeprefix("--fdl_set=")
    field = assignment.split("=", 1)[0]
    if not field.startswith("task.model.") or "=" not in assignment:
      continue
    try:
      where = fdl_flag_utils.parse_path(field)
      value = fdl_flag_utils.parse_value(value=assignment.split("=", 1)[1], path=field)
      now, was = daglish.follow_path(cfg, where), daglish.follow_path(default, where)
    except Exception:  # pylint: disable=broad-except  # a field this experiment lacks
      continue
    if value != was:
      changed.append(f"{field}={value!r} where it has {now!r}")
      kept = kept and now == was
  if changed and kept:
    raise ConfigError(
        f"task.train.init_checkpoint_dir={init!r} is an import whose model differs from "
        f"--exp={exp}'s own ({'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''}), "
        f"and no model field was set to the import's: pass --flagfile={path} (it sets every "
        "model field, the data vocabulary, eos and the tokenizer to the import's).")


def set_rewards(cfg: fdl.Config, values: list[str], exp: str) -> None:
  """`--reward=NAME[:WEIGHT]` / `--reward=PATH.py:FN[:WEIGHT]` (repeatable): sets
  task.objective.rewards (a file's path made absolute, so a resume from another dir reads
  the same file) and reward_weights, replacing the experiment's. ConfigError where the
  objective takes no rewards."""
  from spmdtask.objectives import user_rewards  # pylint: disable=g-import-not-at-top
  obj = cfg.task.objective
  if not (isinstance(obj, fdl.Buildable) and
          {"rewards", "reward_weights"} <= set(obj.__signature_info__.parameters)):
    raise ConfigError(f"--reward: --exp={exp} trains no objective with rewards (its "
                      f"task.objective is {getattr(obj, '__fn_or_cls__', obj)!r}); rewards "
                      "score GRPO's samples, e.g. --exp=grpo.LlamaGrpoImport.")
  names, weights = [], []
  for value in values:
    name, weight = user_rewards.parse_flag(value)
    if user_rewards.is_file_spec(name):
      path, fn = user_rewards.split_spec(name)
      name = f"{os.path.abspath(path)}:{fn}"
    names.append(name)
    weights.append(weight)
  obj.rewards, obj.reward_weights = tuple(names), tuple(weights)


def _type_ok(value, hint) -> bool:
  """Whether `value` fits a field's simple type hint (unknown hints are not checked)."""
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_type_ok(value, h) for h in typing.get_args(hint))
  if hint is type(None) or hint is None:
    return value is None
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if hint in (str, bool):
    return isinstance(value, hint)
  if origin is tuple or hint is tuple:
    return isinstance(value, (tuple, list))
  if origin is dict or hint is dict:
    return isinstance(value, dict)
  return True


def check_field_types(node, path: str) -> None:
  """ConfigError for the first field whose value does not fit its annotation (e.g. an
  --fdl_set override of the wrong type), before anything is built."""
  if isinstance(node, dict):
    for k, v in node.items():
      check_field_types(v, f"{path}[{k!r}]")
    return
  if not isinstance(node, fdl.Buildable):
    return
  try:
    hints = typing.get_type_hints(node.__fn_or_cls__)
  except Exception:  # pylint: disable=broad-except
    hints = {}
  for name, value in node.__arguments__.items():
    where = f"{path}.{name}" if path else name
    if isinstance(value, (fdl.Buildable, dict)):
      check_field_types(value, where)
    elif name in hints and not _type_ok(value, hints[name]):
      raise ConfigError(
          f"{where}={value!r} is a {type(value).__name__}, but the field is "
          f"{getattr(hints[name], '__name__', None) or hints[name]}. Give a value of that type "
          f"(e.g. --fdl_set={where}=<value>; quote strings).")


# ------------------------------------------------------------ where a stage starts
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


def start_of(init_from: str | None, family: str | None) -> Start:
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


def own_prompts(run_cfg, texts: list[str], chat_question: str | None, raw: bool, exp: str):
  """`run_cfg` decoding the texts of --prompt / --prompts_file and `chat_question` (--chat),
  rendered with the job's chat template where it has one (unless `raw`: --raw_prompt)."""
  # pylint: disable-next=g-import-not-at-top
  from spmdtask.inputs import own_prompts as own, prompts
  from spmdtask.run import decoding  # pylint: disable=g-import-not-at-top
  if chat_question is not None and raw:
    raise ConfigError("--chat renders its question with the job's chat template and "
                      "--raw_prompt asks for no template: give --prompt=TEXT --raw_prompt for "
                      "a plain continuation, or drop --raw_prompt.")
  chat = None if raw else own.job_chat(run_cfg.datasets, run_cfg.decode_datasets)
  if chat_question is not None:
    if chat is None:
      raise ConfigError(
          f"--chat={chat_question!r} is rendered with the job's chat template, and --exp="
          f"{exp} has none: no dataset reads prepared conversations and its decode "
          "tokenizer's dir holds no chat template. Add --data_dir=DIR (a dir "
          "tools/prepare_chat_data.py wrote) or the import's --flagfile, or continue plain "
          "text with --prompt=TEXT --raw_prompt.")
    if not chat_question.strip():
      raise ConfigError("--chat is empty; give the question to ask, e.g. --chat='What is 1 + 2?'.")
    texts = texts + [chat_question]
  return decoding.with_own_prompts(run_cfg, texts, prompts.TokenizedPrompts, chat)
