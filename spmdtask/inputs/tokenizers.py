"""Tokenizers of prepared text data and decode output: bytes, a SentencePiece model, or a
Hugging Face `tokenizer.json` (an imported model's own, via the `tokenizers` library);
and DIR/meta.json.

A prepared data dir (see tools/prepare_text_data.py) holds `meta.json`:
  tokenizer    'bytes', 'sentencepiece' or 'hf'
  vocab_size   ids are in [0, vocab_size)
  eod_id       the end-of-document id closing every document
  splits       {'train'|'eval': {'files', 'num_documents', 'num_tokens'}}
and the tokenizer file: `tokenizer.model` (SentencePiece) or `tokenizer.json` (hf).
A tokenizer spec names one outside a data dir: 'bytes', 'sentencepiece:PATH' or 'hf:PATH'.
"""
import copy
import json
from typing import Iterable

import numpy as np
import sentencepiece as spm
import tokenizers as hf_tokenizers

from spmdtask import fs
from spmdtask.errors import ConfigError

META_FILE = "meta.json"
SP_MODEL_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"  # beside tokenizer.json in a HF model dir: eos_token
_FILES = {"sentencepiece": f"a SentencePiece {SP_MODEL_FILE}", "hf": f"a Hugging Face {HF_FILE}"}


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; the end-of-document id is 256 (vocab 257)."""
  kind = "bytes"
  vocab_size = 257
  eod_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model; its eos id closes documents."""
  kind = "sentencepiece"

  def __init__(self, model_file: str):
    self.model_file = model_file
    self._sp = spm.SentencePieceProcessor(model_proto=fs.read_bytes(model_file))
    self.vocab_size = int(self._sp.vocab_size())
    self.eod_id = int(self._sp.eos_id())

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids if int(i) != self.eod_id])


class HfTokenizer:
  """A Hugging Face `tokenizer.json` (the `tokenizers` library), e.g. an imported Llama's.

  `encode` applies the tokenizer's own post-processor (Llama's adds its begin-of-text id);
  `decode` drops special tokens (keeps them: `with_special_tokens()`). The end-of-document id is `eod_token`'s, else the
  `eos_token` of a tokenizer_config.json beside the file, else None (decode-only use).
  """
  kind = "hf"
  skip_special = True

  def __init__(self, path: str, eod_token: str | None = None, eod_id: int | None = None):
    if not fs.isfile(path):
      raise ConfigError(f"The tokenizer {path!r} does not exist; give the path of a Hugging "
                        f"Face {HF_FILE} (e.g. hf:/models/Llama-3.2-1B/{HF_FILE}).")
    self.model_file = path
    self._tok = hf_tokenizers.Tokenizer.from_str(fs.read_text(path))
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    if eod_id is None:
      eod_token = eod_token or _eos_token(fs.dirname(path))
      if eod_token is not None:
        eod_id = self._tok.token_to_id(eod_token)
        if eod_id is None:
          raise ConfigError(f"The end-of-document token {eod_token!r} is not in {path}; name "
                            "one of its special tokens (e.g. --eod_token='<|end_of_text|>').")
    self.eod_id = eod_id

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=self.skip_special)

  def with_special_tokens(self) -> "HfTokenizer":
    """This tokenizer, its `decode` keeping special tokens (a chat template's headers and
    end-of-turn tokens then read as the template rendered them)."""
    out = copy.copy(self)
    out.skip_special = False
    return out

  def encoding(self, text: str):
    """The `tokenizers` Encoding of `text` without the post-processor's special tokens (as
    transformers tokenizes a rendered chat template): `.ids`, `.char_to_token(i)`."""
    return self._tok.encode(text, add_special_tokens=False)

  def token_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def special_ids(self) -> frozenset[int]:
    """Ids of the added tokens marked special (a template's control tokens)."""
    return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)


def _eos_token(directory: str) -> str | None:
  """The eos_token of DIRECTORY/tokenizer_config.json (a string or {'content': ...})."""
  path = fs.join(directory, HF_CONFIG_FILE)
  if not fs.isfile(path):
    return None
  eos = json.loads(fs.read_text(path)).get("eos_token")
  return eos.get("content") if isinstance(eos, dict) else eos


