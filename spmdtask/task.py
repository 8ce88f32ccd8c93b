"""Task params: the model, the mesh and how to train it. Plain dataclasses, built by fiddle."""
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import optax

from spmdtask.core import checks
from spmdtask.errors import ConfigError
from spmdtask.core.objective import Objective
from spmdtask.core.strategy import Strategy

# A split-dims mapping: one entry per tensor dim; None, a mesh axis, or a tuple of axes.
SplitDims = tuple[None | str | tuple[str, ...], ...]


@dataclasses.dataclass
class TrainParams:
  """How to train.

  Attributes:
    num_train_steps: total optimizer steps.
    optimizer: called as `optimizer(learning_rate=schedule)`; returns any optax
      GradientTransformation (e.g. `fdl.Partial(optax.adamw, weight_decay=0.1)`).
    learning_rate: a float or an optax schedule `step -> lr`.
    clip_grad_norm: global-norm gradient clipping before the optimizer; None = off.
    inputs_split_mapping: input PartitionSpecs by rank, `{'map_1d': (...), 'map_2d': (...)}`.
      None puts the batch dim over `Task.data_axes` for every rank.
    log_interval_steps: log step, loss, steps/s and tokens/s every this many steps.
    seed: the init and dropout seed. Values do not depend on the mesh.
    save_interval_steps: save a checkpoint (async) every this many steps, and always at
      the end of training and on preemption. Needs --job_log_dir.
    max_to_keep: how many of the newest checkpoints to keep; None = all.
    local_checkpoint_dir: a directory on each host's own disk or RAM disk (e.g.
      /dev/shm/spmdtask) for the local checkpoint tier, saved every
      `local_save_interval_steps` and on preemption, each process its own shards (and,
      for state sharded across slices, a peer copy of the next slice's); the job
      dir is then the persistent tier (every `save_interval_steps` and at the end). A resume
      takes the newest complete step of either tier (`run.local_tier`). None = off.
    local_save_interval_steps: the local tier's interval (with `local_checkpoint_dir`).
    local_max_to_keep: the newest local steps kept (with `local_checkpoint_dir`).
    summary_interval_steps: write TensorBoard scalars (job_log_dir/summaries/train) every
      this many steps, and flush them.
    init_checkpoint_dir: warm start: a job_log_dir whose latest checkpoint gives the initial
      params (optimizer state starts fresh; step 0). Ignored when this job already has
      checkpoints (it then resumes from them). A LoRA job there starts the model with its
      adapters merged into its base (W + alpha/r·A·B).
    init_adapters: with a LoRA model and a LoRA start: 'merge' trains new adapters on the
      start merged (its reference, adapters off, is the start); 'continue' trains the
      start's own adapters on its base (same rank and targets; the reference, adapters off,
      is then that base).
    peak_flops_per_device: overrides the peak FLOP/s per device the MFU is measured
      against. None: the chip's dense bf16 peak, found from the devices' kind
      (`plan.chips`: H100, H200, A100, TPU v4/v5e/v5p/v6e), else 1.3e11 (a 2-core CPU's
      fp32 matmul rate); the start summary says which figure it uses.
    eval_interval_steps: during --mode=train, evaluate every eval dataset every this
      many steps; 0 = never.
    eval_steps: batches per eval dataset; None = the whole (finite) dataset.
    num_microbatches: gradient accumulation: each global batch is split into this many
      microbatches (rows m, m + M, m + 2M, ... form microbatch m) whose gradients are
      summed in a scan inside the step, then one optimizer update. The update equals
      that of the whole batch; the step's activation memory falls with M.
    elastic_batch: on a restart on fewer slices than task.dcn_mesh_shape spans
      (`--live_slices`, `spmdtask.run.elastic`): 'global' keeps the global batch (the same
      rows each step, through more microbatches: the losses of the whole job); 'per_slice'
      keeps each slice's rows (the global batch shrinks with the slices).
    profile_steps: (START, COUNT): trace steps START .. START+COUNT-1 (step 1 is the
      first) with jax.profiler into job_log_dir/profile (process 0); None = off.
    lm_eval_tasks: lm-evaluation-harness tasks, groups or tags scored during --mode=train
      every `lm_eval_every_n_steps` steps on the live params (`spmdtask.harness.training`;
      as --mode=lm_eval --tasks does on a checkpoint), e.g. ('hellaswag', 'arc_easy').
    lm_eval_every_n_steps: score `lm_eval_tasks` every this many steps; 0 = never.
    lm_eval_include_path: a dir of your own lm-eval task YAML files (--lm_eval_include_path).
    lm_eval_limit: score only this many documents of each task (a fraction when < 1);
      None = all (--lm_eval_limit).
    lm_eval_batch_size: rows per batch of requests, a multiple of the data shards and
      processes (--lm_eval_batch_size).
  """
  num_train_steps: int = 100
  optimizer: Callable[..., optax.GradientTransformation] = optax.adamw
  learning_rate: float | Callable[[Any], Any] = 1e-3
  clip_grad_norm: float | None = 1.0
  inputs_split_mapping: dict[str, SplitDims] | None = None
  log_interval_steps: int = 10
  seed: int = 1234
  save_interval_steps: int = 100
  max_to_keep: int | None = 3
  local_checkpoint_dir: str | None = None
  local_save_interval_steps: int = 5
  local_max_to_keep: int = 2
  summary_interval_steps: int = 10
  init_checkpoint_dir: str | None = None
  init_adapters: str = "merge"
  peak_flops_per_device: float | None = None
  eval_interval_steps: int = 0
  eval_steps: int | None = None
  num_microbatches: int = 1
  elastic_batch: str = "global"
  profile_steps: tuple[int, int] | None = None
  lm_eval_tasks: tuple[str, ...] = ()
  lm_eval_every_n_steps: int = 0
  lm_eval_include_path: str | None = None
  lm_eval_limit: float | None = None
  lm_eval_batch_size: int = 8

  def validate(self) -> None:
    """ConfigError naming the first field of these train params that cannot work."""
    where = "task.train"
    if isinstance(self.num_train_steps, bool) or not isinstance(self.num_train_steps, int) \
        or self.num_train_steps < 0:
      raise ConfigError(f"task.train.num_train_steps={self.num_train_steps!r} must be an "
                        "integer >= 0.")
    checks.positive(where, log_interval_steps=self.log_interval_steps,
                    save_interval_steps=self.save_interval_steps,
                    summary_interval_steps=self.summary_interval_steps)
    if not callable(self.learning_rate):
      checks.in_range("task.train.learning_rate", self.learning_rate, 0.0, float("inf"),
                      "Give a float >= 0 or an optax schedule.")
    if self.clip_grad_norm is not None:
      checks.in_range("task.train.clip_grad_norm", self.clip_grad_norm, 0.0, float("inf"),
                      "Give a norm > 0, or None for no clipping.")
    if self.max_to_keep is not None:
      checks.positive(where, max_to_keep=self.max_to_keep)
    if self.local_checkpoint_dir is not None:
      checks.positive(where, local_save_interval_steps=self.local_save_interval_steps,
                      local_max_to_keep=self.local_max_to_keep)
      if not isinstance(self.local_checkpoint_dir, str) or not self.local_checkpoint_dir:
        raise ConfigError(f"task.train.local_checkpoint_dir={self.local_checkpoint_dir!r} must "
                          "be a directory on each host's local disk (e.g. /dev/shm/spmdtask), "
                          "or None for no local checkpoint tier.")
    if self.elastic_batch not in ("global", "per_slice"):
      raise ConfigError(f"task.train.elastic_batch={self.elastic_batch!r} is 'global' (keep the "
                        "global batch on fewer slices, through more microbatches) or "
                        "'per_slice' (keep each slice's rows).")
    if self.init_adapters not in ("merge", "continue"):
      raise ConfigError(f"task.train.init_adapters={self.init_adapters!r} is 'merge' (new "
                        "LoRA adapters on a LoRA start merged) or 'continue' (the start's own "
                        "adapters train on).")
    checks.in_range("task.train.eval_interval_steps", self.eval_interval_steps, 0, float("inf"),
                    "0 = never.")
    if self.eval_steps is not None:
      checks.positive(where, eval_steps=self.eval_steps)
    if self.peak_flops_per_device is not None:
      checks.in_range("task.train.peak_flops_per_device", self.peak_flops_per_device, 1.0,
                      float("inf"), "Give your accelerator's peak FLOP/s, e.g. 9.89e14, or "
                      "None for the chip's own.")
    ps = self.profile_steps
    if ps is not None and (not isinstance(ps, (tuple, list)) or len(ps) != 2
                           or not all(isinstance(x, int) and x > 0 for x in ps)):
      raise ConfigError(f"task.train.profile_steps={ps!r} must be (START, COUNT), two positive "
                        "integers (step 1 is the first), or None.")
    if not callable(self.optimizer):
      raise ConfigError(f"task.train.optimizer={self.optimizer!r} is not callable; set it to "
                        "e.g. fdl.Partial(optax.adamw, weight_decay=0.1).")
    self._validate_lm_eval()

  def _validate_lm_eval(self) -> None:
    """ConfigError naming the first lm_eval_* field that cannot work."""
    names = self.lm_eval_tasks
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
      raise ConfigError(f"task.train.lm_eval_tasks={names!r} must be a list of lm-eval task "
                        "names, e.g. --fdl_set=\"task.train.lm_eval_tasks=['hellaswag']\".")
    every = self.lm_eval_every_n_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
      raise ConfigError(f"task.train.lm_eval_every_n_steps={every!r} must be an integer >= 0 "
                        "(0 = never).")
    if bool(names) != bool(self.lm_eval_every_n_steps):
      raise ConfigError(
          f"task.train.lm_eval_tasks={tuple(names)!r} and task.train.lm_eval_every_n_steps="
          f"{self.lm_eval_every_n_steps} go together: an eval during training needs both the "
          "tasks and how often (e.g. every 1000 steps); set both, or neither.")
    if self.lm_eval_limit is not None:
      checks.in_range("task.train.lm_eval_limit", self.lm_eval_limit, 1e-9, float("inf"),
                      "Give a document count, a fraction < 1, or None for all.")
    checks.positive("task.train", lm_eval_batch_size=self.lm_eval_batch_size)

  def schedule(self) -> Callable[[Any], Any]:
    lr = self.learning_rate
    return lr if callable(lr) else optax.constant_schedule(lr)

  def make_optimizer(self) -> optax.GradientTransformation:
    """The optax transformation, with global-norm clipping first when configured."""
    tx = self.optimizer(learning_rate=self.schedule())
    if not isinstance(tx, optax.GradientTransformation):
      raise ConfigError(
          f"task.train.optimizer built {type(tx).__name__}, not an optax GradientTransformation. "
          "Set it to e.g. fdl.Partial(optax.adamw, weight_decay=0.1); it is called with "
          "learning_rate=<schedule>.")
    if self.clip_grad_norm:
      tx = optax.chain(optax.clip_by_global_norm(self.clip_grad_norm), tx)
    return tx


