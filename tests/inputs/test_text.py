"""Prepared text data: the prepare tool, tokenizers, packed batches per process and on resume,
vocabulary checks, prompts; a 2-process run resumes on 1 process on the same batches."""
import glob
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs import text, tokenizers
from spmdtask.core.host_input import PromptInput
from spmdtask.inputs.text import PackedLmInput, TextPromptInput
from tools import prepare_text_data

WORDS = "the of a packed row holds whole documents each closed by its end id".split()


def _write_corpus(root, num_docs=24, seed=0, max_words=120):
  rng = np.random.default_rng(seed)
  os.makedirs(root, exist_ok=True)
  for i in range(num_docs):
    n = int(rng.integers(3, max_words))
    words = " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), n))
    with open(os.path.join(root, f"doc{i:02d}.txt"), "w") as f:
      f.write(f"document {i}: {words}.\n")
  return os.path.join(root, "*.txt")


@pytest.fixture(scope="session")
def byte_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  pattern = _write_corpus(str(root / "txt"))
  out = str(root / "bytes")
  prepare_text_data.prepare(pattern, out, "bytes", eval_fraction=0.2, num_shards=3)
  return out


@pytest.fixture(scope="session")
def short_dir(tmp_path_factory):
  """Documents of at most 63 bytes: each is one piece of a 64-token row."""
  root = tmp_path_factory.mktemp("short")
  pattern = _write_corpus(str(root / "txt"), num_docs=80, max_words=8)
  out = str(root / "bytes")
  meta = prepare_text_data.prepare(pattern, out, "bytes", eval_fraction=0.1, num_shards=3)
  assert max(np.load(os.path.join(out, "train_index.npz"))["length"]) <= 64, meta
  return out


def _input(data_dir, **kw):
  kw = {"batch_size": 4, "seq_len": 64, "process_index": 0, "process_count": 1, **kw}
  return PackedLmInput(data_dir=data_dir, **kw)


def test_prepared_documents_are_the_files_closed_by_eod(byte_dir):
  with open(os.path.join(byte_dir, "meta.json")) as f:
    meta = json.load(f)
  assert (meta["tokenizer"], meta["vocab_size"], meta["eod_id"]) == ("bytes", 257, 256)
  train, evals = meta["splits"]["train"], meta["splits"]["eval"]
  assert (train["num_documents"], evals["num_documents"]) == (19, 5)
  assert len(train["files"]) == 3 and not set(train["sources"]) & set(evals["sources"])
  reader = text.DocumentReader(byte_dir, "train", "data_dir")
  docs = reader.read(range(train["num_documents"]))
  assert sum(len(d) for d in docs.values()) == train["num_tokens"]
  src = os.path.join(os.path.dirname(byte_dir), "txt", train["sources"][7])
  with open(src, "rb") as f:
    assert docs[7].tolist() == list(f.read()) + [256]


def test_sentencepiece_tokenizer_round_trips_text(tmp_path):
  pattern = os.path.join(os.path.dirname(os.__file__), "[a-c]*.py")  # Python's own sources
  meta = prepare_text_data.prepare(pattern, str(tmp_path), "sentencepiece", vocab_size=400)
  assert (meta["tokenizer"], meta["vocab_size"], meta["eod_id"]) == ("sentencepiece", 400, 1)
  tok = tokenizers.load(str(tmp_path), meta)
  source = "def f(x):\n\treturn  x ** 2  # two spaces\n"
  ids = tok.encode(source)
  assert tok.decode(ids + [tok.eod_id]) == source and max(ids) < 400
  assert meta["splits"]["train"]["num_tokens"] < 0.75 * sum(
      os.path.getsize(os.path.join(os.path.dirname(pattern), s))
      for s in meta["splits"]["train"]["sources"])  # fewer tokens than bytes


