"""The MPMD executor runs ZB-V and DualPipeV (two chunks per stage in a V, split backward)
and hand-written torch compute_only CSVs of 1F1B and ZB-H1, with jax.grad's loss and grads on
one device (rel 1e-5) and the simulator's per-stage activation peaks."""
from spmdtask.pipeline.schedules import generators, files
from tests.pipeline.mpmd.test_pipeline import (M, TWO, check_run, measured_equals_simulated,
                                               toy_batch, toy_params, toy_pipeline)
from tests.pipeline.schedules.test_schedule_v import ONE_F_ONE_B_CSV, ZB_H1_CSV


def test_v_schedules_and_torch_csv_equal_one_device(tmp_path):
  params, batch = toy_params(4), toy_batch(4)
  for name in ("zb_v", "dualpipe_v"):  # 2 stages x 2 chunks = 4 parts, V: stage 0 = 0, 3
    schedule = generators.generate(name, 2, M, 2)
    pl = toy_pipeline((0, 1, 2), TWO, schedule)
    assert pl.part_stage == [0, 1, 1, 0] and pl.tied == {}
    result = check_run(pl, params, batch)
    measured_equals_simulated(result, schedule)
  for text, name in ((ONE_F_ONE_B_CSV, "1f1b"), (ZB_H1_CSV, "zb_h1")):
    path = tmp_path / f"{name}.csv"
    path.write_text(text)  # written by hand, as torch.distributed.pipelining users do
    schedule = files.load(str(path))
    assert schedule == generators.generate(name, 2, M)
    pl = toy_pipeline((0,), TWO, schedule)
    measured_equals_simulated(check_run(pl, params, batch), schedule)
