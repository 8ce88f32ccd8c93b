"""The model contract: the one typed seam between the framework and a model family.

The framework (program, steps, loop, evaluation, checkpoints) depends on these
protocols and nothing else; only `layers/` and `configs/` import a model family.

A model is a Flax module that implements `Model`:
  - `loss(batch) -> (loss, metrics)`: a scalar loss and a dict of `Weighted` metrics.
    `metrics['loss']` is required and `loss == metrics['loss'].sum / metrics['loss'].weight`,
    which is what lets the framework split a batch into microbatches (gradient
    accumulation) and still take the gradient of the whole batch's loss: it sums
    `loss * weight` over microbatches and divides by the summed weight. Every metric
    is aggregated the same generic way: sums and weights are summed over microbatches,
    batches and processes, and reported as sum / weight.
  - `work_per_example(example)`: the train FLOPs (forward + backward) and the tokens of one
    example, for MFU and tokens/s; a sparse model's FLOPs count the params a token uses.
  - `validate(mesh, global_batch_size)`: ConfigError naming the field when the model's
    config cannot run on this mesh and batch.

Optional protocols:
  - `Decodable`: a KV-cache forward for `--mode=decode` (and, with per-head keys and
    values, one-token steps over a `PagedCache`: GRPO's sampler).
  - `ChecksBatch`: a host-side check of each input batch (token ids in the vocabulary).
  - `LayerCosts`: per-layer train costs, for balancing pipeline stages.
  - `SizesActivations`: the train step's largest activations and the config changes that
    shrink them, for the plan's out-of-memory paragraph.
  - `ScoresTokens`: per-token target log-probabilities (`token_logprobs`), for objectives
    that score sequences (DPO, GRPO: `spmdtask.core.objective`), and with whether each
    target is the greedy token (`token_scores`), for lm-eval's scorer (`spmdtask.harness`).
  - `Stacked`: a model with a stack of identical layers that can run under an execution
    strategy chosen on the Task (`task.pipeline`), and that maps its on-device parameter
    layout to the canonical one checkpoints hold (stacked layers `[L, ...]`).
"""
import math
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


class Weighted(NamedTuple):
  """A metric as (sum of values · weights, sum of weights); reported as sum / weight."""
  sum: jax.Array
  weight: jax.Array


Metrics = dict[str, Weighted]


class Work(NamedTuple):
  """What one training example costs: forward + backward FLOPs, and its tokens; the part
  of those FLOPs that is attention's scores and weighted sums (causal: the visible half);
  and the params one token uses where that is fewer than all (a mixture of experts'; None:
  all)."""
  train_flops: float
  tokens: int
  active_params: int | None = None
  attention_flops: float = 0.0


@runtime_checkable
class Model(Protocol):
  """What every model gives the framework (implemented by a Flax module)."""

  def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
    """(scalar loss, metrics); metrics['loss'].sum / metrics['loss'].weight == loss."""

  def work_per_example(self, example: dict[str, Any]) -> Work:
    """Train FLOPs and tokens of one example; `example` has the shapes of one row."""

  def validate(self, mesh: jax.sharding.Mesh, global_batch_size: int) -> None:
    """Raises ConfigError (naming the config field) if the model cannot run here."""


@runtime_checkable
class Decodable(Protocol):
  """A model that decodes with a KV cache (`--mode=decode`).

  `__call__(tokens [b, t], positions [b, t], cache) -> (logits [b, t, vocab], cache)`;
  with `logits_at=` [b] int, only each row's logits at that position ([b, 1, vocab]).
  """
  max_seq_len: int

  def cache_shape(self, batch_size: int, max_len: int) -> Any:
    """ShapeDtypeStructs of an empty cache for `batch_size` rows of `max_len` slots."""

  def cache_split_dims(self, mesh_shape: dict[str, int]) -> Any:
    """The cache's PartitionSpecs (a tree like `cache_shape`) on this mesh."""

  def whole_rows(self, axes: tuple[str, ...], mesh_shape: dict[str, int]) -> "Decodable":
    """The same model (same params) with no activation's rows split over `axes`, mesh axes
    that split its weights (FSDP's): for a decode step's few rows, each device multiplies
    its weights' shard by every row and reduces the partial sums instead of gathering the
    weights. The cache (`cache_split_dims`) may then be split otherwise (e.g. by heads)."""


