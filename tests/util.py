"""Shared test helpers: build an experiment's run config, train it in-process on a device subset;
compare float32 results at tolerances that follow from float32 and the arrays' scale."""
import functools
import math

import fiddle as fdl
import jax
import numpy as np

from configs import lm
from spmdtask.run import loop
from spmdtask import main
from spmdtask.core import program as program_lib, sharding


def build_run(exp: str, overrides=(), edit=None):
  """The built RunConfig of a registered experiment with `--fdl_set`-style overrides.

  `edit(cfg)`, if given, changes the unbuilt fiddle config in place first.
  """
  cfg = main.resolved_config(exp, list(overrides))
  if edit:
    edit(cfg)
  return fdl.build(cfg)


def train_steps(exp: str, num_steps: int, devices=None, overrides=(), edit=None):
  """Trains `num_steps` steps with the production loop on `devices` (all by default).

  Returns (losses, canonical params as numpy, program, live state).
  """
  run = build_run(exp, list(overrides) + [f"task.train.num_train_steps={num_steps}"], edit)
  state, program, losses = loop.train(run, devices=devices)
  params = jax.device_get(program.to_canonical(state).params)
  return np.asarray(losses), params, program, state


def train_steps_once(exp: str, num_steps: int, num_devices: int | None = None, overrides=()):
  """`train_steps` on the first `num_devices` devices (all by default), run once per process
  for the same arguments: tests (of any file) that train the same model the same way share
  the run. Its results are read-only to them."""
  return _train_steps_once(exp, num_steps, num_devices, tuple(overrides))


@functools.lru_cache(maxsize=None)  # (positional: lru_cache keys on how arguments are passed)
def _train_steps_once(exp, num_steps, num_devices, overrides):
  devices = None if num_devices is None else jax.devices()[:num_devices]
  return train_steps(exp, num_steps, devices, overrides)


TINY_LM_TOKENS = lm.TinyLm.batch_size * lm.TinyLm.seq_len  # the terms of a TinyLm gradient's sums
EPS32 = float(np.finfo(np.float32).eps)  # 2**-23 = 1.19e-7


def f32_atol(want, terms: int = 1) -> float:
  """The absolute tolerance for float32 values that equal `want` up to rounding order.

  Another schedule, microbatching, sharding or CPU (another vector width, as with
  --xla_cpu_max_isa=SSE4_2; another matmul blocking) sums the same float32 terms in another
  order; each result then moves by about eps32 * scale * sqrt(terms) (rounding errors of a
  sum add up as a random walk), where scale is that of the summands, not of the result: an
  element near 0 that is a sum of cancelling terms keeps the error of the terms. The array's
  largest magnitude stands for that scale (a fixed atol such as 1e-7 does not: it is 1 ulp
  at 1.0 and passed or failed with the machine). The factor 8 covers the roundings around
  the sum (the largest difference measured in these tests, on both code paths, was 1.1
  eps32 * max|want| * sqrt(terms): TinyLm's weights after Adam steps). It stays far below
  what a bug moves: a missing microbatch, row or tied-weight half, or a wrong 1/n scale,
  changes the largest values by 1e-3 of max|want| or more: 260x this atol for terms = 16,
  33x for the 1024 tokens of a TinyLm batch.
  """
  return 8 * EPS32 * float(np.max(np.abs(want), initial=0.0)) * math.sqrt(terms)


def assert_close_f32(got, want, *, terms: int = 1, rtol: float = 1e-5, err_msg: str = ""):
  """got == want up to float32 rounding order: atol `f32_atol(want, terms)`, rtol kept tight."""
  want = np.asarray(want)
  np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=f32_atol(want, terms),
                             err_msg=err_msg)


def assert_trees_close(a, b, *, terms: int = 1, rtol: float = 1e-5, atol: float | None = None):
  """`assert_close_f32` on each leaf pair of two trees of one structure (b holds the wants).

  An explicit `atol` only where more than float32 rounding sets the error (Adam's first
  steps move a weight by ~lr whatever its gradient's size; the caller says why).
  """
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  flat_b = jax.tree.leaves(b)
  assert len(flat_a) == len(flat_b)
  for (path, x), y in zip(flat_a, flat_b):
    y = np.asarray(y)
    np.testing.assert_allclose(np.asarray(x), y, rtol=rtol,
                               atol=f32_atol(y, terms) if atol is None else atol,
                               err_msg=sharding.path_str(path))


