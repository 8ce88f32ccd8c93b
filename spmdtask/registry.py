"""Registry of experiments: `@register`, lookup by name, suffix or module path."""
import difflib
import importlib

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
