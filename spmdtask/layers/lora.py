"""LoRA: low-rank adapters beside a model's frozen base weights (`TransformerLm.lora`).

A weight W named X (q, k, v, o, wi, wg, wo) gets two params beside it in the module that
owns it: `X_lora_a` [*in_dims, r] and `X_lora_b` [r, *out_dims], in-dims those W contracts
with the activation. The layer computes `x·W + (alpha / r) · dropout(x)·A·B`, the adapter
in the compute dtype; the effective weight is W + (alpha / r) · A·B. A's split-dims are the
base weight's in-dims entries and None for r, B's None and the out-dims entries, so an
adapter lies on the mesh as its base weight does (GSPMD moves them: they are small, and
the base weight's FSDP gather in `base.project` is unchanged). Init as PEFT's: A
kaiming-uniform (±1/sqrt(fan_in), fan_in the in-dims' product), B zero, so a fresh adapter
changes nothing.

Multi-head latent attention (layers.attention.mla) has its own targets beside `o` (and
`q`, its direct query without q_lora_rank): `q_down`, `q_up`, `kv_down`, `kv_up`; at decode
`kv_up` is absorbed, so its effective weight W + (alpha / r)·A·B is formed (`effective`).

The target `experts` adapts an MoE's routed wi, wg and wo, all three (`expert_adapters`):
per expert e, A [e, in, r] and B [e, r, out] (e a batch dim, split as W's expert entry;
A's in and B's out as W's), applied to each expert's rows in the dispatch's own grouped
(dropless) or batched (capacity) matmuls, under its shard_map (expert parallelism: the
adapters keep their expert shard and are gathered over FSDP axes like W), inside the
experts' gates and checkpoint names (remat) and their ff slices (`ff_chunks`). Dropout on
their inputs draws per assignment from (row id, token, choice), which travels with the
token, so any layout draws the same masks. PEFT has no exact form for them (hf/peft.py):
they leave by merging (`--to_hf --merge_lora`).

Every other param of a LoRA model is frozen: read through `jax.lax.stop_gradient` (no
gradient is formed for it) and stored in `base_dtype`; `core.train_state.trainable` is the
one rule (by param name) that gives adapters alone optimizer state. With `base_quantization`
(QLoRA) the targets' base weights are stored quantized instead (layers.qlora), in groups
of `group_size`, and dequantized per matmul.
"""
import dataclasses
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from spmdtask.core import sharding
from spmdtask.core.train_state import ADAPTER_SUFFIXES
from spmdtask.errors import ConfigError
from spmdtask.layers import base, qlora
from spmdtask.layers.base import SplitDims