def assert_trees_equal(a, b):
  """Leaf for leaf bitwise equal."""
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  flat_b = jax.tree.leaves(b)
  assert len(flat_a) == len(flat_b)
  for (path, x), y in zip(flat_a, flat_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=sharding.path_str(path))


@functools.lru_cache(maxsize=None)
def program_and_state(exp: str, num_devices: int):
  """A program for registered `exp` on the first `num_devices` devices and its fresh state.

  With one device the mesh is all ones (the experiment's mesh shape is overridden).
  """
  overrides = []
  if num_devices == 1:
    run = build_run(exp)
    overrides = [f"task.ici_mesh_shape={(1,) * len(run.task.mesh_axis_names)}"]
  run = build_run(exp, overrides)
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0),
                              devices=jax.devices()[:num_devices])
  return program, program.init()


def tiny_hf_tokenizer(directory: str, texts, vocab_size: int = 300, eos: str | None = "<eos>"):
  """A byte-level BPE tokenizer.json trained on `texts` with the `tokenizers` library, Llama
  style (a <bos> post-processor), written to directory (with a tokenizer_config.json naming
  `eos` as its eos_token unless None). Returns the tokenizer.json path."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=g-import-not-at-top
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "tokenizer.json")
  tok.save(path)
  if eos is not None:
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump({"bos_token": "<bos>", "eos_token": {"content": eos}}, f)
  return path


def flipped_array_reasons(array_path: str) -> tuple[str, str]:
  """The two ways a restore names an array whose stored bytes were flipped in place: the
  chunk still decompresses and its fingerprint differs, or the compressed stream no longer
  decodes (TensorStore's read error, spmdtask.run.checkpoint_check.read_failure); which one
  depends on where in the compressed chunk the bytes land."""
  return (f"the array {array_path} does not hold the values it was saved with (its "
          "fingerprint, taken on the devices at the save, differs: its bytes changed after the "
          "save, e.g. on a disk, in a bucket or in a copy)",
          f"the array {array_path} cannot be decoded (its bytes changed after the save, e.g. "
          "on a disk, in a bucket or in a copy)")


def flip_middle_of_largest(item_dir: str, read, write) -> tuple[str, str]:
  """Flips 256 bytes in the middle of the data file that holds the most bytes of an orbax
  array item (`item_dir`, e.g. a step's params/; local or gs://), found from its OCDBT index
  as `checkpoint_check` reads it: the B-tree nodes map each zarr key to (file, offset,
  length). Files are read and written with `read(path) -> bytes` and `write(path, bytes)`;
  the size is kept. Returns (the file relative to item_dir, the array whose chunk holds
  the middle, as 'a/b/c')."""
  import urllib.parse  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  url = item_dir if item_dir.startswith("gs://") else "file://" + item_dir
  kv = ts.KvStore.open(url.rstrip("/") + "/").result()
  nodes, values = [ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"]], []
  while nodes:
    node = ts.ocdbt.dump(kv, nodes.pop()).result()
    for entry in node.get("entries", []):
      for v in entry.values():
        if isinstance(v, str) and v.startswith("btreenode:"):
          nodes.append(v)
        elif isinstance(v, str) and v.startswith("value:"):
          _, base, rel, offset, length = v.split(":")
          values.append((entry["key"].decode(), urllib.parse.unquote(base + rel), int(offset),
                         int(length)))
  held = {}
  for _, path, _, length in values:
    held[path] = held.get(path, 0) + length
  rel = max(held, key=held.get)
  data = bytearray(read(f"{item_dir.rstrip('/')}/{rel}"))
  mid = len(data) // 2
  data[mid:mid + 256] = bytes(b ^ 0xFF for b in data[mid:mid + 256])
  write(f"{item_dir.rstrip('/')}/{rel}", bytes(data))
  (key,) = [k for k, path, offset, length in values
            if path == rel and offset <= mid < offset + length]
  return rel, key.split("/")[0].replace(".", "/")


def packed_text_corpus(tmp_path_factory) -> str:
  """A byte-level corpus of 24 short documents (tools/prepare_text_data.py), for packed-row
  tests (TextLm): the prepared data dir."""
  from tools import prepare_text_data  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  words = "a packed row holds whole documents each closed by its end id".split()
  for i in range(24):
    text = " ".join(words[j] for j in rng.integers(0, len(words), int(rng.integers(3, 60))))
    (root / f"doc{i:02d}.txt").write_text(f"document {i}: {text}.\n")
  out = str(root / "bytes")
  prepare_text_data.prepare(str(root / "*.txt"), out, "bytes", eval_fraction=0.2, num_shards=2)
  return out