@dataclasses.dataclass
class DecodeParams:
  """How --mode=decode generates.

  Attributes:
    max_decode_len: the longest sequence, prompt included (the KV cache length);
      at most the model's `max_seq_len`.
    temperature: 0 = greedy (argmax); else logits are divided by it and sampled.
    top_k: sample among the k most likely tokens; 0 = off.
    top_p: sample among the smallest set of tokens whose probability reaches
      top_p (nucleus); 1.0 = off.
    seed: sampling seed; a row's draw depends on (seed, example id, position) only.
    eos_id: generation stops for a row after it emits this token, or the first of a tuple
      of them (eos and the chat template's end-of-turn); None = never.
  """
  max_decode_len: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  eos_id: int | tuple[int, ...] | None = None

  def validate(self) -> None:
    """ConfigError naming the first decode field that cannot work."""
    checks.positive("task.decode", max_decode_len=self.max_decode_len)
    checks.in_range("task.decode.temperature", self.temperature, 0.0, float("inf"),
                    "0 = greedy.")
    checks.in_range("task.decode.top_k", self.top_k, 0, float("inf"), "0 = off.")
    if isinstance(self.top_k, float):
      raise ConfigError(f"task.decode.top_k={self.top_k!r} must be an integer (0 = off).")
    checks.in_range("task.decode.top_p", self.top_p, 1e-9, 1.0, "1.0 = off.")
    checks.stop_ids("task.decode.eos_id", self.eos_id)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The tokens that end a row (eos_id as a tuple; () = none)."""
    return checks.stop_ids("task.decode.eos_id", self.eos_id)


XLA_FLAG_VARIABLES = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}


def check_xla_flags(flags: dict[str, str] | None) -> None:
  """ConfigError naming `task.xla_flags` for a kind it does not know or a flag not of the
  form --name[=value]."""
  for kind, line in (flags or {}).items():
    if kind not in XLA_FLAG_VARIABLES:
      raise ConfigError(f"task.xla_flags has a key {kind!r}; its keys are target kinds, "
                        f"{' or '.join(map(repr, XLA_FLAG_VARIABLES))}, each with a line of "
                        "flags, e.g. {'tpu': '--xla_tpu_scoped_vmem_limit_kib=98304'}.")
    bad = [f for f in str(line).split() if not f.startswith("--")]
    if bad:
      raise ConfigError(f"task.xla_flags[{kind!r}] holds {bad[0]!r}, not a flag: give "
                        "space-separated --name=value flags, e.g. "
                        "'--xla_tpu_scoped_vmem_limit_kib=98304'.")


@dataclasses.dataclass
class Task:
  """A model on a mesh, how it executes, and its train params.

  Attributes:
    model: a Flax module implementing `spmdtask.core.model.Model` (`loss(batch) ->
      (loss, metrics)`, ...) with weights created with split-dims metadata
      (`nn.with_partitioning`).
    mesh_axis_names: names of the mesh axes, e.g. ('data', 'fsdp', 'model').
    ici_mesh_shape: mesh shape within a slice/host group; one entry may be -1
      (fills the remaining devices).
    dcn_mesh_shape: mesh shape across slices; None = all ones. The full mesh is
      the element-wise product with ici_mesh_shape.
    data_axes: mesh axes the batch dim is split over by default.
    pipeline: the execution strategy of the model's layer stack (`spmdtask.core.strategy`):
      None = a remat'd scan; `pipeline.spmd.PipelineConfig` = the SPMD pipeline over the
      `stage` mesh axis; `pipeline.mpmd.config.MpmdConfig` = the MPMD pipeline, one program
      per stage on its own submesh (both need a `spmdtask.core.model.Stacked` model). Every
      strategy starts from the same initial weights; checkpoints do not depend on it.
    train: TrainParams.
    decode: DecodeParams, for --mode=decode.
    objective: what the train and eval steps minimize (`spmdtask.core.objective`): None =
      the model's own LM loss; `spmdtask.objectives.dpo.Dpo` = DPO on preference pairs.
      Chosen once here; the step, the program and the loop follow it.
    xla_flags: the compiler flags this task's numbers rest on, per target kind: 'tpu'
      (libtpu's flags, e.g. '--xla_tpu_scoped_vmem_limit_kib=98304') and 'gpu' (XLA's, e.g.
      '--xla_gpu_enable_latency_hiding_scheduler=true'). `spmdtask.main` sets them before
      JAX starts its backends (LIBTPU_INIT_ARGS and XLA_FLAGS, ahead of what the
      environment already holds, so a flag given there wins), in every mode: a plan and a
      run compile with the same flags.
  """
  model: nn.Module
  mesh_axis_names: tuple[str, ...] = ("data", "fsdp", "model")
  ici_mesh_shape: tuple[int, ...] = (-1, 1, 1)
  dcn_mesh_shape: tuple[int, ...] | None = None
  data_axes: tuple[str, ...] = ("data", "fsdp")
  pipeline: Strategy | None = None
  train: TrainParams = dataclasses.field(default_factory=TrainParams)
  decode: DecodeParams = dataclasses.field(default_factory=DecodeParams)
  objective: Objective | None = None
  xla_flags: dict[str, str] | None = None

  def validate(self) -> None:
    """Checks the train and decode fields (the model checks its own in `Model.validate`)."""
    self.train.validate()
    self.decode.validate()
    if self.objective is not None:
      self.objective.validate(self)
    check_xla_flags(self.xla_flags)

  def batch_axes(self) -> tuple[str, ...]:
    """The data axes that exist in this mesh."""
    return tuple(a for a in self.data_axes if a in self.mesh_axis_names)

  def dcn_sizes(self) -> dict[str, int]:
    """Mesh axis name -> its DCN size (the slices it spans; 1 within a slice)."""
    return dict(zip(self.mesh_axis_names, self.dcn_mesh_shape or (1,) * len(
        self.mesh_axis_names)))


@dataclasses.dataclass
class RunConfig:
  """Everything `spmdtask.main` builds: the root of every `--fdl_set` path. A dataset built
  as None is left out (a slot kept for the overrides that name it, e.g. an import's eval set
  under GRPO, which evaluates nothing)."""
  task: Task
  datasets: dict[str, Any]
  decode_datasets: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.datasets = {k: v for k, v in self.datasets.items() if v is not None}
