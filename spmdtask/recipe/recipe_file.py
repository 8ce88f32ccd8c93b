"""A recipe file (TOML): its keys checked, each error naming the key and its line
(`load`); spmdtask/recipe/__init__.py shows a whole recipe."""

import dataclasses
import os
import re
import tomllib

from spmdtask.errors import ConfigError

KINDS = {"sft": "stages.Sft", "dpo": "stages.Dpo", "grpo": "stages.Grpo"}
PREPARE = {"sft": "tools/prepare_chat_data.py", "dpo": "tools/prepare_pref_data.py",
           "grpo": "tools/prepare_prompt_data.py"}
LENGTH_FLAG = {"sft": "--max_len", "dpo": "--max_len", "grpo": "--max_prompt_len"}
_KEYS = {"": {"root", "model", "stage", "export"}, "model": {"hf", "job"},
         "stage": {"kind", "name", "data", "input", "max_len", "reward", "lora_rank",
                   "fdl_set"},
         "export": {"hf", "adapter"}}


@dataclasses.dataclass
class Stage:
  kind: str
  name: str
  data: str | None = None
  input: str | None = None
  max_len: int | None = None
  lora_rank: int | None = None
  fdl_set: tuple[str, ...] = ()
  reward: tuple[str, ...] = ()


@dataclasses.dataclass
class Recipe:
  path: str
  root: str
  hf: str | None
  job: str | None
  stages: list[Stage]
  export_hf: str | None = None
  export_adapter: str | None = None


class _Lines:
  """Where a key of the recipe is: its line, found in the text (tomllib gives none)."""

  def __init__(self, path: str, text: str):
    self.path, self.tables = path, []  # (header, index among same headers, first line)
    seen = {}
    self.lines = text.splitlines()
    self.tables.append(("", 0, 1))
    for n, line in enumerate(self.lines, 1):
      m = re.match(r"\s*\[\[?\s*([\w.]+)\s*\]\]?", line)
      if m:
        seen[m.group(1)] = seen.get(m.group(1), -1) + 1
        self.tables.append((m.group(1), seen[m.group(1)], n))

  def where(self, table: str, index: int, key: str) -> str:
    bounds = [t[2] for t in self.tables] + [len(self.lines) + 1]
    for i, (name, idx, first) in enumerate(self.tables):
      if name == table and idx == index:
        for n in range(first, bounds[i + 1]):
          if re.match(rf"\s*{re.escape(key)}\s*=", self.lines[n - 1]):
            return f"{self.path}:{n}: "
        return f"{self.path}:{first}: "
    return f"{self.path}: "


def _field(lines: _Lines, table: str, index: int, key: str, value, kind, required=False):
  """`value` checked to be a `kind` (None allowed unless `required`)."""
  label = f"[{table}] {key}" if table and table != "stage" else (
      f"[[stage]] #{index + 1} {key}" if table else key)
  if value is None:
    if required:
      raise ConfigError(f"{lines.where(table, index, key)}{label} is missing; the recipe needs "
                        "it (spmdtask/recipe/__init__.py's doc shows a whole recipe).")
    return None
  if kind is int and (isinstance(value, bool) or not isinstance(value, int)) or \
      kind is not int and not isinstance(value, kind):
    name = {str: "a string", int: "an integer", list: "a list of strings"}[kind]
    raise ConfigError(f"{lines.where(table, index, key)}{label} = {value!r} is not {name}.")
  return value


def _unknown(lines: _Lines, table: str, index: int, got: dict) -> None:
  for key in got:
    if key not in _KEYS[table]:
      raise ConfigError(f"{lines.where(table, index, key)}{key!r} is not a recipe key of "
                        f"{'the top level' if not table else '[' + table + ']'}; it takes "
                        f"{', '.join(sorted(_KEYS[table]))}.")