FIELD = "task.model.lora"
ATTENTION = ("q", "k", "v", "o")
MLP = ("wi", "wg", "wo")
MLA = ("q_down", "q_up", "kv_down", "kv_up")  # multi-head latent attention's own (with q, o)
TARGETS = ATTENTION + MLP + ("experts",) + MLA  # experts: an MoE's routed wi/wg/wo
BASE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """LoRA of a TransformerLm (module doc). `targets` name the adapted weights (TARGETS);
  `base_dtype` stores the frozen params ('bfloat16' halves them); `base_quantization`
  (None | 'nf4' | 'int4' | 'int8', QLoRA) stores the targets' base weights quantized in
  groups of `group_size` (layers.qlora), their scales in `base_dtype`."""
  rank: int
  alpha: float
  dropout: float = 0.0
  targets: tuple[str, ...] = ATTENTION
  base_dtype: str = "float32"
  base_quantization: str | None = None
  group_size: int = 64

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def validate(self, weights: tuple[str, ...]) -> None:
    """ConfigError naming the first field that cannot work; `weights`: the names of the
    model's weights a target may name (e.g. no 'wg' in a GELU MLP, no 'experts' when dense)."""
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
      raise ConfigError(f"{FIELD}.rank={self.rank!r}: the adapters' rank must be an integer "
                        "> 0 (e.g. 8 or 16).")
    if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
      raise ConfigError(f"{FIELD}.alpha={self.alpha!r}: the adapters' scale is alpha / rank; "
                        "give alpha > 0 (e.g. 2 x rank, or rank for a scale of 1).")
    if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"{FIELD}.dropout={self.dropout!r}: the dropout rate on the adapters' "
                        "input must be in [0, 1) (0 = off).")
    targets = self.targets
    bad = ([t for t in targets if t not in weights]
           if isinstance(targets, (tuple, list)) and targets else [targets])
    if bad:
      raise ConfigError(
          f"{FIELD}.targets={targets!r}: {bad[0]!r} matches no weight of this model. Name a "
          f"non-empty tuple of {', '.join(weights)} (of LoRA's {', '.join(TARGETS)}: "
          "q, k, v, o attention; wi, wg, wo the dense MLP; experts an MoE's routed experts; "
          "q_down, q_up, kv_down, kv_up multi-head latent attention's, beside its q and o).")
    if self.base_dtype not in BASE_DTYPES:
      raise ConfigError(f"{FIELD}.base_dtype={self.base_dtype!r}: the frozen weights are "
                        f"stored in {' or '.join(BASE_DTYPES)}.")
    self._validate_quantization(weights)

  def _validate_quantization(self, weights: tuple[str, ...]) -> None:
    kind = self.base_quantization
    if kind is None:
      return
    if kind not in qlora.KINDS:
      raise ConfigError(
          f"{FIELD}.base_quantization={kind!r}: the frozen base's storage is None (base_dtype), "
          "'nf4' (QLoRA's 4-bit NormalFloat), 'int4' or 'int8'; e.g. "
          f"--fdl_set=\"{FIELD}.base_quantization='nf4'\".")
    group = self.group_size
    if isinstance(group, bool) or not isinstance(group, int) or group < 2 or group % 2:
      raise ConfigError(
          f"{FIELD}.group_size={group!r}: the elements of a base weight's in-dim that share "
          "one scale must be an even integer >= 2 (two 4-bit codes share a byte); e.g. 64, "
          "as QLoRA.")
    bad = [t for t in self.targets if t not in qlora.GROUP_AXIS]
    mla = [w for w in MLA if w in weights]
    if bad or mla:
      raise ConfigError(
          f"{FIELD}.targets={tuple(self.targets)!r} with {FIELD}.base_quantization={kind!r}: "
          f"{(bad or mla)[0]!r} cannot be stored quantized; QLoRA stores the base weights of "
          f"the dense projections {', '.join(qlora.GROUP_AXIS)} of a multi-head attention "
          "model (not an MoE's routed experts, nor multi-head latent attention's). Drop it "
          f"from the targets, or set {FIELD}.base_quantization=None (a plain LoRA).")

  def check_group(self, name: str, shape) -> None:
    """ConfigError when group_size does not divide base weight `name`'s group dim."""
    dim = shape[qlora.group_axis(name, len(shape))]
    if dim % self.group_size:
      raise ConfigError(
          f"{FIELD}.group_size={self.group_size}: it must divide the dim each base weight's "
          f"scales are grouped along (its last in-dim), but {name!r} {tuple(shape)} has "
          f"{dim}; give a divisor of {dim} (e.g. {math.gcd(dim, 64) if dim % 2 == 0 else 2}).")


class Adaptable:
  """`core.model.Adapted` for a model whose `lora` field is a LoraConfig or None."""

  def adapters_only(self) -> bool:
    """Whether only the LoRA adapters train."""
    return self.lora is not None

  def base_storage(self) -> qlora.Storage | None:
    """A QLoRA base's storage (layers.qlora), else None."""
    kind = None if self.lora is None else self.lora.base_quantization
    return None if kind is None else qlora.Storage(kind, self.lora.group_size)


def frozen(cfg: LoraConfig | None) -> bool:
  """Whether a model with this `lora` field freezes its base weights."""
  return cfg is not None


def dropout_rate(cfg: LoraConfig | None) -> float:
  """The adapters' input dropout (0 without LoRA)."""
  return 0.0 if cfg is None else cfg.dropout


