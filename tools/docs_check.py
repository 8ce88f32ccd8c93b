"""The docs' checks: shell blocks, the commands in them, and the repo paths they name.

A ```bash block is MARKED (not run by tests/test_docs.py) when its first line is a comment
`# needs: WORD...` (WORD: tpu, gpu, bucket, network, torch, time), or when the line before its
fence is `<!-- needs: WORD... -->` (for README's first block, which CI runs as written and
which stays byte-identical); a reason in parentheses may follow the words. Every other block
is run as written, from the repo root.

Repo paths: a code span or a shell word that starts with one of the repo's top-level folders
(`tools/convert_hf.py`, `examples/tiny_chat/model`, `tests/inputs/data/chat/*.jsonl`) names a
file of this repository and must exist (globs must match). Docs pages link only to other pages;
repo files are named in code spans, and `mkdocs build` (this file is its hook:
`on_page_markdown`) fails on one that does not exist.

`python tools/docs_check.py --moved_from=REV` checks that every number and code span of
README.md at REV is on some page (README.md or docs/) now: the check of the docs' split.
"""
import argparse
import ast
import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = ("tpu", "gpu", "bucket", "network", "torch", "time")
# Top-level folders whose paths the docs name as repo files.
REPO_DIRS = ("spmdtask", "tools", "tests", "benchmarks", "configs", "examples", "docs", ".ci")
_PATH = re.compile(r"^(?:%s)/[\w./*<>-]*$" % "|".join(re.escape(d) for d in REPO_DIRS))
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_NEEDS_LINE = re.compile(r"^#\s*needs:\s*(.+)$")
_NEEDS_HTML = re.compile(r"<!--\s*needs:\s*(.+?)\s*-->\s*$")


class DocsError(ValueError):
  """A docs page names something that does not exist (a flag, an experiment, a file)."""


@dataclasses.dataclass(frozen=True)
class Block:
  """One ```bash block: its page, 1-based line of its fence, text, and why it is not run."""
  page: str
  line: int
  text: str
  needs: tuple[str, ...]  # empty: the block is run


def pages(root: str = ROOT) -> list[str]:
  """README.md and every docs/**/*.md, relative to `root`, sorted."""
  found = glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True)
  return ["README.md"] + sorted(os.path.relpath(p, root) for p in found)


def bash_blocks(text: str, page: str) -> list[Block]:
  """The ```bash blocks of a markdown page, in order."""
  out = []
  for m in _FENCE.finditer(text):
    if m.group(1) != "bash":
      continue
    line = text.count("\n", 0, m.start()) + 1
    body = m.group(2)
    before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
    first = body.split("\n", 1)[0].strip()
    marker = (_NEEDS_LINE.match(first) or _NEEDS_HTML.search(before) or [None, ""])[1]
    words = re.match(r"[a-z ]*", marker).group(0).split()  # then, optionally, why: (...)
    unknown = [w for w in words if w not in NEEDS]
    if unknown:
      raise DocsError(f"{page}:{line}: `needs: {' '.join(words)}`: {unknown} is not one of "
                      f"{', '.join(NEEDS)}.")
    out.append(Block(page, line, body, tuple(words)))
  return out


def commands(block: str) -> list[list[str]]:
  """Each simple command of a shell block as words: continuations joined, comments dropped,
  split at `&&`, `||`, `;` and `|`; leading VAR=value assignments dropped."""
  out = []
  for line in block.replace("\\\n", " ").split("\n"):
    words = shlex.split(line, comments=True)
    current = []
    for w in words + ["&&"]:
      if w in ("&&", "||", ";", "|"):
        while current and re.match(r"^\w+=", current[0]):
          current.pop(0)
        if current:
          out.append(current)
        current = []
      else:
        current.append(w)
  return out


def program(words: list[str]) -> tuple[str | None, list[str], list[str]]:
  """(program, its args, spmdtask.main's args after a standalone `--`) of one command.
  program: 'spmdtask.main', a repo script path such as 'tools/convert_hf.py', or None for any
  other command (pip, gcloud, pytest: their flags are not checked)."""
  if not words or os.path.basename(words[0]) not in ("python", "python3"):
    return None, [], []
  if words[1:3] == ["-m", "spmdtask.main"]:
    name, args = "spmdtask.main", words[3:]
  elif len(words) > 1 and words[1].endswith(".py"):
    name, args = words[1], words[2:]
  else:
    return None, [], []
  if "--" in args:
    i = args.index("--")
    return name, args[:i], args[i + 1:]
  return name, args, []