def test_a_vocab_size_sentencepiece_refuses_is_a_config_error(tmp_path, capsys, monkeypatch):
  """Too few pieces for the corpus's characters (the minimum computed, exact), or more than
  it has: one paragraph naming --vocab_size, exit 2 (the tool's main)."""
  txt = tmp_path / "txt"
  txt.mkdir()
  for i in range(4):  # 100 distinct characters besides the ASCII ones
    (txt / f"{i}.txt").write_text(f"doc {i}: " + "".join(chr(0x4e00 + j) for j in range(100)))
  texts = prepare_text_data.read_documents(str(txt / "*.txt"))[1]
  need = tokenizers.sentencepiece_min_vocab(texts)
  assert need == len(set("".join(texts))) + 260
  with pytest.raises(ConfigError, match=f"--vocab_size={need - 1} is too small for this corpus: "
                     f"SentencePiece keeps each of its {need - 260} distinct characters.*"
                     f"Pass --vocab_size={need} or more"):
    prepare_text_data.make_tokenizer("sentencepiece", texts, str(tmp_path), need - 1)
  assert prepare_text_data.make_tokenizer("sentencepiece", texts, str(tmp_path),
                                          need).vocab_size == need
  monkeypatch.setattr(sys, "argv", ["prepare_text_data.py", f"--input={txt}/*.txt",
                                    f"--output_dir={tmp_path / 'out'}",
                                    "--tokenizer=sentencepiece"])
  with pytest.raises(SystemExit) as done:
    prepare_text_data.main()
  assert done.value.code == 2
  (line,) = capsys.readouterr().err.splitlines()
  assert line.startswith("prepare_text_data: config error: --vocab_size=4096 (the default): "
                         "SentencePiece refused it on this corpus: Vocabulary size too high")


def test_processes_make_their_rows_of_the_same_global_batches(byte_dir):
  whole = _input(byte_dir)
  halves = [_input(byte_dir, process_index=p, process_count=2) for p in range(2)]
  for _ in range(4):
    full = next(whole)
    parts = [next(p) for p in halves]
    for key in full:
      np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[key])
    real = (full["segment_ids"] > 0).sum() / full["segment_ids"].size
    assert whole.last_batch_efficiency == halves[0].last_batch_efficiency == pytest.approx(real)
  assert 0.9 < whole.efficiency(0) <= 1.0


def test_position_restored_on_another_process_count_continues_exactly(byte_dir):
  ref = _input(byte_dir, batch_size=16)
  expected = [next(ref) for _ in range(12)]  # wraps around the epoch's rows
  assert len(ref._plan[1]) < 12 * 16
  two = [_input(byte_dir, batch_size=16, process_index=p, process_count=2) for p in range(2)]
  for _ in range(5):
    for p in two:
      next(p)
  one = _input(byte_dir, batch_size=16)
  one.set_state(two[0].get_state())
  for want in expected[5:]:
    got = next(one)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_eval_split_is_one_pass_with_a_partial_last_batch(byte_dir):
  inp = _input(byte_dir, split="eval", repeat=False)
  batches = list(inp)
  assert sum(len(b["inputs"]) for b in batches) == inp.num_examples == len(inp._plan[1])
  doc_tokens = json.load(open(os.path.join(byte_dir, "meta.json")))["splits"]["eval"]["num_tokens"]
  assert sum(b["weights"].sum() for b in batches) == doc_tokens - 5  # one per document


def test_vocabulary_mismatch_and_foreign_ids_are_errors(byte_dir, tmp_path):
  from spmdtask.layers.transformer import TransformerLm  # pylint: disable=g-import-not-at-top
  model = TransformerLm(vocab_size=256, d_model=8, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=8, d_ff=8)
  with pytest.raises(ConfigError, match=r"task.model.vocab_size=256.*vocab_size=257"):
    _input(byte_dir, model=model)
  with pytest.raises(ConfigError, match="data_dir=.*holds no meta.json"):
    _input(str(tmp_path))
  bad = tmp_path / "bad"
  os.makedirs(bad)
  for name in os.listdir(byte_dir):
    os.symlink(os.path.join(byte_dir, name), bad / name)
  meta = json.load(open(os.path.join(byte_dir, "meta.json")))
  os.remove(bad / "meta.json")
  with open(bad / "meta.json", "w") as f:
    json.dump({**meta, "vocab_size": 200}, f)
  with pytest.raises(ValueError, match="do not fit vocab_size=200"):
    _input(str(bad)).batch_at(0)


