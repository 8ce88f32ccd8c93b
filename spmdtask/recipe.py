"""One recipe file, one command: `python -m spmdtask.recipe --recipe=FILE.toml`.

A recipe (TOML) names the model, the root dir, the stages in order and the export:

    root = "runs/chat"                       # every job dir goes under it
    [model]
    hf = "examples/tiny_chat/model"          # imported into ROOT/import (or: job = IMPORT_DIR)
    [[stage]]
    kind = "sft"                             # sft, dpo or grpo
    input = "examples/tiny_chat/conversations.jsonl"   # raw file, prepared into ROOT/sft_data
    max_len = 65                             # the prepare tool's --max_len (input only;
                                             # grpo: --max_prompt_len, optional)
    lora_rank = 8                            # omit: every param trains
    fdl_set = ["task.train.num_train_steps=20"]
    [[stage]]
    kind = "dpo"
    data = "DIR"                             # or a prepared data dir
    [[stage]]
    kind = "grpo"
    input = "prompts.jsonl"                  # {"prompt": ..., "answer": ...} a line
    reward = ["my_rewards.py:exact:1.0"]     # --reward values (registered names too)
    [export]
    hf = "export"                            # the last stage's model, merged (HF format)
    adapter = "adapter"                      # a LoRA last stage's adapter (PEFT format)

Relative paths are the recipe file's dir's, the export's ROOT's (`--root=DIR` replaces the
recipe's root). Each stage runs `python -m spmdtask.main --exp=stages.<Kind> --job_log_dir=ROOT/<name>
--init_from=<the stage before, or the import> ...` as a subprocess, printed first so it
stays runnable by hand; a stage whose job reached its last step (its `stage_done` file) is
skipped, an interrupted one resumes (the same command resumes from its checkpoint). A
stage's `name` (default its kind) names its job dir. A bad key is exit 2 naming the key and
its line; nothing runs before the whole recipe is checked.
"""
import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tomllib

from spmdtask import fs
from spmdtask.errors import ConfigError

KINDS = {"sft": "stages.Sft", "dpo": "stages.Dpo", "grpo": "stages.Grpo"}
PREPARE = {"sft": "tools/prepare_chat_data.py", "dpo": "tools/prepare_pref_data.py",
           "grpo": "tools/prepare_prompt_data.py"}
LENGTH_FLAG = {"sft": "--max_len", "dpo": "--max_len", "grpo": "--max_prompt_len"}
DONE_FILE = "stage_done"  # in a stage's job dir once its command exited 0
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
                        "it (spmdtask/recipe.py's doc shows a whole recipe).")
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


@dataclasses.dataclass
class Step:
  """One command of a recipe run: `argv` (python first), done where `done` exists."""
  what: str
  argv: list[str]
  done: str
  marks: bool = False  # writes `done` itself once argv exits 0 (a stage's DONE_FILE)


def steps(r: Recipe) -> list[Step]:
  """The recipe's commands in order: the import, each stage's data and training, the export.
  Relative paths are the recipe file's dir's."""
  here = os.path.dirname(os.path.abspath(r.path))

  def at(p: str) -> str:
    return os.path.normpath(os.path.join(here, os.path.expanduser(p)))

  root = at(r.root)
  out = []

  def under_root(p: str) -> str:
    return os.path.normpath(os.path.join(root, os.path.expanduser(p)))

  start = at(r.job) if r.job else os.path.join(root, "import")
  tokenizer = at(r.hf) if r.hf else start
  if r.hf:
    out.append(Step("import", ["tools/convert_hf.py", f"--from_hf={tokenizer}",
                               f"--job_log_dir={start}"],
                    os.path.join(start, "model_overrides.txt")))
  last = None
  for st in r.stages:
    data = at(st.data) if st.data else None
    if st.input is not None:
      data = os.path.join(root, f"{st.name}_data")
      length = [] if st.max_len is None else [f"{LENGTH_FLAG[st.kind]}={st.max_len}"]
      out.append(Step(f"{st.name} data", [
          PREPARE[st.kind], f"--input={at(st.input)}", f"--tokenizer={tokenizer}",
          f"--output_dir={data}", *length], os.path.join(data, "meta.json")))
    job = os.path.join(root, st.name)
    argv = ["-m", "spmdtask.main", f"--exp={KINDS[st.kind]}", f"--job_log_dir={job}",
            f"--init_from={start}", f"--data_dir={data}"]
    if st.lora_rank is not None:
      argv.append(f"--lora_rank={st.lora_rank}")
    argv += [f"--reward={_absolute_reward(a, at)}" for a in st.reward]
    argv += [f"--fdl_set={a}" for a in st.fdl_set]
    out.append(Step(st.name, argv, os.path.join(job, DONE_FILE), marks=True))
    start, last = job, st
  if r.export_hf:
    hf = under_root(r.export_hf)
    out.append(Step("export", ["tools/convert_hf.py", f"--job_log_dir={start}", f"--to_hf={hf}"]
                    + (["--merge_lora"] if last.lora_rank else []),
                    os.path.join(hf, "config.json")))
  if r.export_adapter and last.lora_rank:
    adapter = under_root(r.export_adapter)
    out.append(Step("adapter", ["tools/convert_hf.py", f"--job_log_dir={start}",
                                f"--to_hf={adapter}"],
                    os.path.join(adapter, "adapter_config.json")))
  return out


def _absolute_reward(spec: str, at) -> str:
  """A reward of a user's file (PATH.py:FN[:WEIGHT]) with PATH through `at` (absolute): the
  stage runs in the repository, the recipe's paths are the recipe's."""
  path, sep, rest = spec.partition(".py:")
  return f"{at(path + '.py')}:{rest}" if sep else spec


def shown(argv: list[str]) -> str:
  """The command as a user reruns it by hand."""
  return shlex.join(["python", *argv])


def run(r: Recipe, repo: str) -> int:
  """Runs the recipe's steps not done yet, in order; the first failure's exit status."""
  todo = steps(r)
  for step in todo:
    if os.path.exists(step.done):
      print(f"recipe: {step.what}: done ({step.done}); skipped", flush=True)
      continue
    print(f"recipe: {step.what}:\n  {shown(step.argv)}", flush=True)
    status = subprocess.run([sys.executable, *step.argv], cwd=repo, check=False).returncode
    if status != 0:
      print(f"recipe: {step.what} ended with exit status {status}; fix what it said and run "
            f"the recipe again: finished steps are skipped, this one resumes.",
            file=sys.stderr, flush=True)
      return status
    if step.marks:
      fs.write_text(step.done, shown(step.argv) + "\n")
  last = [s for s in todo if s.marks][-1]
  print(f"recipe: all {len(r.stages)} stage(s) done; the model is in "
        f"{os.path.dirname(last.done)}", flush=True)
  return 0


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipe", required=True, help="the recipe's TOML file")
  parser.add_argument("--root", help="the job dirs' root in place of the recipe's `root`")
  parser.add_argument("--dry_run", action="store_true",
                      help="print the commands, run none")
  args = parser.parse_args(argv)
  try:
    recipe = load(args.recipe)
    if args.root:
      recipe.root = os.path.abspath(args.root)
  except ConfigError as e:
    print(f"recipe: config error: {e}", file=sys.stderr)
    sys.exit(2)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if args.dry_run:
    print("\n".join(shown(s.argv) for s in steps(recipe)))
    return
  sys.exit(run(recipe, repo))


if __name__ == "__main__":
  main()
