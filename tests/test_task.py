"""Train params: optimizers from config, fprop dtype. Each compared with one device."""
import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import util

SMALL = ["task.model.num_layers=2"]


@pytest.mark.parametrize("optimizer", [
    fdl.Partial(optax.adafactor, min_dim_size_to_factor=32),
], ids=["adafactor"])  # (sgd with momentum too, measured once: suite time)
def test_optimizer_on_fsdp_tp_matches_one_device(optimizer):
  def edit(cfg):
    cfg.task.train.optimizer = optimizer
  one = util.train_steps("lm.TinyLmFsdpTp", 5, devices=jax.devices()[:1], edit=edit,
                         overrides=SMALL + ["task.ici_mesh_shape=(1, 1, 1)"])
  eight = util.train_steps("lm.TinyLmFsdpTp", 5, edit=edit, overrides=SMALL)
  assert len(set(one[0].tolist())) == 5  # the params move (sgd's first steps need not descend)
  np.testing.assert_allclose(eight[0], one[0], rtol=1e-5)
  util.assert_trees_close(eight[1], one[1], terms=util.TINY_LM_TOKENS)
  if "adafactor" in str(optimizer):
    # Factored statistics are sharded like their param minus the reduced dim.
    split = eight[2].layout.split.opt_state
    stats = [s for s in jax.tree.leaves(split, is_leaf=lambda x: hasattr(x, "v_row"))
             if hasattr(s, "v_row")][0]
    assert stats.v_row["layers"]["block"]["mlp"]["wi"] == jax.sharding.PartitionSpec(None, "fsdp")


def test_bf16_fprop_keeps_float32_state():
  f32 = util.train_steps("lm.TinyLm", 3, overrides=SMALL)
  bf16 = util.train_steps("lm.TinyLm", 3, overrides=SMALL + ["task.model.fprop_dtype='bfloat16'"])
  dtypes = {x.dtype for x in jax.tree.leaves(bf16[3].params)}
  dtypes |= {x.dtype for x in jax.tree.leaves(bf16[3].opt_state) if x.ndim}
  assert dtypes == {jnp.dtype(jnp.float32)}
  # Same math at lower precision: close to, but not bitwise, the float32 run.
  np.testing.assert_allclose(bf16[0], f32[0], rtol=3e-2)
  assert not np.array_equal(bf16[0], f32[0])