def test_prompts_are_document_starts_with_text(byte_dir):
  inp = TextPromptInput(data_dir=byte_dir, batch_size=2, prompt_len=12, num_examples=3,
                        process_index=0, process_count=1)
  first = next(inp)
  assert first["prompts"].shape == (2, 12) and first["ids"].tolist() == [0, 1]
  assert inp.tokenizer.decode(first["prompts"][0]).startswith("document ")
  assert isinstance(inp, PromptInput)  # the decode runner reads its tokenizer
  assert len(next(inp)["ids"]) == 1  # 3 examples: a partial last batch


def _log(job: str) -> str:
  return "".join(open(f).read() for f in glob.glob(os.path.join(job, "logs", "*INFO*")))


STEPS = ("task.model.num_layers=1", "task.model.vocab_size=257", "task.train.eval_interval_steps=0",
         "task.train.summary_interval_steps=1", "task.train.log_interval_steps=1",
         "datasets['train'].seq_len=64", "datasets['train'].batch_size=8",
         "decode_datasets['prompts'].num_examples=4")


def test_documents_each_process_reads_are_its_rows_only(byte_dir, short_dir):
  """Each of 2 processes reads the documents of its own rows: with one-piece documents the
  two read disjoint sets that together are the 1-process reads; with documents cut into
  pieces over both processes' rows, those are read by both."""
  counts = {}
  for name, data_dir in (("short", short_dir), ("long", byte_dir)):
    whole = _input(data_dir, batch_size=8)
    halves = [_input(data_dir, batch_size=8, process_index=p, process_count=2) for p in range(2)]
    for _ in range(4):
      next(whole)
      for p in halves:
        next(p)
    counts[name] = (whole.records_read, [p.records_read for p in halves])
  print("documents read in 4 batches, 1 process vs 2:", counts)
  one, two = counts["short"]
  assert sum(two) == one and min(two) > 0
  one, two = counts["long"]
  assert max(two) < one <= sum(two)


def _records_read(text: str) -> list[int]:
  return [int(n) for n in re.findall(r"has read (\d+) records", text)]


# (Two processes on packed text, resumed on one on the same batches, measured once; two
# processes reading and resuming: tests/inputs/test_tfdata.py, tests/run/test_distributed.py.)


def test_hf_tokenizer_json_prepares_data_and_decodes_text(tmp_path):
  from tests import util  # pylint: disable=g-import-not-at-top
  pattern = _write_corpus(str(tmp_path / "txt"), num_docs=6)
  texts = [open(p).read() for p in sorted(glob.glob(pattern))]
  tok_json = util.tiny_hf_tokenizer(str(tmp_path / "model"), texts, eos=None)
  with pytest.raises(ConfigError, match="--eod_token"):  # no tokenizer_config.json: say so
    prepare_text_data.prepare(pattern, str(tmp_path / "no_eod"), f"hf:{tok_json}")
  out = str(tmp_path / "hf")
  meta = prepare_text_data.prepare(pattern, out, f"hf:{tok_json}", eval_fraction=0.2,
                                   eod_token="<eos>")
  tok = tokenizers.load(out, meta)
  assert (meta["tokenizer"], meta["vocab_size"], meta["eod_id"]) == ("hf", tok.vocab_size, 1)
  reader = text.DocumentReader(out, "train", "data_dir")
  src = os.path.join(str(tmp_path / "txt"), meta["splits"]["train"]["sources"][0])
  with open(src) as f:
    source = f.read()
  doc = reader.read([0])[0].tolist()
  assert doc == [0] + tok.encode(source)[1:] + [1]  # <bos> (its post-processor) ... <eos>
  assert tok.decode(doc) == source  # special tokens dropped
  prompts = TextPromptInput(data_dir=out, split="eval", batch_size=1, prompt_len=8,
                            num_examples=1, process_index=0, process_count=1)
  with open(os.path.join(str(tmp_path / "txt"), meta["splits"]["eval"]["sources"][0])) as f:
    first_eval = f.read()
  prompt = prompts.tokenizer.decode(prompts.batch_at(0)["prompts"][0])
  assert len(prompt) > 8 and first_eval.startswith(prompt)


