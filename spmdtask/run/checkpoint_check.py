"""Whether a committed checkpoint can be read, told from its metadata and file sizes alone.

An orbax 0.12 step dir holds `_CHECKPOINT_METADATA` and one dir per item. A JSON item
(`meta`, `inputs`) is its `metadata` file. An array item (`params`, `opt_state`) holds
`_METADATA` (the tree of arrays, and whether it was written with OCDBT), `_sharding`,
`array_metadatas/` and, with OCDBT (orbax's default), a tensorstore OCDBT database:
`manifest.ocdbt` names the latest version's B-tree root; the B-tree nodes (`d/...`) map each
zarr key (`<array>/.zarray`, `<array>/<chunk>`) to a value held inline or to a byte range
(offset, length) of a data file (`ocdbt.process_<i>/d/...`). The data files carry no size of
their own: the ranges are what records how long each must be.

`problem(step_dir)` parses every metadata file, reads the manifest and the B-tree nodes
(kilobytes, through tensorstore's own `ocdbt.dump`), lists the item's file sizes once and
checks that every file a range points into is there and long enough, and that every array
of `_METADATA` has its `.zarray` key. That finds a file cut short (an interrupted copy or
upload, a full disk) or missing, and a manifest or node that cannot be decoded, for a
fraction of a restore's cost. Bytes changed in place are left to the restore and the arrays'
fingerprints (`checkpoints`, `fingerprints`); an array item written without OCDBT (one zarr
dir per array) gets the metadata checks only. `unreadable` is the one paragraph for any damage.
"""
import json
import re
import urllib.parse

import tensorstore as ts

from spmdtask import fs
from spmdtask.errors import CheckpointUnreadable, ConfigError

_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")
# tensorstore's names for OCDBT locations: kind:base_path:relative_path:offset:length.
_LOCATION = re.compile(r"^(btreenode|versionnode|value):([^:]*):([^:]*):(\d+):(\d+)$")
_ARRAY_TYPES = ("jax.Array", "np.ndarray")
_CUT_SHORT = "the file was cut short (an interrupted copy or upload, or a full disk)"


def problem(step_dir: str) -> str | None:
  """None if the committed checkpoint in `step_dir` looks readable; else one sentence that
  names the file (relative to `step_dir`) and what is wrong with it."""
  sizes = fs.file_sizes(step_dir)
  parsed = {}
  for rel in sorted(sizes):
    parts = rel.split("/")
    if parts[-1] in _JSON_FILES or parts[-2:-1] == ["array_metadatas"]:
      try:
        parsed[rel] = json.loads(fs.read_bytes(fs.join(step_dir, *parts)))
      except (ValueError, UnicodeDecodeError) as e:
        return (f"{rel} ({sizes[rel]} bytes) is not valid JSON ({_first_line(e)}); it was cut "
                "short or overwritten")
  for rel, tree in sorted(parsed.items()):
    parts = rel.split("/")
    if len(parts) == 2 and parts[1] == "_METADATA" and tree.get("use_ocdbt"):
      item = parts[0]
      why = _ocdbt_problem(step_dir, item, tree, {
          k[len(item) + 1:]: n for k, n in sizes.items() if k.startswith(item + "/")})
      if why:
        return why
  return None


def _first_line(error: Exception) -> str:
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return re.sub(r"\s*\[source locations=.*$", "", text)[:240]


def _kvstore(directory: str):
  url = directory if fs.is_remote(directory) else "file://" + urllib.parse.quote(directory)
  return ts.KvStore.open(url.rstrip("/") + "/").result()


def _ocdbt_problem(step_dir: str, item: str, tree: dict, sizes: dict[str, int]) -> str | None:
  """What is wrong with array item `item`'s OCDBT database, or None."""
  if "manifest.ocdbt" not in sizes:
    return f"{item}/manifest.ocdbt is missing (the item's _METADATA says it was written with OCDBT)"
  kv = _kvstore(fs.join(step_dir, item))
  try:
    versions = ts.ocdbt.dump(kv).result().get("versions") or []
  except Exception as e:  # pylint: disable=broad-except  # tensorstore's ValueError kinds
    return f"{item}/manifest.ocdbt cannot be decoded ({_first_line(e)})"
  root = (versions[-1].get("root") or {}).get("location") if versions else None
  nodes, keys, need = [root] if root else [], set(), {}
  while nodes:
    location = nodes.pop()
    path, end = _file_range(location)
    why = _short(item, path, sizes.get(path), end)
    if why:
      return why
    try:
      node = ts.ocdbt.dump(kv, location).result()
    except Exception as e:  # pylint: disable=broad-except
      return f"{item}/{path} (an index node) cannot be decoded ({_first_line(e)})"
    for entry in node.get("entries", []):
      if node.get("height") == 0 and isinstance(entry.get("key"), bytes):
        keys.add(entry["key"].decode(errors="replace"))
      for value in entry.values():
        if isinstance(value, str) and value.startswith("btreenode:"):
          nodes.append(value)
        elif isinstance(value, str) and value.startswith("value:"):
          path, end = _file_range(value)
          need[path] = max(need.get(path, 0), end)
  for path, end in sorted(need.items()):
    why = _short(item, path, sizes.get(path), end)
    if why:
      return why
  for name in _array_names(tree):
    if f"{name}/.zarray" not in keys:
      return (f"{item}/manifest.ocdbt has no array {name!r}, which {item}/_METADATA lists; the "
              "database does not belong to this checkpoint")
  return None


