"""Registered ViT experiments: `--exp=vit.TinyVit` etc."""
import fiddle as fdl
import optax

from spmdtask.experiment import Experiment
from spmdtask.inputs.images import SyntheticImageInput
from spmdtask.layers.vit import VisionTransformer, VitActivationSplit, VitWeightSplit
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.registry import register
from spmdtask.task import Task, TrainParams


@register
class TinyVit(Experiment):
  """A 0.2M-param ViT on 16x16 synthetic images of 10 classes; all devices data parallel."""
  group = "tiny"
  batch_size = 32

  def task(self) -> fdl.Config[Task]:
    model = fdl.Config(VisionTransformer, image_size=16, channels=3, patch_size=4,
                       num_classes=10, d_model=64, num_layers=4, num_heads=4, head_dim=16,
                       d_ff=256, weight_split_dims_mapping=fdl.Config(VitWeightSplit),
                       activation_split_dims_mapping=fdl.Config(VitActivationSplit))
    train = fdl.Config(TrainParams, num_train_steps=30, learning_rate=1e-3,
                       optimizer=fdl.Partial(optax.adamw, weight_decay=0.01),
                       log_interval_steps=10, eval_interval_steps=30, eval_steps=None)
    return fdl.Config(Task, model=model, mesh_axis_names=("data", "fsdp", "model"),
                      ici_mesh_shape=(-1, 1, 1), train=train)

  def datasets(self) -> dict[str, fdl.Config]:
    """'train' is endless; 'eval' is 96 held-out images of the same classes."""
    return {"train": fdl.Config(SyntheticImageInput, batch_size=self.batch_size, noise=4.0,
                                seed=1),
            "eval": fdl.Config(SyntheticImageInput, batch_size=self.batch_size, noise=4.0,
                               seed=2, num_examples=96)}


@register
class TinyVitTp(TinyVit):
  """TinyVit on 8 devices: data 4 x model (tensor) 2."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.ici_mesh_shape = (4, 1, 2)
    return cfg


@register
class TinyVitMpmd(TinyVit):
  """TinyVit as an MPMD pipeline on 8 devices: patch embedding + layers 0-1 on stage 0
  (devices 0-3, data 2 x model 2), layers 2-3 + head on stage 1 (devices 4-7, data 4);
  1F1B over 4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.pipeline = fdl.Config(MpmdConfig, layer_cuts=(2,), submesh_shapes=((2, 1, 2), (4, 1, 1)),
                              schedule="1f1b", num_microbatches=4)
    return cfg