def load(path: str) -> Recipe:
  """The recipe at `path`, every key checked; ConfigError naming the key and line."""
  if not os.path.isfile(path):
    raise ConfigError(f"--recipe={path!r} is not a file; give the recipe's TOML file.")
  text = open(path, encoding="utf-8").read()
  try:
    raw = tomllib.loads(text)
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"{path}: is not valid TOML ({e}).") from None
  lines = _Lines(path, text)
  _unknown(lines, "", 0, raw)
  root = _field(lines, "", 0, "root", raw.get("root"), str, required=True)
  model = raw.get("model", {})
  _unknown(lines, "model", 0, model)
  hf, job = (_field(lines, "model", 0, k, model.get(k), str) for k in ("hf", "job"))
  if (hf is None) == (job is None):
    raise ConfigError(f"{lines.where('model', 0, 'hf')}[model] names the model by hf = "
                      "\"HF_DIR\" (imported into ROOT/import) or job = \"IMPORT_DIR\" (an "
                      "existing import's job dir): one of the two.")
  stages, names = [], set()
  for i, st in enumerate(raw.get("stage", [])):
    _unknown(lines, "stage", i, st)
    kind = _field(lines, "stage", i, "kind", st.get("kind"), str, required=True)
    if kind not in KINDS:
      raise ConfigError(f"{lines.where('stage', i, 'kind')}[[stage]] #{i + 1} kind = "
                        f"{kind!r}: a stage is one of {', '.join(KINDS)}.")
    stage = Stage(kind, _field(lines, "stage", i, "name", st.get("name"), str) or kind,
                  **{k: _field(lines, "stage", i, k, st.get(k), t) for k, t in (
                      ("data", str), ("input", str), ("max_len", int), ("lora_rank", int))})
    for key in ("fdl_set", "reward"):
      setattr(stage, key, tuple(_field(lines, "stage", i, key, st.get(key), list) or ()))
    _check_stage(lines, i, stage)
    if stage.name in names or stage.name in ("import", "export"):
      raise ConfigError(f"{lines.where('stage', i, 'name')}[[stage]] #{i + 1}: its job dir "
                        f"name {stage.name!r} is taken; give the stage a name = \"...\" of "
                        "its own.")
    names.add(stage.name)
    stages.append(stage)
  if not stages:
    raise ConfigError(f"{path}: the recipe has no [[stage]]; add one per stage, in order.")
  export = raw.get("export", {})
  _unknown(lines, "export", 0, export)
  return Recipe(path, root, hf, job, stages,
                *(_field(lines, "export", 0, k, export.get(k), str) for k in ("hf", "adapter")))


def _check_stage(lines: _Lines, i: int, st: Stage) -> None:
  """The keys a stage of its kind needs, together."""
  if (st.data is None) == (st.input is None):
    raise ConfigError(f"{lines.where('stage', i, 'kind')}[[stage]] #{i + 1} ({st.kind}) needs "
                      "its data: data = \"PREPARED_DIR\" or input = \"FILE.jsonl\" (prepared "
                      f"by {PREPARE[st.kind]}), one of the two.")
  if st.input is not None and st.max_len is None and st.kind != "grpo":
    raise ConfigError(f"{lines.where('stage', i, 'input')}[[stage]] #{i + 1}: input = "
                      f"{st.input!r} is prepared with {PREPARE[st.kind]} --max_len: add max_len "
                      "= N (the longest sequence in tokens, at most the model's).")
  if st.reward and st.kind != "grpo":
    raise ConfigError(f"{lines.where('stage', i, 'reward')}[[stage]] #{i + 1} ({st.kind}): "
                      "reward scores GRPO's samples; only a grpo stage takes it.")
  for key, values in (("fdl_set", st.fdl_set), ("reward", st.reward)):
    for a in values:
      if not isinstance(a, str) or key == "fdl_set" and "=" not in a:
        raise ConfigError(f"{lines.where('stage', i, key)}[[stage]] #{i + 1} {key} holds "
                          f"{a!r}; give {'path=value' if key == 'fdl_set' else 'NAME or PATH.py:FN[:WEIGHT]'} strings.")
