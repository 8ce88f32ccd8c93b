"""Registered Mixture-of-Experts experiments. `--exp=TinyMoe` etc."""
import fiddle as fdl

from configs import lm
from spmdtask.layers.moe import MoeConfig
from spmdtask.layers.transformer import ActivationSplit, WeightSplit
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from spmdtask.registry import register
from spmdtask.task import Task

MESH_AXES = ("data", "expert", "fsdp", "model")
BATCH = ("data", "expert", "fsdp")  # the expert axis splits the batch too (MaxText, Praxis)
ACTIVATIONS = dict(embed=(BATCH, None, None), heads=(BATCH, None, "model", None),
                   ff=(BATCH, None, "model"), logits=(BATCH, None, "model"))
EXPERT_WEIGHTS = dict(expert_in=("expert", "fsdp", "model"),
                      expert_out=("expert", "model", "fsdp"))


def moe_split(cfg: fdl.Config[Task]) -> None:
  """Expert parallelism on `cfg`'s model: experts over `expert`, the batch over BATCH."""
  cfg.mesh_axis_names = MESH_AXES
  cfg.model.weight_split_dims_mapping = fdl.Config(WeightSplit, **EXPERT_WEIGHTS)
  cfg.model.activation_split_dims_mapping = fdl.Config(ActivationSplit, **ACTIVATIONS)


@register
class TinyMoe(lm.TinyLm):
  """TinyLm's model with a Mixture of Experts in every layer: 8 SwiGLU experts of 128,
  top-2, one shared expert, dropless; the experts split over all devices (`expert` -1)."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model.moe = fdl.Config(MoeConfig, num_experts=8, top_k=2, d_ff=128,
                               num_shared_experts=1)
    moe_split(cfg)
    cfg.ici_mesh_shape = (1, -1, 1, 1)
    return cfg


@register
class TinyMoeMpmd(TinyMoe):
  """TinyMoe as an MPMD pipeline on 8 devices: embedding + layer 0 on stage 0 (expert 2 x
  model 2), layers 1-3 + head + loss on stage 1 (expert 4); 1F1B over 4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.pipeline = fdl.Config(MpmdConfig, layer_cuts=(1,),
                              submesh_shapes=((1, 2, 1, 2), (1, 4, 1, 1)), schedule="1f1b",
                              num_microbatches=4)
    return cfg


@register
class TinyMoePipeline(TinyMoe):
  """TinyMoe in a GPipe pipeline: stage 2 x expert 2 x model 2, 4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.mesh_axis_names = ("stage",) + MESH_AXES
    cfg.ici_mesh_shape = (2, 1, 2, 1, 2)
    cfg.pipeline = fdl.Config(PipelineConfig, num_stages=2, num_microbatches=4)
    return cfg