class PagedCache(NamedTuple):
  """The cache a `Decodable` (with per-head keys and values) takes for one-token decode
  steps over S slots whose completions' KV lies in pages (GRPO's sampler, `run.sampling`;
  read and written by `layers.attention.paged`). Slot s continues prompt row `prompt[s]`
  of `prompts` (read only: its positions < `base[s]`, the prompt's length); its completion's
  j-th token, at position base[s] + j, is at page `table[s, j // page_size]`, offset
  `j % page_size`, of `pages`. A table entry of num_pages is no page (a write there is
  dropped, a read masked): a slot must hold the page of the token it feeds."""
  prompts: Any      # cache_shape(B, P): the prompts' KV, [layers, B, P, ...] leaves
  pages: Any        # cache_shape(num_pages, page_size): the pool, [layers, pages, size, ...]
  table: jax.Array  # [S, ceil(max_new / page_size)] int32
  prompt: jax.Array  # [S] int32: each slot's prompt row
  base: jax.Array   # [S] int32: that prompt's length (its completion's first position)


def cache_bytes_per_token(model: Decodable) -> int:
  """Decode cache bytes per token of one row over all layers (`cache_shape`'s leaves per
  slot): what a row's context costs beside the params, before any split over the mesh."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.cache_shape(1, 1)))


@runtime_checkable
class ChecksBatch(Protocol):
  """A model that checks each host batch before it is fed (e.g. token ids < vocab_size).

  `check_batch(batch)` gets this process's numpy rows and raises ConfigError naming the
  data and the model field; it runs on the host for every train and eval batch, so it
  must be cheap (a min / max per array).
  """

  def check_batch(self, batch: dict[str, Any]) -> None:
    ...


@runtime_checkable
class ScoresTokens(Protocol):
  """A model that gives each target token's log-probability (sequence-scoring objectives).

  `token_logprobs(batch, temperature=1.0) -> [b, t] float32`: log p(targets[i, j] | the
  row's tokens up to j) under softmax(logits / temperature) (a sampler's distribution: RL
  scores what it sampled), in the rows' own order; `batch` is like `Model.loss`'s
  (`inputs`, `targets`, `weights`, optional `positions` / `segment_ids`). It adds no
  auxiliary losses (an MoE's router losses are the LM loss's, not part of a sequence's score).
  """

  def token_logprobs(self, batch: dict[str, jax.Array], temperature: float = 1.0) -> jax.Array:
    ...

  def token_scores(self, batch: dict[str, jax.Array]) -> "TokenScores":
    """`token_logprobs(batch)` (temperature 1) and whether each target is the argmax of its
    logits (the first id of the greatest, as `jnp.argmax`), both [b, t] in the rows' own
    order; computed where the head computes its logits (a vocab-tiled head: per tile)."""
    ...


class TokenScores(NamedTuple):
  """What `ScoresTokens.token_scores` gives per token [b, t]."""
  logprobs: jax.Array  # float32: log p(target | the tokens before it)
  greedy: jax.Array    # bool: the target is the argmax (a greedy decode would emit it)


class LayoutMap(NamedTuple):
  """How one subtree of the on-device parameters maps to the canonical layout.

  `path` is a sequence of keys. Every subtree of the train state found under a key path
  ending with it (the params' own, and each optimizer statistic that mirrors the params,
  e.g. Adam's `mu/layers`) is converted as a whole: `to_canonical(subtree)` and back.
  """
  path: tuple[str, ...]
  to_canonical: Callable[[Any], Any]
  from_canonical: Callable[[Any], Any]


@runtime_checkable
class Stacked(Protocol):
  """A model whose layer stack can run under an execution strategy (`spmdtask.core.strategy`:
  scan, SPMD pipeline, MPMD)."""

  def with_pipeline(self, pipeline: Any) -> "Stacked":
    """The same model with its layer stack run by the strategy `pipeline` (None = scanned)."""

  def layout_maps(self) -> tuple[LayoutMap, ...]:
    """Conversions between this model's parameter layout and the canonical one."""


@runtime_checkable
class Adapted(Protocol):
  """A model that may train only its adapters (params named `*_lora_a`, `*_lora_b`)."""

  def adapters_only(self) -> bool:
    """Whether every param but the adapters is frozen (no gradient, no optimizer state)."""

  def base_storage(self) -> "BaseStorage | None":
    """How a base stored quantized (QLoRA, layers.qlora) maps to float, else None."""


class BaseStorage(Protocol):
  """A frozen base stored other than as its float weights (layers.qlora.Storage)."""

  def float_view(self, params):
    """`params` (arrays or ShapeDtypeStructs) with each stored weight as its float
    ShapeDtypeStruct under the float name: what a float base checkpoint holds."""

  def quantized(self, params, model_params):
    """Float `params` (`float_view`'s names) stored as `model_params` (the model's)."""


@runtime_checkable
class Buffered(Protocol):
  """A model with buffers: params no optimizer trains (named `*_buffer`,
  `core.train_state.BUFFER_SUFFIX`), set after each step's update by `update_buffers`
  from their gradient slot, into which the model's backward puts a statistic of the step
  (e.g. an MoE's expert loads: `layers.moe`). They live in the train state and the
  checkpoints like any param, so they survive a restore onto any mesh."""

  def has_buffers(self) -> bool:
    """Whether the params hold buffers (the optimizer then masks them out)."""

  def update_buffers(self, params: Any, grads: Any) -> Any:
    """`params` with every buffer set from its gradient slot in `grads` (same tree)."""

  def buffers_accumulate(self) -> bool:
    """Whether the gradient slots' statistics survive gradient accumulation (a sum over
    microbatches divided by the tokens): loads do, maxima do not (then one microbatch)."""


@runtime_checkable
class LayerCosts(Protocol):
  """A model that measures what its parts cost to train, for balancing pipeline stages."""

  def layer_costs(self, batch_size: int, seq_len: int) -> list[float]:
    """Train FLOPs of [embedding, layer 0, ..., layer L-1, head with the loss]."""


class Held(NamedTuple):
  """An activation of the train step that the model can size: `what` it is, its `shape` on
  one device, its dtype name ('bfloat16')."""
  what: str
  shape: tuple[float, ...]
  dtype: str

  @property
  def bytes(self) -> float:
    return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

  def describe(self) -> str:
    """'bfloat16[80, 1, 8192, 8192]'."""
    return f"{self.dtype}[{', '.join(f'{x:g}' for x in self.shape)}]"


class MemoryFix(NamedTuple):
  """A config change that lowers the device memory of a train step: its `--fdl_set`
  override, what it changes, and the bytes per device it saves at the least (None:
  unknown)."""
  override: str
  effect: str
  saves: float | None


class ActivationMemory(NamedTuple):
  """What `SizesActivations.activation_memory` gives: the largest activations, largest
  first, and the fixes of this model's own config."""
  arrays: tuple[Held, ...]
  fixes: tuple[MemoryFix, ...]


@runtime_checkable
class SizesActivations(Protocol):
  """A model that knows its train step's largest activations (e.g. the layers' inputs a
  rematerialized stack keeps for the backward, the loss's float32 logits)."""

  def activation_memory(self, rows: float, seq_len: int) -> ActivationMemory:
    """For one device running `rows` rows of `seq_len` tokens at once (a microbatch)."""