def _file_range(location: str) -> tuple[str, int]:
  """(file relative to the database dir, end of the byte range) of an OCDBT location."""
  m = _LOCATION.match(location)
  if not m:
    raise ValueError(f"unknown OCDBT location {location!r}")
  _, base, rel, offset, length = m.groups()
  return urllib.parse.unquote(base + rel), int(offset) + int(length)


def _short(item: str, path: str, size: int | None, end: int) -> str | None:
  if size is None:
    return f"{item}/{path} is missing; the checkpoint's index ({item}/manifest.ocdbt) refers to it"
  if size < end:
    return (f"{item}/{path} is {size} bytes long, but the checkpoint's index "
            f"({item}/manifest.ocdbt) records data up to byte {end}: {_CUT_SHORT}")
  return None


def _array_names(tree: dict) -> list[str]:
  """The zarr names ('a.b.c') of the arrays an array item's _METADATA lists."""
  names = []
  for entry in (tree.get("tree_metadata") or {}).values():
    value = entry.get("value_metadata") or {}
    if value.get("value_type") in _ARRAY_TYPES and not value.get("skip_deserialize"):
      names.append(".".join(str(k["key"]) for k in entry.get("key_metadata", [])))
  return names


def innermost_reason(error: BaseException) -> str:
  """The root cause's first line, without object reprs (orbax wraps tensorstore's error,
  which names the file and the key, in one that embeds a pybind repr)."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  text = str(error).strip().splitlines()[0] if str(error).strip() else ""
  text = re.sub(r"<[^<>]*(>|$)", "", re.sub(r"\s*\[source locations=.*$", "", text))
  return f"{type(error).__name__}: {text[:300]}"


# TensorStore's read error for a value of an OCDBT database: its key ("a.b.c/chunk"), then
# the database's path (the checkpoint item's directory; "local file" before a local one).
_OCDBT_READ = re.compile(r'Error reading "([^"/]+)/[^"]*" in OCDBT database at '
                         r'[^/]*?([^\s"]*/[^\s"]*)')


def read_failure(error: BaseException) -> str:
  """Why orbax's restore failed: the array whose stored bytes TensorStore could not decode
  (bytes changed in compressed data), named as the fingerprints name it; else the root
  cause (`innermost_reason`)."""
  reason = innermost_reason(error)
  found = _OCDBT_READ.search(reason)
  if not found:
    return reason
  item = found.group(2).rstrip("/:,.").split("/")[-1]  # params, opt_state
  return (f"the array {item}/{found.group(1).replace('.', '/')} cannot be decoded (its bytes "
          "changed after the save, e.g. on a disk, in a bucket or in a copy)")


def aside_dir(directory: str) -> str:
  """Where a resume with --restore_step moves the unreadable later checkpoints."""
  return fs.join(fs.dirname(directory), "checkpoints_unreadable")


def unreadable(directory: str, step: int, why: str, intact: int | None, own: bool = True,
               resume: bool = False) -> ConfigError:
  """The error for a damaged committed checkpoint: which step, which file or array and what
  is wrong (`why`), and the newest intact earlier step (`intact`, checked the same way). For
  this job's checkpoints (`own`), a CheckpointUnreadable whose `intact_step` main turns into
  a --restore_step command; when `resume`ing, that command moves the steps after `intact`
  aside (nothing is deleted)."""
  head = (f"The checkpoint at step {step} in {directory} cannot be read: {why}. "
          "Nothing was changed.")
  if intact is None:
    tail = ("There is no intact earlier checkpoint: train from scratch in a new "
            "--job_log_dir (this one keeps the damaged checkpoint for inspection).")
  elif not own:
    tail = (f"Its newest intact checkpoint is step {intact}: move {directory}/{step} (and any "
            f"later step) out of {directory} to start from it.")
  else:
    tail = (f"The newest intact checkpoint is step {intact}" + (
        f"; resuming from it moves the steps after it into {aside_dir(directory)}/ (nothing is "
        "deleted)" if resume else "") + ".")
  if not own:
    return ConfigError(f"{head} {tail}")
  return CheckpointUnreadable(f"{head} {tail}", step, intact)
