"""Rewards from the user's own Python file, and the checks every reward call passes.

`task.objective.rewards` names a registered reward or `PATH.py:FN`, a function FN of the
file PATH (imported by path, once per process; relative paths from the working dir). The
contract, as TRL's reward functions but positional:

    def my_reward(prompts, completions, answers) -> list[float]:
      # prompts: each sample's prompt text (as the chat template rendered it)
      # completions: each sample's completion text (the stop token left out)
      # answers: each sample's "answer" from the prompts file (any JSON value; None if absent)
      return [float(len(c) < 50) for c in completions]

one float per completion, finite. The `--reward` flag takes `NAME[:WEIGHT]` or
`PATH.py:FN[:WEIGHT]` (`parse_flag`). A file that is missing or does not import, a name it
does not define, a call that raises, or a result of another length, type or a non-finite
value is a ConfigError naming the reward and FILE:LINE. `fingerprint` identifies a file's
contents, so a resumed job can say that its reward file changed.
"""
import hashlib
import importlib.util
import math
import numbers
import os
import sys
import traceback
from typing import Callable, Sequence

from spmdtask.errors import ConfigError

# abs path -> the module, imported once per process: a file edited while a job runs takes
# effect at its next start (which says so: `fingerprint`, run.rollout.note_reward_files)
_LOADED: dict[str, object] = {}


def is_file_spec(name: str) -> bool:
  """Whether a `rewards` entry names a function of a file (`PATH.py:FN`)."""
  return ":" in name and name.rsplit(":", 1)[0].endswith(".py")


def split_spec(spec: str) -> tuple[str, str]:
  path, fn = spec.rsplit(":", 1)
  return path, fn


def display_name(name: str) -> str:
  """The name a reward's metric shows: FN for `PATH.py:FN`, else the registered name."""
  return split_spec(name)[1] if is_file_spec(name) else name


def parse_flag(value: str) -> tuple[str, float]:
  """`--reward=NAME[:WEIGHT]` or `--reward=PATH.py:FN[:WEIGHT]` -> (rewards entry, weight)."""
  head, _, last = value.rpartition(":")
  try:
    weight = float(last) if head else None
  except ValueError:
    weight = None
  name = value if weight is None else head
  if not name or (":" in name and not is_file_spec(name)):
    raise ConfigError(f"--reward={value!r} is not NAME[:WEIGHT] (a registered reward) or "
                      "PATH.py:FN[:WEIGHT] (a function of your file), e.g. "
                      "--reward=my_rewards.py:short_answer:0.5.")
  if weight is not None and not math.isfinite(weight):
    raise ConfigError(f"--reward={value!r}: the weight {last!r} is not a finite number.")
  return name, 1.0 if weight is None else weight


def fingerprint(path: str) -> str:
  """sha256 of the file's bytes (hex)."""
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def load(spec: str, field: str = "task.objective.rewards") -> Callable:
  """The function of `PATH.py:FN`; ConfigError naming `field` and the file (and the line
  of an error while importing it)."""
  path, fn_name = split_spec(spec)
  full = os.path.abspath(path)
  if not os.path.isfile(full):
    raise ConfigError(f"{field} names {spec!r}, but {full} is not a file. Give the path of "
                      "your Python file and a function in it: PATH.py:FN.")
  key = full
  if key not in _LOADED:
    module_name = "spmdtask_reward_" + fingerprint(full)[:16]
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location(module_name, full))
    try:
      module.__spec__.loader.exec_module(module)
    except Exception as e:  # pylint: disable=broad-except  # the user's code, any error
      raise ConfigError(f"{field}: importing {full} for reward {spec!r} failed at "
                        f"{_where(e, full)}: {type(e).__name__}: {e}. Fix the file.") from None
    sys.modules[module_name] = module  # pickling and tracebacks find it
    _LOADED[key] = module
  fn = getattr(_LOADED[key], fn_name, None)
  if not callable(fn):
    defined = sorted(k for k, v in vars(_LOADED[key]).items()
                     if callable(v) and not k.startswith("_") and
                     getattr(v, "__module__", None) == _LOADED[key].__name__)
    raise ConfigError(f"{field} names {spec!r}, but {full} defines no function {fn_name!r} "
                      f"(it defines {', '.join(defined) or 'none'}). Name one of them.")
  return fn


def _where(error: BaseException, path: str) -> str:
  """FILE:LINE of the deepest frame of `error` in `path` (a SyntaxError's own line)."""
  if isinstance(error, SyntaxError) and error.filename == path:
    return f"{path}:{error.lineno}"
  frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
  frame = frames[-1] if frames else traceback.extract_tb(error.__traceback__)[-1]
  return f"{frame.filename}:{frame.lineno}"


def _defined_at(fn: Callable) -> str:
  code = getattr(fn, "__code__", None)
  return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def call(name: str, fn: Callable, prompts: Sequence[str], completions: Sequence[str],
         answers: Sequence) -> list[float]:
  """`fn`'s rewards for the samples, checked: one finite number per completion."""
  n = len(completions)
  try:
    result = fn(list(prompts), list(completions), list(answers))
  except Exception as e:  # pylint: disable=broad-except  # the user's code, any error
    path = getattr(getattr(fn, "__code__", None), "co_filename", "")
    raise ConfigError(f"reward {name!r} raised {type(e).__name__}: {e} (at {_where(e, path)}) "
                      f"scoring {n} completions. Fix the function; it gets lists of prompts "
                      "and completions (text) and answers (any JSON value, None if absent).") \
        from None
  try:
    values = None if isinstance(result, (str, bytes, dict)) else list(result)
  except TypeError:
    values = None
  bad = (f"returned a {type(result).__name__}" if values is None else
         f"returned {len(values)} values for {n} completions" if len(values) != n else None)
  if bad is None:
    odd = [(i, v) for i, v in enumerate(values)
           if not isinstance(v, numbers.Real) or not math.isfinite(float(v))]
    if odd:
      i, v = odd[0]
      bad = f"returned {v!r} for completion {i} ({len(odd)} such)"
  if bad:
    raise ConfigError(f"reward {name!r} ({_defined_at(fn)}) {bad}; a reward returns a list of "
                      f"{n} finite floats, one per completion.")
  return [float(v) for v in values]
