"""Hugging Face model directories: reading config.json and the weights (model.safetensors,
or the shards model.safetensors.index.json lists), and writing a directory's files (a gs://
one through a local staging dir, uploaded at the end).
"""
import json
import os

import numpy as np
from safetensors import numpy as st_numpy

from spmdtask import fs
from spmdtask.errors import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def read_hf(hf_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json, tensors by name) of a HF directory, single-file or sharded."""
  path = fs.join(hf_dir, CONFIG_FILE)
  if not fs.isfile(path):
    raise ConfigError(f"--from_hf={hf_dir!r} has no config.json; point it at a Hugging Face "
                      "model directory (config.json + *.safetensors).")
  cfg = json.loads(fs.read_text(path))
  index = fs.join(hf_dir, INDEX_FILE)
  if fs.isfile(index):
    files = sorted(set(json.loads(fs.read_text(index))["weight_map"].values()))
  else:
    files = [WEIGHTS_FILE]
  for name in files:
    if not fs.isfile(fs.join(hf_dir, name)):
      raise ConfigError(f"--from_hf={hf_dir!r} has no {name}, which holds the weights.")
  tensors = {}
  for name in files:
    with fs.local_file(fs.join(hf_dir, name)) as path:  # safetensors reads (mmaps) a file
      tensors.update(st_numpy.load_file(path))
  return cfg, tensors


def write_dir(hf_dir: str, files: dict[str, str | dict[str, np.ndarray]]) -> None:
  """Writes `files` (name -> text, or tensors for a .safetensors file) into `hf_dir`."""
  staged = fs.Staged(hf_dir, "spmdtask_hf_")  # safetensors writes a local file
  try:
    for name, content in files.items():
      if isinstance(content, str):
        fs.write_text(os.path.join(staged.local, name), content)
      else:
        st_numpy.save_file(content, os.path.join(staged.local, name), metadata={"format": "pt"})
  except BaseException:
    staged.close(upload=False)
    raise
  staged.close()
