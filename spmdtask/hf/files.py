"""Hugging Face model directories: reading config.json and the weights (model.safetensors,
or the shards model.safetensors.index.json lists), the files beside them a chat model needs
(tokenizer, chat template, generation config), and writing a directory's files (a gs://
one through a local staging dir, uploaded at the end) with ordinary modes, 0644 files in a
0755 directory, whatever the umask.
"""
import contextlib
import json
import os
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
import safetensors
from safetensors import numpy as st_numpy

from spmdtask import console, fs
from spmdtask.errors import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
# What transformers' tokenizers read (fast, sentencepiece, BPE vocab/merges) and its chat
# template (transformers 5 saves chat_template.jinja; 4 a chat_template.json or a key of
# tokenizer_config.json). An import keeps each that the model dir has; an export writes them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
# Files an HF loader reads from a model or adapter dir: what an export with --overwrite
# replaces (stale shards or an old index would otherwise be loaded beside the new weights).
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
MODEL_FILES = (CONFIG_FILE, GENERATION_FILE, "adapter_config.json") + TOKENIZER_FILES
FILE_MODE, DIR_MODE = 0o644, 0o755

Report = Callable[[str], None]  # takes one console line (progress); None: silent


class Tensor:
  """One tensor of a safetensors file, read from it when asked (`np.asarray(t)`, or
  `read()`); its shape and dtype are the file header's. What lets an import hold one
  tensor at a time, not the model (`opened_hf`)."""

  def __init__(self, path: str, name: str, shape: tuple[int, ...], dtype: np.dtype):
    self.path, self.name, self.shape, self.dtype = path, name, tuple(shape), dtype

  def read(self) -> np.ndarray:
    with safetensors.safe_open(self.path, framework="numpy") as f:
      return f.get_tensor(self.name)

  def __array__(self, dtype=None, copy=None):
    del copy  # a fresh array either way
    x = self.read()
    return x if dtype is None else x.astype(dtype)


@contextlib.contextmanager
def opened_hf(hf_dir: str, report: Report | None = None):
  """(config.json, `Tensor`s by name) of a HF directory, single-file or sharded, with
  nothing read but the files' headers; the tensors are readable inside the `with` (a
  gs:// dir's files are copied to local temporary files, deleted on exit). `report` gets
  one line per weights file as it is opened (shard i/N, tensors, bytes)."""
  path = fs.join(hf_dir, CONFIG_FILE)
  if not fs.isfile(path):
    raise ConfigError(f"--from_hf={hf_dir!r} has no config.json; point it at a Hugging Face "
                      "model directory (config.json + *.safetensors).")
  cfg = json.loads(fs.read_text(path))
  index = fs.join(hf_dir, INDEX_FILE)
  if fs.isfile(index):
    names = sorted(set(json.loads(fs.read_text(index))["weight_map"].values()))
  else:
    names = [WEIGHTS_FILE]
  for name in names:
    if not fs.isfile(fs.join(hf_dir, name)):
      raise ConfigError(f"--from_hf={hf_dir!r} has no {name}, which holds the weights.")
  with contextlib.ExitStack() as stack:
    tensors = {}
    for i, name in enumerate(names):
      local = stack.enter_context(fs.local_file(fs.join(hf_dir, name)))
      with safetensors.safe_open(local, framework="numpy") as f:
        part = {k: Tensor(local, k, f.get_slice(k).get_shape(), _dtype(f.get_slice(k)))
                for k in f.keys()}
      tensors.update(part)
      if report:  # its header: the tensors are read one at a time later
        report(f"opened {name} (shard {i + 1}/{len(names)}): {_summary(part)}")
    yield cfg, tensors


def read_hf(hf_dir: str, report: Report | None = None) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json, tensors by name) of a HF directory, every tensor read (`opened_hf`)."""
  with opened_hf(hf_dir, report) as (cfg, tensors):
    return cfg, {k: t.read() for k, t in tensors.items()}


# safetensors' dtype codes (the header's) as numpy dtypes.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _dtype(view) -> np.dtype:
  code = view.get_dtype()
  if code not in _DTYPES:
    raise ConfigError(f"A tensor's dtype {code!r} is not one spmdtask reads (safetensors "
                      f"dtypes {sorted(_DTYPES)}).")
  return np.dtype(_DTYPES[code])


def present(hf_dir: str, names) -> list[str]:
  """Those of `names` that are files in `hf_dir`."""
  return [n for n in names if fs.isfile(fs.join(hf_dir, n))]


def model_files(names) -> list[str]:
  """Those of a dir's `names` that an HF loader reads (see MODEL_FILES, WEIGHT_SUFFIXES)."""
  return [n for n in names if n in MODEL_FILES or n.endswith(WEIGHT_SUFFIXES)
          or n.startswith("adapter_model")]


def write_dir(hf_dir: str, files: dict[str, str | bytes | dict[str, np.ndarray]],
              report: Report | None = None) -> None:
  """Writes `files` (name -> text, bytes, or tensors for a .safetensors file) into
  `hf_dir`; `report` gets one line per weights file."""
  staged = fs.Staged(hf_dir, "spmdtask_hf_")  # safetensors writes a local file
  try:
    for name, content in files.items():
      path = os.path.join(staged.local, name)
      if isinstance(content, str):
        fs.write_text(path, content)
      elif isinstance(content, bytes):
        fs.write_bytes(path, content)
      else:
        start = time.perf_counter()
        st_numpy.save_file(content, path, metadata={"format": "pt"})
        if report:
          report(f"wrote {name}: {_summary(content, start)}")
      os.chmod(path, FILE_MODE)
    os.chmod(staged.local, DIR_MODE)
  except BaseException:
    staged.close(upload=False)
    raise
  staged.close()


def _summary(tensors: dict, start: float | None = None) -> str:
  """Count and bytes of arrays or `Tensor`s (their header's size), and the seconds since
  `start` when given."""
  nbytes = sum(int(np.prod(t.shape)) * t.dtype.itemsize for t in tensors.values())
  took = "" if start is None else f", {console.human_seconds(time.perf_counter() - start)}"
  return f"{console.count(len(tensors), 'tensor')}, {console.human_bytes(nbytes)}{took}"
