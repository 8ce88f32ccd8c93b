"""Registry of experiments: `@register`, lookup by name, suffix or module path."""
import difflib
import importlib
import re
import textwrap

from spmdtask.errors import ConfigError

# name -> Experiment class. Filled by `@register` when a config module is imported.
_EXPERIMENTS: dict[str, type] = {}
# Config packages imported before a lookup, so their experiments are listed.
DEFAULT_MODULES = ("configs.lm", "configs.vit", "configs.llama", "configs.moe", "configs.align",
                   "configs.finetune", "configs.grpo", "configs.qwen3", "configs.gemma3",
                   "configs.deepseek", "configs.stages")


def register(cls: type) -> type:
  """Class decorator: registers an Experiment under `<module>.<Class>`."""
  name = f"{cls.__module__}.{cls.__qualname__}"
  if name in _EXPERIMENTS and _EXPERIMENTS[name] is not cls:
    raise ConfigError(f"Experiment {name!r} is registered twice; rename one of the classes.")
  _EXPERIMENTS[name] = cls
  return cls


def _load_defaults() -> None:
  for module in DEFAULT_MODULES:
    importlib.import_module(module)


def names() -> list[str]:
  """All registered experiment names, sorted."""
  _load_defaults()
  return sorted(_EXPERIMENTS)


def _matches(name: str) -> list[str]:
  return [k for k in _EXPERIMENTS if k == name or k.endswith("." + name)]


def get(name: str) -> type:
  """Returns the Experiment class for `name`.

  `name` is a registered name (`configs.lm.TinyLm`), a unique dotted suffix of
  one (`lm.TinyLm`, `TinyLm`), or an importable `module.Class` whose module
  registers it on import.

  Raises:
    ConfigError: unknown or ambiguous name; the message lists close matches.
  """
  _load_defaults()
  found = _matches(name)
  if not found and "." in name:
    module = name.rsplit(".", 1)[0]
    try:
      importlib.import_module(module)
    except ImportError:
      pass
    found = _matches(name)
  if len(found) == 1:
    return _EXPERIMENTS[found[0]]
  if len(found) > 1:
    raise ConfigError(
        f"--exp={name!r} is ambiguous: it matches {', '.join(sorted(found))}. "
        "Pass a longer dotted name that matches only one of them.")
  short = {k.rsplit(".", 1)[-1]: k for k in _EXPERIMENTS}
  close = difflib.get_close_matches(name, list(_EXPERIMENTS), n=5, cutoff=0.5)
  close += [short[s] for s in difflib.get_close_matches(name.rsplit(".", 1)[-1], list(short), n=5)]
  close = sorted(set(close))
  hint = f" Close matches: {', '.join(close)}." if close else ""
  raise ConfigError(
      f"--exp={name!r} names no registered experiment.{hint} "
      "Run `python -m spmdtask.main --list_experiments` to see them all, or pass an importable "
      "`module.Class` whose module registers the class with @register.")


# --list_experiments's groups, in order, with what each holds (an experiment's class attribute
# `group` names its own; spmdtask.experiment.Experiment's default is 'other').
GROUPS = {
    "pretrain": "published architectures at full size, each sized for the slice it names "
                "(plan it there: --mode=plan --plan_topology=...)",
    "fine-tune": "supervised fine-tuning, full or LoRA",
    "align": "preference and reward training: DPO, GRPO",
    "families": "the experiment of a checkpoint tools/convert_hf.py imported, one per family "
                "(with the import's --flagfile)",
    "tiny": "small models on synthetic or prepared data: each runs on a laptop CPU in seconds",
    "other": "registered outside spmdtask's configs",
}
LISTING_WIDTH = 100


def summary(cls: type, limit: int = 140) -> str:
  """An experiment's purpose in at most `limit` characters: its docstring's first sentence
  (a first line followed by a blank one, else up to the first '. ' outside brackets); a longer
  one ends at its last ':' or ';' outside brackets before the limit, else at a word, '...'."""
  doc = (cls.__doc__ or "").strip()
  lines = doc.splitlines()
  if len(lines) > 1 and not lines[1].strip():
    return lines[0].strip()
  text, depth, cut = " ".join(doc.split("\n\n")[0].split()), 0, None
  for i, c in enumerate(text):
    depth += (c in "([{") - (c in ")]}")
    if depth == 0 and c == "." and text[i + 1:i + 2] in ("", " "):
      text = text[:i + 1]
      break
    if depth == 0 and c in ":;" and i < limit:
      cut = i
  if len(text) <= limit:
    return text
  return text[:cut] if cut else text[:limit - 3].rsplit(" ", 1)[0] + "..."


def listing(width: int = LISTING_WIDTH) -> list[str]:
  """--list_experiments: the registered experiments by group (GROUPS' order), each as its
  shortest --exp spelling (a `configs.` name without that prefix) and its `summary`, wrapped
  within `width` columns."""
  _load_defaults()
  by_group: dict[str, list[tuple[str, str]]] = {}
  for name in sorted(_EXPERIMENTS):
    cls = _EXPERIMENTS[name]
    group = cls.group
    shown = name[len("configs."):] if name.startswith("configs.") else name
    by_group.setdefault(group if group in GROUPS else "other", []).append((shown, summary(cls)))
  column = min(max(len(s) for rows in by_group.values() for s, _ in rows) + 2, width // 3)
  out = [f"{len(_EXPERIMENTS)} experiments; pass one as --exp=NAME (a unique suffix, e.g. "
         "TinyLm, works too)."]
  for group, what in GROUPS.items():
    if group not in by_group:
      continue
    out += ["", *textwrap.wrap(f"{group}: {what}", width, subsequent_indent="  ")]
    for shown, text in by_group[group]:
      wrapped = textwrap.wrap(text, width - column - 2)
      if len(shown) < column and wrapped:
        out.append(f"  {shown:<{column}}{wrapped.pop(0)}")
      else:  # a long name on its own line, its purpose below
        out.append(f"  {shown}")
      out += [" " * (column + 2) + line for line in wrapped]
  return out
