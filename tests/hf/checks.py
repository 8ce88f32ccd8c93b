"""What the Hugging Face tests share: the fixtures made by transformers
(tests/tools/data/<family>/: config.json, model.safetensors, HF's logits.npy of tokens.npy;
tests/tools/data/README.md says how) and the checks against them."""
import json
import os

import jax
import numpy as np

from tests.subproc import REPO

DATA = os.path.join(REPO, "tests", "tools", "data")


def fixture(family: str):
  """(HF dir, its config.json, tokens, HF's logits of them) of a family's fixture."""
  hf = os.path.join(DATA, family)
  with open(os.path.join(hf, "config.json")) as f:
    cfg = json.load(f)
  tokens, want = (np.load(os.path.join(hf, n)) for n in ("tokens.npy", "logits.npy"))
  return hf, cfg, tokens, want


def assert_hf_logits(model, params, tokens, want):
  ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
  # float32 both sides, 2 layers of width 64, |logits| <= 8.5: a few ulps of 8.5 per
  # matmul; a token routed to another expert would differ by O(1).
  err = float(np.abs(ours - want).max())
  assert err <= 1e-4, err


def assert_bit_identical(got, want):
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
    assert got[k].tobytes() == want[k].tobytes(), k
