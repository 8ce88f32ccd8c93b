"""Packing: pieces, first-fit rows, the target convention; a packed row's per-token losses
equal those of its documents run alone."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from spmdtask.inputs import packing
from spmdtask.layers.transformer import TransformerLm


def test_pieces_overlap_by_one_token_so_each_prediction_is_made_once():
  parts = packing.pieces(np.asarray([3, 1, 10, 4]), seq_len=4)
  # doc 1 (one token) predicts nothing; doc 2 (10 tokens) starts pieces at 0, 3, 6.
  np.testing.assert_array_equal(parts, [[0, 0, 3], [2, 0, 4], [2, 3, 4], [2, 6, 4], [3, 0, 4]])
  assert sum(n - 1 for n in parts[:, 2]) == (3 - 1) + (10 - 1) + (4 - 1)


def test_first_fit_places_in_the_first_open_row_with_room():
  rows = packing.first_fit(np.asarray([5, 4, 3, 2, 1, 3]), seq_len=8, max_open_rows=2)
  # 5 -> row0 (room 3); 4 -> row1 (4); 3 -> row0 (full, closed); 2 -> row1 (2);
  # 1 -> row1 (1); 3 -> row2.
  assert rows == [[0, 2], [1, 3, 4], [2 + 3]]
  # With one open row the oldest closes first: 5 | 4,3 | 2,1,3.
  assert packing.first_fit(np.asarray([5, 4, 3, 2, 1, 3]), 8, max_open_rows=1) == [
      [0], [1, 2], [3, 4, 5]]
  assert packing.efficiency(rows, np.asarray([5, 4, 3, 2, 1, 3]), 8) == 18 / 24


def test_rows_follow_the_target_convention():
  b = packing.make_rows([[np.asarray([7, 8, 9]), np.asarray([4, 5])]], seq_len=6)
  np.testing.assert_array_equal(b["inputs"], [[7, 8, 9, 4, 5, 0]])
  np.testing.assert_array_equal(b["targets"], [[8, 9, 0, 5, 0, 0]])
  np.testing.assert_array_equal(b["weights"], [[1, 1, 0, 1, 0, 0]])
  np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 0]])
  np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 0]])


def test_masks_weigh_each_target_by_the_mask_of_the_token_it_predicts():
  toks = [np.asarray([7, 8, 9, 10]), np.asarray([4, 5, 6])]
  masks = [np.asarray([0, 0, 1, 1]), np.asarray([1, 0, 1])]  # mask[0] predicts nothing
  b = packing.make_rows([toks], seq_len=8, row_masks=[masks])
  np.testing.assert_array_equal(b["targets"], [[8, 9, 10, 0, 5, 6, 0, 0]])
  np.testing.assert_array_equal(b["weights"], [[0, 1, 1, 0, 0, 1, 0, 0]])
  np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1, 2, 2, 2, 0]])
  # Without masks every prediction weighs 1, as before; a piece with no target packs at 0.
  np.testing.assert_array_equal(packing.make_rows([toks], 8)["weights"], [[1, 1, 1, 0, 1, 1, 0, 0]])
  none = packing.make_rows([toks], 8, [[np.asarray([1, 0, 0, 0]), masks[1]]])
  np.testing.assert_array_equal(none["weights"], [[0, 0, 0, 0, 0, 1, 0, 0]])


def test_pieces_of_a_long_masked_document_weigh_each_target_once():
  rng = np.random.default_rng(1)
  n, seq_len = 23, 8
  doc, mask = rng.integers(0, 50, n), rng.integers(0, 2, n)
  parts = packing.pieces(np.asarray([n]), seq_len)
  rows = [[(doc[s:s + m], mask[s:s + m])] for _, s, m in parts]  # one piece a row
  b = packing.make_rows([[t for t, _ in r] for r in rows], seq_len, [[m for _, m in r] for r in rows])
  # Each prediction t_i -> t_{i+1} of the document is made once, weighted mask[i+1].
  got = {}
  for (_, s, m), w, t in zip(parts, b["weights"], b["targets"]):
    for i in range(m - 1):
      assert t[i] == doc[s + i + 1] and (s + i) not in got
      got[s + i] = w[i]
  assert sorted(got) == list(range(n - 1))
  np.testing.assert_array_equal([got[i] for i in range(n - 1)], mask[1:])


def _xent(logits, targets):
  return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def test_packed_row_gives_the_per_token_losses_of_its_documents_alone():
  model = TransformerLm(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, d_ff=64, remat_policy=None)
  rng = np.random.default_rng(0)
  lengths = np.asarray([9, 30, 5, 17, 2, 40, 12])
  docs = [rng.integers(0, 64, n).astype(np.int32) for n in lengths]
  seq_len = 32
  parts = packing.pieces(lengths, seq_len)
  rows = packing.first_fit(parts[:, 2], seq_len, max_open_rows=4)
  segments = [[docs[d][s:s + n] for d, s, n in parts[row]] for row in rows]
  batch = packing.make_rows(segments, seq_len)
  assert len(rows) < len(parts)  # something was packed together
  params = model.init(jax.random.key(0), jnp.asarray(batch["inputs"][:1]))["params"]
  logits = model.apply({"params": params}, jnp.asarray(batch["inputs"]),
                       jnp.asarray(batch["positions"]),
                       segment_ids=jnp.asarray(batch["segment_ids"]))
  packed = _xent(logits, batch["targets"])
  # Every piece alone, as its own row from position 0 (right-padded: causal attention keeps
  # the padding out of the real tokens' logits); one batch, one compile.
  alone_tokens = np.zeros((len(parts), seq_len), np.int32)
  for i, (d, s, n) in enumerate(parts):
    alone_tokens[i, :n] = docs[d][s:s + n]
  alone = _xent(model.apply({"params": params}, jnp.asarray(alone_tokens))[:, :-1],
                alone_tokens[:, 1:])
  checked = 0
  for r, row in enumerate(rows):
    at = 0
    for i in row:
      n = parts[i, 2]
      np.testing.assert_allclose(packed[r, at:at + n - 1], alone[i, :n - 1], rtol=1e-5, atol=1e-5)
      assert (batch["weights"][r, at:at + n - 1] == 1).all() and batch["weights"][r, at + n - 1] == 0
      at, checked = at + n, checked + n - 1
  assert checked == int(batch["weights"].sum()) == int(sum(lengths - 1))
  # The model's loss reads segment_ids and positions from the batch: the same numbers.
  loss, aux = model.apply({"params": params}, {k: jnp.asarray(v) for k, v in batch.items()},
                          method=model.loss)
  np.testing.assert_allclose(float(aux["loss"].sum), float((packed * batch["weights"]).sum()),
                             rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(aux["loss"].sum / aux["loss"].weight), rtol=1e-6)