def script_flags(path: str) -> set[str]:
  """The --flags a script defines: argparse `add_argument('--x')`, absl `DEFINE_*('x')`, a
  literal '--x' it looks for in argv; a script that defines none takes those of the tools/
  modules it imports `main` from (tools/convert_llama.py runs tools/convert_hf.py's)."""
  tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
  found, mains = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      if re.fullmatch(r"--\w+", node.value):
        found.add(node.value[2:])
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr.startswith("DEFINE_") and node.args
          and isinstance(node.args[0], ast.Constant)):
      found.add(node.args[0].value)
    elif (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tools.")
          and any(a.name == "main" for a in node.names)):
      mains.append(node.module.replace(".", "/") + ".py")
  if not found:
    for module in mains:
      found |= script_flags(module)
  return found


def flag_names(args: list[str]) -> list[str]:
  return [a[2:].split("=", 1)[0] for a in args if a.startswith("--") and a != "--"]


def repo_paths(words: list[str]) -> list[str]:
  """The words (or --flag=VALUE values) that name a file of this repository."""
  found = []
  for w in words:
    value = w.split("=", 1)[1] if w.startswith("--") and "=" in w else w
    if _PATH.match(value):
      found.append(value)
  return found


def missing_path(path: str, root: str = ROOT) -> bool:
  """True when no file or folder of the repo matches `path` (a glob; `<N>` placeholders
  match anything)."""
  pattern = re.sub(r"<[^>]*>", "*", path.rstrip("/"))
  return not glob.glob(os.path.join(root, pattern))


def code_spans(text: str) -> list[str]:
  """The inline code spans of a markdown text outside fenced blocks, newlines as spaces."""
  prose = _FENCE.sub("", text)
  return [" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)]


def missing_repo_paths(text: str, root: str = ROOT) -> list[str]:
  """The repo paths a page names (code spans and shell words) that do not exist."""
  named = [s for s in code_spans(text) if _PATH.match(s)]
  for m in _FENCE.finditer(text):
    if m.group(1) == "bash":
      for words in commands(m.group(2)):
        named += repo_paths(words)
  return sorted({p for p in named if missing_path(p, root)})


def on_page_markdown(markdown, page, config, files):  # pylint: disable=unused-argument
  """mkdocs hook: a page naming a repo file that does not exist fails the build."""
  from mkdocs.exceptions import PluginError  # pylint: disable=g-import-not-at-top
  missing = missing_repo_paths(markdown)
  if missing:
    raise PluginError(f"docs/{page.file.src_path} names repo files that do not exist: "
                      f"{', '.join(missing)} (paths are relative to the repo root).")
  return markdown


def figures(text: str) -> set[str]:
  """The numbers of a text (integers, decimals, 1,234,567, 1e-6, 8x8), as written."""
  return set(re.findall(r"\d+(?:[.,]\d+)*(?:e-?\d+)?", text))


def moved_check(old: str, new: str) -> dict[str, list[str]]:
  """What of `old` `new` lacks: numbers, code spans, and whole lines (whitespace-normalized;
  fence lines, blank lines and a line's leading list marker aside)."""
  flat = " ".join(new.split())
  lines = []
  for line in old.split("\n"):
    line = " ".join(re.sub(r"^\s*(?:[-*]|\d+\.)\s+", "", line).split())
    if line and not line.startswith("```") and line not in flat:
      lines.append(line)
  return {
      "number": sorted(n for n in figures(old) if not re.search(
          r"(?<![\d.,])%s(?![\d])" % re.escape(n), flat)),
      "span": sorted(s for s in set(code_spans(old)) if " ".join(s.split()) not in flat),
      "line": lines,
  }


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--moved_from", required=True,
                      help="the git revision whose README.md the pages must hold")
  parser.add_argument("--allow", action="append", default=[],
                      help="a code span changed on purpose (stale path fixed, ...)")
  args = parser.parse_args()
  old = subprocess.run(["git", "-C", ROOT, "show", f"{args.moved_from}:README.md"],
                       capture_output=True, text=True, check=True).stdout
  new = "\n".join(open(os.path.join(ROOT, p), encoding="utf-8").read() for p in pages())
  missing = moved_check(old, new)
  missing["span"] = [s for s in missing["span"] if s not in args.allow]
  print(f"{len(figures(old))} numbers, {len(set(code_spans(old)))} code spans, "
        f"{len(old.splitlines())} lines in the old README; missing now: "
        + ", ".join(f"{len(v)} {k}s" for k, v in missing.items()) + ".")
  for kind, items in missing.items():
    for item in items:
      print(f"  {kind}: {item}")
  # Lines are for reading: a line moved into another sentence is reported, not failed.
  return 1 if missing["number"] or missing["span"] else 0


if __name__ == "__main__":
  sys.exit(main())