def base_dtype(cfg: LoraConfig | None):
  """The dtype base weights are stored in (float32 without LoRA)."""
  return jnp.float32 if cfg is None else jnp.dtype(cfg.base_dtype)


def weight(module: nn.Module, name: str, shape, split: SplitDims, init,
           cfg: LoraConfig | None) -> jax.Array:
  """A base weight (`base.weight`), frozen and stored in `base_dtype` under LoRA."""
  return base.weight(module, name, shape, split, init, base_dtype(cfg), frozen(cfg))


def projection_weight(module: nn.Module, name: str, shape, split: SplitDims, init,
                      cfg: LoraConfig | None) -> jax.Array | qlora.Packed:
  """`weight` of a projection `project` computes; under QLoRA, where `cfg` targets it,
  stored quantized (`qlora.Packed`, which `project` takes as a weight)."""
  if cfg is None or cfg.base_quantization is None or name not in cfg.targets:
    return weight(module, name, shape, split, init, cfg)
  cfg.check_group(name, shape)
  return qlora.weight(module, name, shape, split, init, cfg.base_quantization, cfg.group_size,
                      base_dtype(cfg))


class Dropout(NamedTuple):
  """What an adapter's dropout mask derives from: the layer's key data and the rows'
  global ids (as `base.dropout`); None where dropout is off."""
  key: jax.Array
  row_ids: jax.Array


def project(module: nn.Module, name: str, eqn: str, x: jax.Array, w: jax.Array,
            w_split: SplitDims, batch: SplitDims | None, dtype, cfg: LoraConfig | None,
            drop: Dropout | None = None, **project_kwargs) -> jax.Array:
  """`base.project(eqn, x, w, ...)` plus, where `cfg` targets `name`, the adapter's
  `(alpha / r) · dropout(x)·A·B` (its params made here, beside `name`). `eqn`'s weight
  operand lists W's in-dims (those x has) before its out-dims."""
  quant = project_kwargs.get("quant")
  if quant is not None:  # delayed fp8 scaling's amax history lives beside the weight
    project_kwargs = dict(project_kwargs, quant=quant.bound(module, name))
  y = base.project(eqn, x, w, w_split, batch, dtype, **project_kwargs)
  if cfg is None or name not in cfg.targets:
    return y
  ins, out = eqn.split("->")
  x_dims, w_dims = ins.split(",")
  n_in = _in_dims(eqn)
  r = next(c for c in "rzyxw" if c not in eqn)
  a, b = _adapters(module, name, w, n_in, cfg, w_split)
  xd = x.astype(dtype)
  if drop is not None and cfg.dropout:
    xd = base.dropout(xd, cfg.dropout, drop.key, drop.row_ids, 2 + TARGETS.index(name))
  # The adapters whole over the axes that split the batch (FSDP's), as the base weight is
  # used: left to itself, GSPMD gathered the activations instead (Llama-3-8B on v5e:2x4:
  # 3x the all-gather bytes of the base weights).
  mesh = jax.sharding.get_abstract_mesh()
  rows = base.batch_axes(mesh, batch, x.shape[0])
  a = base.constrain(a.astype(dtype), _without(tuple(w_split[:n_in]) + (None,), rows))
  b = base.constrain(b.astype(dtype), _without((None,) + tuple(w_split[n_in:]), rows))
  mid = "".join(c for c in x_dims if c not in w_dims[:n_in]) + r
  h = jnp.einsum(f"{x_dims},{w_dims[:n_in]}{r}->{mid}", xd, a)
  if rows:
    h = base.constrain(h, (rows,) + (None,) * (h.ndim - 1))
  delta = jnp.einsum(f"{mid},{r}{w_dims[n_in:]}->{out}", h, b)
  return y + (delta * jnp.asarray(cfg.scale, dtype)).astype(y.dtype)


def effective(module: nn.Module, name: str, eqn: str, w: jax.Array, cfg: LoraConfig | None
              ) -> jax.Array:
  """W + (alpha / r)·A·B of weight `name` where `cfg` targets it (its adapters made here as
  `project` makes them, `eqn` the same), else W: for a weight used other than as `x·W`."""
  if cfg is None or name not in cfg.targets:
    return w
  n_in = _in_dims(eqn)
  a, b = _adapters(module, name, w, n_in, cfg)
  ab = jnp.einsum("ir,ro->io", a.reshape(-1, cfg.rank), b.reshape(cfg.rank, -1))
  return w + (jnp.float32(cfg.scale) * ab).reshape(w.shape).astype(w.dtype)


