"""A recipe's commands (`steps`) and their run: each printed, then run as a subprocess, a
finished step skipped, an interrupted stage resumed; `main` is `python -m spmdtask.recipe`."""
import argparse
import dataclasses
import os
import shlex
import subprocess
import sys

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.recipe.recipe_file import KINDS, LENGTH_FLAG, PREPARE, Recipe, load

DONE_FILE = "stage_done"  # in a stage's job dir once its command exited 0


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
  parser = argparse.ArgumentParser(prog="python -m spmdtask.recipe",
                                   description="Runs a recipe: import, stages, export.")
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
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if args.dry_run:
    print("\n".join(shown(s.argv) for s in steps(recipe)))
    return
  sys.exit(run(recipe, repo))