def test_a_missing_tokenizer_file_is_a_config_error_naming_the_field(byte_dir, tmp_path):
  with pytest.raises(ConfigError, match=r"^prompts.tokenizer='sentencepiece:/no/tokenizer.model'"
                     r": there is no file '/no/tokenizer.model'"):
    tokenizers.from_spec("sentencepiece:/no/tokenizer.model", field="prompts.tokenizer")
  data = str(tmp_path / "data")
  shutil.copytree(byte_dir, data)
  meta = json.load(open(os.path.join(data, "meta.json")))
  json.dump({**meta, "tokenizer": "sentencepiece"}, open(os.path.join(data, "meta.json"), "w"))
  prompts = TextPromptInput(data_dir=data, batch_size=2, prompt_len=12, num_examples=3,
                            process_index=0, process_count=1)
  with pytest.raises(ConfigError, match=r"decode_datasets\[\.\.\.\]\.data_dir=.*names a "
                     "sentencepiece tokenizer, but there is no tokenizer.model beside it"):
    prompts.tokenizer  # pylint: disable=pointless-statement


def test_masked_documents_pack_their_masks_piece_by_piece(tmp_path):
  """Documents with target masks (meta target_mask): a long one cut into overlapping pieces,
  short ones packed together; every target is weighted by its token's mask, once."""
  rng = np.random.default_rng(3)
  lengths = [70, 9, 21, 5, 33]
  docs = [rng.integers(0, 256, n).tolist() for n in lengths]
  masks = [rng.integers(0, 2, n).tolist() for n in lengths]
  out = str(tmp_path / "masked")
  os.makedirs(out)
  splits = {"train": {"files": text.write_split(out, "train", docs, 2, masks)}}
  with open(os.path.join(out, "meta.json"), "w") as f:
    json.dump({"tokenizer": "bytes", "vocab_size": 257, "eod_id": 256, "splits": splits,
               "target_mask": True}, f)
  reader = text.DocumentReader(out, "train", "data_dir")
  assert reader.read([1, 3])[3].tolist() == docs[3] and reader.masks[3].tolist() == masks[3]
  inp = _input(out, batch_size=8, seq_len=24, repeat=False)
  batch = inp.batch_at(0)
  assert inp.target_mask and inp.num_examples <= 8  # one batch holds the whole epoch
  # Map every weighted prediction back to (document, token position) through the plan.
  parts, rows = inp._plan  # pylint: disable=protected-access
  seen = {}
  for r, row in enumerate(rows):
    at = 0
    for i in row:
      d, s, m = (int(v) for v in parts[i])
      np.testing.assert_array_equal(batch["inputs"][r, at:at + m], docs[d][s:s + m])
      for k in range(m - 1):
        assert (d, s + k + 1) not in seen
        seen[d, s + k + 1] = batch["weights"][r, at + k]
      at += m
  for d, n in enumerate(lengths):
    np.testing.assert_array_equal([seen[d, j] for j in range(1, n)], masks[d][1:])
  assert batch["weights"].sum() == sum(sum(m[1:]) for m in masks)
  # Without target_mask in meta.json the same files read as plain text: all weights 1.
  with open(os.path.join(out, "meta.json"), "w") as f:
    json.dump({"tokenizer": "bytes", "vocab_size": 257, "eod_id": 256, "splits": splits}, f)
  plain = _input(out, batch_size=8, seq_len=24, repeat=False)
  assert not plain.target_mask
  assert plain.batch_at(0)["weights"].sum() == sum(n - 1 for n in lengths)
