"""The generic conversion: HF tensors <-> spmdtask's logical params, for any `Family`.
Pure numpy.

spmdtask's params are float32 (in), layers stacked on a leading [num_layers] dim, routed
experts [L, E, ...]; HF Linear weights are [out, in] and spmdtask's [in, ...]: each tensor
moves by its layout kind (below, and a family's own: `Family.layouts`). The embedding,
final norm and an untied head are the same in every family; a tied head's copy
(`lm_head.weight`) is accepted and ignored, as HF ignores it.
"""
import numpy as np

from spmdtask.errors import ConfigError
from spmdtask.hf import families
from spmdtask.hf.trees import copy, nested

IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints hold


def layouts(cfg: dict, m: dict):
  """(to ours, back to HF) by layout kind, for the HF config `cfg` and its fields `m`."""
  d, h, kv, hd = m["d_model"], m["num_heads"], m["num_kv_heads"], m["head_dim"]
  to = {"heads_in": lambda w: w.T.reshape(d, h, hd), "kv_in": lambda w: w.T.reshape(d, kv, hd),
        "heads_out": lambda w: w.T.reshape(h, hd, d), "t": lambda w: w.T, "same": lambda w: w}
  back = {"heads_in": lambda w: w.reshape(d, -1).T, "kv_in": lambda w: w.reshape(d, -1).T,
          "heads_out": lambda w: w.reshape(h * hd, d).T, "t": lambda w: w.T,
          "same": lambda w: w}
  own_to, own_back = families.of(cfg).layouts(m)
  return {**to, **own_to}, {**back, **own_back}


class Leaf:
  """One logical param made from HF tensors when asked: whole (`value()`), or one HF
  tensor at a time (`blocks()`: a stacked param's [l] or [l, e] slices in order), so an
  import never holds more than one tensor of the model. Float32, like `to_params`."""

  def __init__(self, names, convert, tensors):
    """`names`: one HF name, or nested lists of them (the stacked dims); `convert`: an HF
    tensor (read as float32) -> its slice in our layout."""
    self.names, self._convert, self._tensors = names, convert, tensors
    dims, first = [], names
    while isinstance(first, list):
      dims.append(len(first))
      first = first[0]
    # The layout applied to a stand-in of no storage (zero strides) gives the slice shape.
    stand_in = np.broadcast_to(np.float32(0), tensors[first].shape)
    self.shape = tuple(dims) + convert(stand_in).shape
    self.chunk = (1,) * len(dims) + self.shape[len(dims):]  # one HF tensor
    self.dtype = np.dtype(np.float32)

  def blocks(self):
    """(start index, one HF tensor's slice [1, ..., *slice] as float32) for each."""
    def walk(names, index):
      if not isinstance(names, list):
        x = self._convert(np.asarray(self._tensors[names]).astype(np.float32))
        yield (index + (0,) * x.ndim,
               np.ascontiguousarray(x).reshape((1,) * len(index) + x.shape))
        return
      for i, name in enumerate(names):
        yield from walk(name, index + (i,))
    return walk(self.names, ())

  def __array__(self, dtype=None, copy=None):
    del copy  # a fresh array either way
    return self.value() if dtype is None else self.value().astype(dtype)

  def value(self) -> np.ndarray:
    out = np.empty(self.shape, self.dtype)
    for start, x in self.blocks():
      out[tuple(slice(i, i + n) for i, n in zip(start, x.shape))] = x
    return out


def to_params(cfg: dict, tensors) -> dict:
  """spmdtask's logical params (float32, layers stacked [L, ...], routed experts
  [L, E, ...]) from HF tensors (arrays, or `files.Tensor`s); ConfigError for a missing or
  an unmapped tensor."""
  return copy(leaves(cfg, tensors), Leaf.value)


def leaves(cfg: dict, tensors) -> dict:
  """`to_params`' tree with a `Leaf` for each param, nothing read but what the checks
  need (a shared weight's copies); ConfigError for a missing or an unmapped tensor."""
  family, m = families.of(cfg), families.model_fields(cfg)
  used = set()

  def mark(names):
    for name in names if isinstance(names, list) else [names]:
      if isinstance(name, list):
        mark(name)
      elif name not in tensors:
        raise ConfigError(f"The checkpoint has no tensor {name!r}, which config.json implies.")
      else:
        used.add(name)
    return names

  layout = layouts(cfg, m)[0]
  flat = {"embedding": Leaf(mark("model.embed_tokens.weight"), layout["same"], tensors),
          "final_norm/scale": Leaf(mark("model.norm.weight"), layout["same"], tensors)}
  if not m["tie_embeddings"]:
    flat["unembed"] = Leaf(mark("lm_head.weight"), layout["t"], tensors)
  elif "lm_head.weight" in tensors:
    used.add("lm_head.weight")  # a tied head's copy; HF ignores it too
  for path, names, kind in family.stacked(cfg, m):
    flat[path] = Leaf(mark(names), layout[kind], tensors)
  for copy, main in family.copies(cfg).items():  # shared weights' copies
    mark([copy, main])
    if not np.array_equal(np.asarray(tensors[copy]), np.asarray(tensors[main])):
      raise ConfigError(f"The checkpoint's {copy!r} differs from {main!r}: spmdtask's MTP head "
                        "shares the main model's (DeepSeek-V3's design), so it cannot hold both.")
  extra = sorted(k for k in set(tensors) - used if not k.endswith(IGNORED_TENSORS))
  if extra:
    raise ConfigError(f"The checkpoint has tensors this converter does not map: "
                      f"{extra[:10]}{' ...' if len(extra) > 10 else ''}. It is not a plain "
                      f"{cfg.get('architectures', [families.model_type(cfg)])[0]} (config.json "
                      "fields and tensors disagree).")
  return nested(flat)


def from_params(cfg: dict, params: dict, dtypes: dict[str, str]) -> dict[str, np.ndarray]:
  """HF tensors from spmdtask's params (the inverse of `to_params`), cast to `dtypes` (HF
  name -> dtype name; float32 where a name is missing)."""
  family, m = families.of(cfg), families.model_fields(cfg)
  out = {"model.embed_tokens.weight": params["embedding"],
         "model.norm.weight": params["final_norm"]["scale"]}
  if not m["tie_embeddings"]:
    out["lm_head.weight"] = params["unembed"].T
  inverse = layouts(cfg, m)[1]

  def put(names, stacked, kind):
    for name, x in zip(names, stacked):
      if isinstance(name, list):
        put(name, x, kind)
      else:
        out[name] = inverse[kind](np.asarray(x))
  for path, names, kind in family.stacked(cfg, m):
    leaf = params
    for key in path.split("/"):
      leaf = leaf[key]
    put(names, leaf, kind)
  out.update({copy: out[main] for copy, main in family.copies(cfg).items()})
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  def cast(name, x):
    dtype = dtypes.get(name, "float32")
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)))
  return {k: cast(k, v) for k, v in out.items()}
