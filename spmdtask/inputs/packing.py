"""Packing whole documents into fixed-length rows: a plan from lengths, then rows from tokens.

Pure functions (numpy in, numpy out); `text.PackedLmInput` uses them on a prepared corpus.

1. `pieces(lengths, seq_len)`: a document of n <= seq_len tokens is one piece; a longer
   one is cut into pieces of seq_len tokens that overlap by one token (piece k starts at
   k·(seq_len-1)), so each next-token prediction of the document is made exactly once.
   A piece is a segment of its own: positions restart at 0, and it sees no earlier piece.
2. `first_fit(piece_lengths, seq_len, max_open_rows)`: deterministic first-fit. Pieces
   are placed in order into the first open row with room; a new row opens when none
   has room, closing the oldest when `max_open_rows` are open. Rows are numbered in
   order of opening.
3. `make_rows(row_pieces, tokens)`: arrays of the rows.

Target convention: within a segment t_0..t_{m-1}, input i is t_i and target i is t_{i+1};
the segment's last token has no target (weight 0, target 0). With target masks (documents of
conversations) the weight of target i is the mask of t_{i+1}: 1 for an assistant token, else 0. Padding after the last
segment has segment id 0, position 0, weight 0. Real segments are numbered 1, 2, ... in
their row. A document closes with the end-of-document id, so its last prediction is
"end of document".
"""
import numpy as np

KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")


def pieces(lengths: np.ndarray, seq_len: int) -> np.ndarray:
  """[num_pieces, 3] int64 rows (document, start, length), documents in order.

  Documents of fewer than 2 tokens predict nothing and give no piece.
  """
  if seq_len < 2:
    raise ValueError(f"seq_len={seq_len}: packing needs at least 2 tokens per row.")
  out = []
  step = seq_len - 1
  for doc, n in enumerate(np.asarray(lengths, np.int64)):
    for start in range(0, max(int(n) - 1, 0), step):
      out.append((doc, start, min(seq_len, int(n) - start)))
  return np.asarray(out, np.int64).reshape(-1, 3)


def first_fit(piece_lengths: np.ndarray, seq_len: int, max_open_rows: int = 64) -> list[list[int]]:
  """Rows as lists of piece indices (each row's pieces in placement order)."""
  rows: list[list[int]] = []
  open_rows = np.zeros((0,), np.int64)   # row numbers, oldest first
  free = np.zeros((0,), np.int64)        # room left in each open row
  for i, n in enumerate(np.asarray(piece_lengths, np.int64)):
    fits = np.flatnonzero(free >= n)
    if fits.size:
      j = int(fits[0])
    else:
      if open_rows.size == max_open_rows:
        open_rows, free = open_rows[1:], free[1:]
      rows.append([])
      open_rows = np.append(open_rows, len(rows) - 1)
      free = np.append(free, seq_len)
      j = open_rows.size - 1
    rows[int(open_rows[j])].append(i)
    free[j] -= n
    if free[j] == 0:  # a full row can take nothing more
      open_rows, free = np.delete(open_rows, j), np.delete(free, j)
  return rows


def make_rows(row_pieces: list[list[np.ndarray]], seq_len: int,
              row_masks: list[list[np.ndarray]] | None = None) -> dict[str, np.ndarray]:
  """Batch arrays [len(row_pieces), seq_len] from each row's piece token arrays (see module doc).

  `row_masks` (optional, shaped as `row_pieces`): each piece's target mask, mask[i] = 1 when
  token i is a target; the weight at position i (target t_{i+1}) is then mask[i+1]. Without
  it every prediction weighs 1.
  """
  b = len(row_pieces)
  out = {"inputs": np.zeros((b, seq_len), np.int32), "targets": np.zeros((b, seq_len), np.int32),
         "weights": np.zeros((b, seq_len), np.float32),
         "segment_ids": np.zeros((b, seq_len), np.int32),
         "positions": np.zeros((b, seq_len), np.int32)}
  for r, segs in enumerate(row_pieces):
    at = 0
    for s, toks in enumerate(segs):
      m = len(toks)
      out["inputs"][r, at:at + m] = toks
      out["targets"][r, at:at + m - 1] = toks[1:]
      out["weights"][r, at:at + m - 1] = 1.0 if row_masks is None else row_masks[r][s][1:m]
      out["segment_ids"][r, at:at + m] = s + 1
      out["positions"][r, at:at + m] = np.arange(m)
      at += m
    if at > seq_len:
      raise ValueError(f"row {r} holds {at} tokens, more than seq_len={seq_len}.")
  return out


def efficiency(row_pieces: list[list[int]], piece_lengths: np.ndarray, seq_len: int) -> float:
  """Real tokens / row tokens of the given rows (piece indices per row); 0 for no rows."""
  if not row_pieces:
    return 0.0
  real = sum(int(piece_lengths[i]) for row in row_pieces for i in row)
  return real / (len(row_pieces) * seq_len)