def from_spec(spec: str, eod_token: str | None = None, field: str = "tokenizer"):
  """The tokenizer a spec names: 'bytes', 'sentencepiece:PATH' or 'hf:PATH'; ConfigError
  naming `field` (where the spec was set) for a PATH that is not a file."""
  kind, _, path = spec.partition(":")
  if kind == "bytes" and not path:
    return ByteTokenizer()
  if kind in _FILES and path and not fs.isfile(path):
    raise ConfigError(
        f"{field}={spec!r}: there is no file {path!r}. Give the path of {_FILES[kind]}, e.g. "
        f"{kind}:/data/my_corpus/{_FILES[kind].split()[-1]} "
        "(tools/prepare_text_data.py leaves the one it used in its --output_dir).")
  if kind == "hf" and path:
    return HfTokenizer(path, eod_token)
  if kind == "sentencepiece" and path:
    return SentencePieceTokenizer(path)
  raise ConfigError(f"Tokenizer {spec!r} is not 'bytes', 'sentencepiece:PATH' or 'hf:PATH' "
                    f"(a Hugging Face {HF_FILE}).")


_SP_SYMBOLS = ["\n", "\t"]  # user-defined pieces: kept whole, never merged
# Pieces every model of `train_sentencepiece` has: 256 byte fallbacks, unk, eos, the symbols.
SP_FIXED_PIECES = 256 + 2 + len(_SP_SYMBOLS)


def sentencepiece_min_vocab(sentences: Iterable[str]) -> int:
  """The smallest vocab_size `train_sentencepiece` accepts for `sentences`: each distinct
  character is a piece of its own (character_coverage=1.0), beside the fixed pieces."""
  chars = set().union(*map(set, sentences)) - set(_SP_SYMBOLS)
  return len(chars) + SP_FIXED_PIECES


def train_sentencepiece(sentences: Iterable[str], model_prefix: str, vocab_size: int) -> str:
  """Trains a SentencePiece BPE model on `sentences` (offline); returns the .model path.

  Whitespace, tabs and newlines are kept, so text round-trips through encode/decode;
  unknown characters fall back to bytes. Ids: unk 0, eos 1 (the end-of-document id),
  no bos or pad.
  """
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_prefix=model_prefix, vocab_size=vocab_size, model_type="bpe",
      character_coverage=1.0, byte_fallback=True, split_digits=True,
      remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
      normalization_rule_name="identity",
      user_defined_symbols=_SP_SYMBOLS, unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
      max_sentence_length=1 << 16, input_sentence_size=2_000_000, shuffle_input_sentence=True,
      minloglevel=2)
  return model_prefix + ".model"


def read_meta(data_dir: str, field: str) -> dict:
  """DIR/meta.json; ConfigError naming `field` (the config field holding DIR) if absent."""
  if data_dir:
    fs.check_reachable(data_dir, field)
  path = fs.join(data_dir or "", META_FILE)
  if not data_dir or not fs.isfile(path):
    raise ConfigError(
        f"{field}={data_dir!r} holds no {META_FILE}. Set it to a directory written by "
        "`python tools/prepare_text_data.py --input='GLOB' --output_dir=DIR` (the binary's "
        "--data_dir=DIR sets it for every dataset).")
  return json.loads(fs.read_text(path))


def load(data_dir: str, meta: dict, field: str = "data_dir"):
  """The tokenizer named by a data dir's meta.json; ConfigError naming `field` (the config
  field holding `data_dir`) when its file is missing."""
  if meta["tokenizer"] == "bytes":
    return ByteTokenizer()
  name = HF_FILE if meta["tokenizer"] == "hf" else SP_MODEL_FILE
  if not fs.isfile(fs.join(data_dir, name)):
    raise ConfigError(
        f"{field}={data_dir!r}: its {META_FILE} names a {meta['tokenizer']} tokenizer, but "
        f"there is no {name} beside it. Copy the {name} this data was prepared with into "
        f"{data_dir}, or prepare the data again (tools/prepare_text_data.py writes both).")
  if meta["tokenizer"] == "hf":
    return HfTokenizer(fs.join(data_dir, HF_FILE), eod_id=int(meta["eod_id"]))
  return SentencePieceTokenizer(fs.join(data_dir, SP_MODEL_FILE))


def check_vocab(meta: dict, model_vocab_size: int, data_dir: str) -> None:
  """ConfigError unless the model's vocabulary is the data's."""
  if int(model_vocab_size) != int(meta["vocab_size"]):
    raise ConfigError(
        f"task.model.vocab_size={model_vocab_size}, but the data in {data_dir} has "
        f"vocab_size={meta['vocab_size']} ({meta['tokenizer']} tokenizer, {META_FILE}). Pass "
        f"--fdl_set=task.model.vocab_size={meta['vocab_size']}.")


def check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
  """ValueError if any token id is outside [0, vocab_size): never a silent clamp."""
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f"{where}: token ids in [{ids.min()}, {ids.max()}] do not fit "
                     f"vocab_size={vocab_size}; the data was prepared with another tokenizer.")
