"""`task.pipeline.layer_cuts="auto"` (pipeline.auto_cuts): lm.TinyLmMpmdAuto (8 layers, stage 0
on 2 devices, stage 1 on 6) gets the cuts that `balance.balance_table` gives from the compiled
per-layer costs, the 6-device stage gets more layers, the summary shows each stage's cost
relative to the slowest, and training equals the unpipelined model on one device. Bad
values raise ConfigError naming task.pipeline.layer_cuts."""
import jax
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import balance
from spmdtask.pipeline.mpmd import report
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.core import program as program_lib
from spmdtask.core.strategy import StackFacts
from tests import util

STEPS = 3
UNPIPELINED = ("task.pipeline=None", "task.ici_mesh_shape=(1, 1, 1)")


@pytest.mark.slow  # two 8-device MPMD setups with their cost probes, and a 1-device run
def test_auto_cuts_balance_compiled_costs_and_train_like_one_device():
  losses, params, program, _ = util.train_steps("lm.TinyLmMpmdAuto", STEPS)
  costs = program.cut_costs()
  table = np.asarray(costs.table)
  assert costs.auto and table.shape == (2, 8)
  # A middle layer's per-device FLOPs on 2 data shards are 3x those on 6.
  np.testing.assert_allclose(table[0, 3] / table[1, 3], 3.0, rtol=1e-3)
  # The embedding adds little to layer 0; the head and loss add ~10% to layer 7.
  assert table[0, 3] < table[0, 0] < 1.01 * table[0, 3] < 1.05 * table[0, 3] < table[0, 7]
  chosen = balance.balance_table(costs.table)
  assert program.config.layer_cuts == costs.cuts == chosen.cuts == (2,)
  assert costs.loads == pytest.approx(chosen.stage_costs)
  # The pipeline runs those cuts: 2 layers on the 2-device stage, 6 on the 6-device one.
  assert report.stage_layers(program) == [[(0, 2)], [(2, 8)]]
  assert costs.ratios[1] == 1.0 and 0.85 < costs.ratios[0] < 1.0
  lines = program.describe()
  assert f"layers 0-1 + embedding, cost {costs.ratios[0]:.2f} of the slowest" in lines[1]
  assert "layers 2-7 + head and loss, cost 1.00 of the slowest" in lines[2]
  assert "layer_cuts (2,) (chosen by layer_cuts='auto')" in lines[-1]
  # The start line names the meshes the stages run on, not the all-device one.
  assert program_lib.mesh_words(program) == (
      "stage submeshes data=2 fsdp=1 model=1 | data=6 fsdp=1 model=1")
  want, want_params, _, _ = util.train_steps("lm.TinyLmMpmdAuto", STEPS, jax.devices()[:1],
                                             UNPIPELINED)
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  util.assert_trees_close(params, want_params, terms=util.TINY_LM_TOKENS, rtol=1e-4)


@pytest.mark.parametrize("cuts,chunks,match", [
    ("balanced", 1, r"task.pipeline.layer_cuts='balanced': the only string accepted is 'auto'"),
    ("auto", 2, r"task.pipeline.layer_cuts='auto' with task.pipeline.num_chunks=2"),
])
def test_bad_layer_cuts_are_config_errors(cuts, chunks, match):
  config = MpmdConfig(layer_cuts=cuts, submesh_shapes=((4, 1, 1), (4, 1, 1)),
                      schedule="interleaved_1f1b" if chunks > 1 else "1f1b", num_chunks=chunks)
  with pytest.raises(ConfigError, match=match):
    config.validate(StackFacts(num_layers=8, batch_size=8, mesh=None))


def test_auto_needs_a_layer_per_stage():
  config = MpmdConfig(layer_cuts="auto", submesh_shapes=((2, 1, 1),) * 4)
  with pytest.raises(ConfigError, match="cannot cut 3 layers into 4 stages"):
    config.validate(StackFacts(num_layers=3, batch_size=8, mesh=None))
  config.validate(StackFacts(num_layers=4, batch_size=8, mesh=None))
