"""An import written one tensor at a time (spmdtask/run/streamed_checkpoint.py): the same
checkpoint as one built whole (params, fresh optimizer state, fingerprints checked by the
restore), with host memory bounded by a few tensors, not the model."""
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

from spmdtask.hf import convert, files
from spmdtask.hf.jobs import checkpoints as hf_checkpoints, imports
from spmdtask.run import checkpoints, streamed_checkpoint
from tests.hf.test_llama import CONFIG, LLAMA, _hf_tensors, _write_hf

# 12 layers, 47 MiB in float32: ~50x its largest tensor, ~5x the Python objects an import
# makes (a model built, programs compiled), which tracemalloc counts too.
BIG = {**CONFIG, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 12,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "torch_dtype": "bfloat16"}


@pytest.fixture
def hf_dir(tmp_path):
  path = str(tmp_path / "big_llama")
  _write_hf(path, BIG, _hf_tensors(BIG, ml_dtypes.bfloat16), shards=3)
  return path


def test_an_import_holds_a_few_tensors_not_the_model(hf_dir, tmp_path, monkeypatch):
  # The optimizer state's blocks as small beside this model as 64 MiB beside a real one.
  monkeypatch.setattr(streamed_checkpoint, "BLOCK_BYTES", 1 << 20)
  job = str(tmp_path / "job")
  tracemalloc.start()
  try:
    lines = imports.from_hf(hf_dir, job)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  want = convert.to_params(*files.read_hf(hf_dir))
  model = sum(x.nbytes for x in jax.tree.leaves(want))  # float32, as the import stores it
  # What Python held at once (tracemalloc: numpy's arrays and every Python object): here
  # 12.5 MB, 0.27 of the model, of which ~8 MB are the objects of building the model and
  # compiling, the rest ~4 of its largest tensor as float32 (one read, its float32 and
  # stored copies, the fresh optimizer state's slice). Built whole it held 3.3x the model.
  assert peak <= 0.35 * model, (peak, model)
  # The restore recomputes every array's fingerprint and compares (or raises).
  prog = hf_checkpoints.program(lines, LLAMA)
  state, step = checkpoints.restore_state(job, prog)
  assert step == 0
  canonical = jax.device_get(prog.to_canonical(state))
  jax.tree.map(np.testing.assert_array_equal, canonical.params, want)
  jax.tree.map(np.testing.assert_array_equal, canonical.opt_state,
               jax.device_get(prog.tx.init(canonical.params)))


def test_an_optimizer_that_reads_the_weights_gets_its_state_built_whole(tmp_path, monkeypatch):
  small = str(tmp_path / "hf")
  _write_hf(small, CONFIG, _hf_tensors(CONFIG, np.float32), shards=1)
  streamed = imports.from_hf(small, str(tmp_path / "streamed"))
  monkeypatch.setattr(streamed_checkpoint, "fresh_opt_state", lambda program: None)
  imports.from_hf(small, str(tmp_path / "whole"))
  prog = hf_checkpoints.program(streamed, LLAMA)
  got = [jax.device_get(prog.to_canonical(checkpoints.restore_state(str(tmp_path / j), prog)[0]))
         for j in ("streamed", "whole")]
  jax.tree.map(np.testing.assert_array_equal, got[0], got[1])
  assert (checkpoints.read_meta(str(tmp_path / "streamed"))["fingerprints"]
          == checkpoints.read_meta(str(tmp_path / "whole"))["fingerprints"])


def test_whether_an_init_reads_the_weights():
  params = {"w": jax.ShapeDtypeStruct((3, 4), np.float32),
            "b": jax.ShapeDtypeStruct((4,), np.float32)}
  reads = streamed_checkpoint.init_reads_weights
  assert not reads(optax.adamw(1e-3), params)
  assert not reads(optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(1e-3)), params)
  assert not reads(optax.masked(optax.adamw(1e-3), {"w": True, "b": False}), params)
  assert reads(optax.contrib.schedule_free_adamw(1e-3), params)  # it keeps a copy of them