def _in_dims(eqn: str) -> int:
  """How many of an `x,w->y` eqn's weight dims x contracts with (W's in-dims, first)."""
  x_dims, w_dims = eqn.split("->")[0].split(",")
  return sum(c in x_dims for c in w_dims)


def _adapters(module: nn.Module, name: str, w: jax.Array, n_in: int, cfg: LoraConfig,
              w_split: SplitDims | None = None) -> tuple[jax.Array, jax.Array]:
  """(A [*in, r], B [r, *out]) of weight `name`, made beside it (module doc's init)."""
  w_split = (None,) * w.ndim if w_split is None else w_split
  bound = 1.0 / math.sqrt(math.prod(w.shape[:n_in]))
  a = module.param(f"{name}{ADAPTER_SUFFIXES[0]}",
                   nn.with_partitioning(_uniform(bound), tuple(w_split[:n_in]) + (None,)),
                   tuple(w.shape[:n_in]) + (cfg.rank,), jnp.float32)
  b = module.param(f"{name}{ADAPTER_SUFFIXES[1]}",
                   nn.with_partitioning(nn.initializers.zeros,
                                        (None,) + tuple(w_split[n_in:])),
                   (cfg.rank,) + tuple(w.shape[n_in:]), jnp.float32)
  return a, b


class ExpertAdapters(NamedTuple):
  """An MoE's routed-expert adapters (target `experts`), (A, B) per base weight: wi, wg
  A [e, d, r], B [e, r, f]; wo A [e, f, r], B [e, r, d] (their scale: `LoraConfig.scale`)."""
  wi: tuple[jax.Array, jax.Array]
  wg: tuple[jax.Array, jax.Array]
  wo: tuple[jax.Array, jax.Array]


EXPERT_WEIGHTS = ("wi", "wg", "wo")  # what the target `experts` adapts, in ExpertAdapters order


def expert_adapters(module: nn.Module, weights: dict[str, tuple[jax.Array, SplitDims]],
                    cfg: LoraConfig | None) -> ExpertAdapters | None:
  """The adapters of an MoE's routed `weights` (name -> (W [e, in, out], its split-dims)),
  made beside them in `module` where `cfg` targets `experts` (else None): A [e, in, r] split
  (W's e entry, W's in entry, None), kaiming-uniform over fan_in = in; B [e, r, out] split
  (W's e entry, None, W's out entry), zero."""
  if cfg is None or "experts" not in cfg.targets:
    return None
  pairs = []
  for name in EXPERT_WEIGHTS:
    w, split = weights[name]
    e, n_in, n_out = w.shape
    a = module.param(f"{name}{ADAPTER_SUFFIXES[0]}",
                     nn.with_partitioning(_uniform(1.0 / math.sqrt(n_in)),
                                          (split[0], split[1], None)),
                     (e, n_in, cfg.rank), jnp.float32)
    b = module.param(f"{name}{ADAPTER_SUFFIXES[1]}",
                     nn.with_partitioning(nn.initializers.zeros, (split[0], None, split[2])),
                     (e, cfg.rank, n_out), jnp.float32)
    pairs.append((a, b))
  return ExpertAdapters(*pairs)


def expert_dropout_stream(name: str) -> int:
  """`base.dropout`'s `which` for the input of expert weight `name`'s adapter (after the
  dense targets' 2 + TARGETS.index)."""
  return 2 + len(TARGETS) + EXPERT_WEIGHTS.index(name)


def _without(split: SplitDims, axes: tuple[str, ...]) -> SplitDims:
  """`split` with `axes` taken out of every entry."""
  def entry(e):
    kept = tuple(a for a in sharding.entry_axes(e) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
  return tuple(entry(e) for e in split)


def _uniform(bound: float):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init
