"""TransformerLm.loss on masked, packed conversations (supervised fine-tuning): equal to
transformers' masked cross entropy, normalized by the target count, not per row; a row
packing three conversations gives each target token the loss it has in a row of its own.

The fixture (tests/tools/data/llama/: a tiny random HF Llama, three conversations with
their assistant spans and HF's masked losses) was made with torch (tests/tools/data/
README.md); this test needs none: the model comes in through spmdtask.hf.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.inputs import packing
from spmdtask.layers import xent
from spmdtask.hf import convert, files, llama, model_overrides
from tests import util

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                    "data", "llama")
SEQ_LEN = 80  # the three conversations (23 + 12 + 30 tokens) in one row, with padding


def _conversations():
  """(token arrays, target-mask arrays) of the three fixture conversations."""
  tokens, mask, lengths = (np.load(os.path.join(DATA, f"sft_{n}.npy"))
                           for n in ("tokens", "mask", "lengths"))
  cuts = np.cumsum(lengths)[:-1]
  return np.split(tokens, cuts), np.split(mask, cuts)


def masked_rows(rows_of_docs, seq_len):
  """packing.make_rows of the documents, weights kept only where the predicted token is a
  target (the data contract: weight i is mask[i + 1] of its document)."""
  batch = packing.make_rows([[t for t, _ in row] for row in rows_of_docs], seq_len)
  for r, row in enumerate(rows_of_docs):
    at = 0
    for toks, mask in row:
      batch["weights"][r, at:at + len(toks) - 1] *= mask[1:]
      at += len(toks)
  return batch


@pytest.fixture(scope="module")
def hf_llama():
  """(model, params) of the fixture Llama converted by spmdtask.hf in memory (what --from_hf
  writes to its step-0 checkpoint: tests/hf/test_llama.py reads one back)."""
  cfg, tensors = files.read_hf(DATA)
  model = util.build_run(llama.FAMILY.experiment, model_overrides.overrides(cfg)).task.model
  return model, convert.to_params(cfg, tensors)


@pytest.mark.parametrize("tiles", [1, 4])
def test_masked_loss_of_packed_conversations_equals_transformers(hf_llama, tiles):
  model, params = hf_llama
  model = model.clone(loss_vocab_tiles=tiles)
  docs = list(zip(*_conversations()))
  want = np.load(os.path.join(DATA, "sft_loss.npy"))  # per conversation, then all three
  loss = jax.jit(lambda b: model.apply({"params": params}, b, method=model.loss))
  packed = masked_rows([docs], SEQ_LEN)
  total, metrics = loss(packed)
  # float32, |token loss| <= 7.7: a few ulps of the sum over 33 targets.
  assert abs(float(total) - want[3]) <= 1e-5, (float(total), want[3])
  assert float(metrics["loss"].weight) == 33.0
  for doc, w in zip(docs, want[:3]):  # each alone: transformers' per-conversation mean
    assert abs(float(loss(masked_rows([[doc]], SEQ_LEN))[0]) - w) <= 1e-5
  # Rows of very different target counts (2 vs 20): the loss weights every target token
  # alike; a mean of per-row means would give (w0 + w1 + w2) / 3 instead.
  rows = masked_rows([[d] for d in docs], SEQ_LEN)
  assert abs(float(loss(rows)[0]) - want[3]) <= 1e-5
  assert abs(np.mean(want[:3]) - want[3]) > 1e-2  # that trap would be caught


def test_a_row_packing_three_conversations_gives_their_per_token_losses_alone(hf_llama):
  model, params = hf_llama
  docs = list(zip(*_conversations()))
  token_loss = jax.jit(lambda b: xent.cross_entropy(model.apply(
      {"params": params}, b["inputs"], b["positions"], segment_ids=b["segment_ids"]),
                                                    b["targets"]))
  packed, alone = masked_rows([docs], SEQ_LEN), masked_rows([[d] for d in docs], SEQ_LEN)
  got, each = np.asarray(token_loss(packed))[0], np.asarray(token_loss(alone))
  hf = np.load(os.path.join(DATA, "sft_token_loss.npy"))  # at the target token's position
  at = 0
  for r, (toks, mask) in enumerate(docs):
    n, w = len(toks), packed["weights"][0, at:at + len(toks) - 1] > 0
    np.testing.assert_allclose(got[at:at + n - 1][w], each[r, :n - 1][w], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[at:at + n - 1][w], hf[at + 1:at + n][mask[1:] > 0],
                               rtol=0, atol=1e-5)
    at += n
  assert at == 65 and int(packed["weights"].sum()) == 33
