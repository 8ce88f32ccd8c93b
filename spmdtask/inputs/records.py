"""User records as the prepare tools read them: JSONL, Parquet, Hugging Face datasets on disk.

`read(source, field)` yields `(where, record)`: each record a dict, `where` the prefix an
error about it starts with:
  'PATH:LINE: '    a JSONL file (every file of the glob not ending in .parquet): one JSON
                   object a line, strict UTF-8 (a leading byte-order mark is allowed), blank
                   lines skipped; LINE counts from 1, as editors do;
  'PATH:row N: '   a Parquet file (`*.parquet`), N counting from 0 as pyarrow and pandas do;
  'DIR:row N: '    a dir written by `datasets`' `Dataset.save_to_disk` (N as `ds[N]`). A
                   DatasetDict's dir is refused, naming its splits: give one split's dir
                   (`DIR/train`), which `datasets` saves as a Dataset.
`source` is one such dir, or a glob of files read in sorted path order. Whatever cannot be
read (a byte that is not UTF-8, a line that is not a JSON object, a file that is not
Parquet) is a ConfigError naming the place and the fix; nothing is guessed or skipped.
Records are read as they are consumed, so a large input is never held whole. (A whole text
file is read with the same strict UTF-8 rule by `fs.read_text`.)
"""
import json
from typing import Iterator

from spmdtask import fs
from spmdtask.errors import ConfigError

_BATCH_ROWS = 1024  # Parquet / Arrow rows turned into Python dicts at a time
_BOM = b"\xef\xbb\xbf"
# What `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write beside the Arrow files.
_DATASET_FILE, _DATASET_DICT_FILE = "state.json", "dataset_dict.json"


def read(source: str, field: str = "--input") -> Iterator[tuple[str, dict]]:
  """(where, record) of every record of `source` (see the module doc); ConfigError naming
  `field` (the flag or config field that gave `source`) when it names nothing readable."""
  if fs.isdir(source):
    yield from _dataset_rows(source, field)
    return
  paths = [p for p in fs.glob(source) if not fs.isdir(p)]
  if not paths:
    raise ConfigError(f"{field}={source!r} matches no file; give a JSONL file (one JSON object "
                      "a line), a Parquet file, a glob of them, or a dir written by datasets' "
                      "save_to_disk.")
  for path in paths:
    yield from (_parquet_rows(path) if path.endswith(".parquet") else _jsonl_records(path))


def _jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
  with fs.open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      where = f"{path}:{n}: "
      if n == 1 and raw.startswith(_BOM):
        raw = raw[len(_BOM):]  # as fs.read_text drops it
      line = fs.decode_text(raw, path, n)
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{where}is not JSON ({e.msg} at column {e.colno}); write one JSON "
                          "object a line.") from None
      if not isinstance(record, dict):
        raise ConfigError(f"{where}is a JSON {type(record).__name__}, not an object; write one "
                          "JSON object ({...}) a line.")
      yield where, record


def _rows(batches, name: str) -> Iterator[tuple[str, dict]]:
  """Arrow record batches (or tables) as (where, dict) by row number."""
  n = 0
  for batch in batches:
    for row in batch.to_pylist():
      yield f"{name}:row {n}: ", row
      n += 1


def _parquet_rows(path: str) -> Iterator[tuple[str, dict]]:
  import pyarrow  # pylint: disable=g-import-not-at-top  # only where Parquet is read
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  with fs.open(path, "rb") as f:
    try:
      batches = pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS)
    except pyarrow.ArrowException as e:
      raise ConfigError(f"{path} is not a Parquet file pyarrow can read ({e}); give Parquet "
                        "files the .parquet name, JSONL files any other.") from None
    yield from _rows(batches, path)


def _dataset_rows(path: str, field: str) -> Iterator[tuple[str, dict]]:
  if fs.isfile(fs.join(path, _DATASET_DICT_FILE)):
    splits = [str(s) for s in json.loads(
        fs.read_text(fs.join(path, _DATASET_DICT_FILE))).get("splits", [])] or ["train"]
    raise ConfigError(
        f"{field}={path!r} is a DatasetDict with the splits {', '.join(splits)}; give the "
        f"split to read as its own dir, e.g. {field}={fs.join(path, splits[0])!r}.")
  if not fs.isfile(fs.join(path, _DATASET_FILE)):
    raise ConfigError(f"{field}={path!r} is a dir but not one written by datasets' "
                      f"save_to_disk (it has no {_DATASET_FILE}); give that dir, or a glob of "
                      "JSONL or Parquet files in it (e.g. 'DIR/*.jsonl').")
  import datasets  # pylint: disable=g-import-not-at-top  # heavy: only where a dataset is read
  ds = datasets.load_from_disk(path)
  yield from _rows(ds.with_format("arrow").iter(batch_size=_BATCH_ROWS), path.rstrip("/"))
