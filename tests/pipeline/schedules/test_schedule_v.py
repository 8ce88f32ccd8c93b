"""ZB-V and DualPipeV (V placement, split backward): valid for many (p, m), simulated against
their published bubbles and memory; torch compute_only CSV schedules read, mapped to stages
and chunks, converted both ways (tools/plan_pipeline.py --write), and picked up by
`task.pipeline.schedule`; bad files name the field, row and cell. Pure Python, no devices."""
import dataclasses
from fractions import Fraction as Fr

import pytest

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import generators, files, torch_csv
from spmdtask.pipeline.mpmd import stages
from spmdtask.pipeline.schedules import schedule as sl
from spmdtask.pipeline.schedules import simulate as sim_lib
from spmdtask.pipeline.schedules.schedule import Action
from tools import plan_pipeline

PM = [(p, m) for p in (1, 2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p, 24)]


def stage_bubbles(r):
  """Per stage: idle time between its own first start and last end. The zero-bubble paper's
  and DualPipe's bubbles are this (stages start and end staggered, the optimizer step
  bypassing the pipeline-wide barrier)."""
  return tuple(row[-1].end - row[0].start - busy for row, busy in zip(r.timeline, r.busy))


@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_v_schedules_validate(name, p, m):
  s = generators.generate(name, p, m, 2)
  assert (s.num_stages, s.num_microbatches, s.num_chunks, s.placement) == (p, m, 2, "v")
  assert len(sl.validate(s)) == sum(map(len, s.actions))
  kinds = {k: sum(a.kind == k for row in s.actions for a in row) for k in "FBIW"}
  assert kinds["F"] == kinds["B"] + kinds["I"] == p * m * 2 and kinds["I"] == kinds["W"]
  if name == "zb_v":
    assert kinds["B"] == 0  # every backward split


@pytest.mark.parametrize("p,m", PM)
def test_zb_v_published_bubble_and_memory(p, m):
  # Qi et al., "Zero Bubble (Almost) Pipeline Parallelism" (ICLR 2024), section 6, and the
  # authors' comparison table (sail-sg, "ZBV"): with T_F = T_B = T_W the bubble is 0 and the
  # activation memory is 1F1B's (p microbatches of one stage on every worker).
  r = sim_lib.simulate(generators.zb_v(p, m))
  assert stage_bubbles(r) == (0,) * p
  assert r.peak_activations == (p,) * p          # 1F1B's peak, p, now on every stage
  # Only the staggered start of a half-stage forward per hop remains in the makespan.
  assert r.makespan == 3 * m + Fr(p - 1, 2)
  # 1F1B under the same costs, for scale: bubble (p-1)(T_F+T_B+T_W) on stage 0.
  ref = sim_lib.simulate(generators.one_f_one_b(p, m))
  assert stage_bubbles(ref)[0] == 3 * (p - 1)


@pytest.mark.parametrize("p,m", PM)
def test_dualpipe_v_published_bubble_and_memory(p, m):
  # DeepSeek's DualPipe README table, DualPipeV row (PP = 2p model stages on p devices; F, B,
  # W per chunk, B a full backward, F&B an overlapped forward+backward pair): bubble
  # (PP/2 - 1)(F&B + B - 3W), activation PP + 1 chunk-sets per device. With a chunk half a
  # stage and F = I = W = 1 per stage: F = W = 1/2, B = 1, F&B = F + B, bubble = p - 1.
  pairs = generators.generate_pairs("dualpipe_v", p, m)
  r = sim_lib.simulate(generators.dualpipe_v(p, m), paired=pairs)
  f, w, b = Fr(1, 2), Fr(1, 2), Fr(1)
  assert stage_bubbles(r)[0] == (p - 1) * ((f + b) + b - 3 * w) == p - 1
  assert stage_bubbles(r) == tuple(Fr(2 * (p - 1) - s, 2) for s in range(p))
  assert r.peak_activations == (Fr(2 * p + 1, 2),) * p   # PP + 1 = 2p + 1 half-stage sets
  if (p, m) == (4, 10):  # the published figure's setting: rows of 66 chunk-units, 6 idle
    assert 2 * r.makespan == 66
  # The MPMD runner does not couple the pairs (each action starts once its own inputs
  # exist), which only shortens the schedule: stage s idles (p-1-s)/2.
  free = sim_lib.simulate(generators.dualpipe_v(p, m))
  assert stage_bubbles(free) == tuple(Fr(p - 1 - s, 2) for s in range(p))
  assert free.makespan == 3 * m + Fr(p - 1, 2) <= r.makespan


def test_v_generators_refuse_too_few_microbatches_and_wrong_chunks():
  with pytest.raises(ConfigError, match="zb_v needs at least 7 microbatches for 4 stages"):
    generators.generate("zb_v", 4, 6, 2)
  with pytest.raises(ConfigError, match="dualpipe_v needs at least 8 microbatches"):
    generators.generate("dualpipe_v", 4, 7, 2)
  with pytest.raises(ConfigError, match="2 chunks per stage in a V, got chunks=1"):
    generators.generate("zb_v", 4, 8, 1)


# ---- torch.distributed.pipelining compute_only CSV ---------------------------------------

# The published 1F1B and ZB-H1 layouts for 2 ranks and 4 microbatches, as torch writes them
# (rank r runs model stage r; empty cells are idle steps).
ONE_F_ONE_B_CSV = "0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
# ZB-H1: 1F1B with B split in I and W, the last rank keeping one W pending (filled into the
# tail), the first running each W right after its I.
ZB_H1_CSV = ("0F0,0F1,,0I0,0W0,0F2,0I1,0W1,0F3,0I2,0W2,0I3,0W3\n"
             ",1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3\n")


def test_csv_maps_ranks_to_stages_and_stages_to_chunks():
  s = torch_csv.loads(ONE_F_ONE_B_CSV)
  assert s == generators.one_f_one_b(2, 4)
  assert torch_csv.loads(ZB_H1_CSV) == generators.zb_h1(2, 4)
  # 'v' placement: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2.
  zbv = generators.zb_v(2, 4)
  text = torch_csv.dumps(zbv)
  assert text.splitlines()[1].startswith("1F0,2F0,1F1,2F1,2I0,2W0,")
  assert text.splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,")
  assert torch_csv.loads(text) == zbv
  loop = generators.interleaved_1f1b(2, 4, 2)
  assert torch_csv.loads(torch_csv.dumps(loop)) == loop


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1),
                                    ("interleaved_1f1b", 2), ("zb_v", 2), ("dualpipe_v", 2)])
def test_plan_pipeline_converts_both_ways(tmp_path, name, v):
  """generator -> .csv -> text form -> .csv: the same schedule at every step."""
  want = generators.generate(name, 4, 8, v)
  csv_path, txt_path, again = (str(tmp_path / f) for f in ("a.csv", "b.txt", "c.csv"))
  assert plan_pipeline.main([f"--schedule={name}", "--stages=4", "--microbatches=8",
                             f"--chunks={v}", f"--write={csv_path}", "--json"]) == 0
  assert plan_pipeline.main([f"--schedule_file={csv_path}", f"--write={txt_path}", "--json"]) == 0
  assert plan_pipeline.main([f"--schedule_file={txt_path}", f"--write={again}", "--json"]) == 0
  assert files.load(csv_path) == sl.load(txt_path) == files.load(again) == want
  assert open(csv_path).read() == open(again).read() == torch_csv.dumps(want)


@pytest.mark.parametrize("text,needles", [
    ("0F0,0SEND_F0\n", ["row 1 (rank 0), cell 2", "'0SEND_F0'", "compute_only"]),
    ("0F0,0B0\n1F0,0B1\n", ["row 2, cell 2", "stage 0 also runs on rank 0"]),
    ("0F0,0B0\n2F0,2B0\n", ["stages [1] never appear"]),
    ("0F0,3F0\n1F0,2F0\n3F0\n", ["row 3, cell 1", "stage 3 also runs on rank 0"]),
    ("0F0,0B0,2F0,2B0\n1F0,1B0,3F0,3B0\n1F1\n", ["row 3, cell 1", "stage 1 also runs"]),
    ("0F0,1F0\n2F0,3F0\n", ["stage 1 on rank 0", "neither 'loop'", "nor 'v'"]),
    ("", ["has no rows"]),
])
def test_bad_csv_names_row_and_cell(text, needles):
  with pytest.raises(ConfigError) as e:
    torch_csv.loads(text, "task.pipeline.schedule='x.csv'")
  for needle in needles:
    assert needle in str(e.value)


@dataclasses.dataclass
class Cfg:  # the fields of MpmdConfig that make_schedule reads
  schedule: str
  layer_cuts: tuple = (1,)
  num_microbatches: int = 4
  num_chunks: int = 1
  submesh_shapes: tuple = ((1, 1, 1), (1, 1, 1))

  @property
  def num_stages(self):
    return len(self.submesh_shapes)


def test_config_takes_generator_text_file_or_torch_csv(tmp_path):
  csv_path, txt_path = tmp_path / "zb_h1.csv", tmp_path / "v.txt"
  csv_path.write_text(ZB_H1_CSV)
  assert stages.make_schedule(Cfg(str(csv_path))) == generators.zb_h1(2, 4)
  sl.dump(generators.dualpipe_v(2, 4), str(txt_path))
  v = Cfg(str(txt_path), layer_cuts=(1, 2, 3), num_chunks=2)
  assert stages.make_schedule(v) == generators.dualpipe_v(2, 4)
  assert stages.make_schedule(Cfg("zb_v", (1, 2, 3), num_chunks=2)) == \
      generators.zb_v(2, 4)


def test_config_errors_name_the_field(tmp_path):
  bad = tmp_path / "bad.csv"
  bad.write_text(ZB_H1_CSV.replace("0I2", "0X2"))
  with pytest.raises(ConfigError,
                     match=r"task.pipeline.schedule='.*bad.csv', row 1 .*cell 10: '0X2'"):
    stages.make_schedule(Cfg(str(bad)))
  with pytest.raises(ConfigError, match=r"task.pipeline.schedule=.*cannot read"):
    stages.make_schedule(Cfg(str(tmp_path / "missing.csv")))
  good = tmp_path / "ok.csv"
  good.write_text(ZB_H1_CSV)
  with pytest.raises(ConfigError, match="4 microbatches but task.pipeline.num_microbatches"):
    stages.make_schedule(Cfg(str(good), num_microbatches=8))
  swapped = tmp_path / "swapped.csv"  # rank 1 runs B0 before F0
  swapped.write_text(ONE_F_ONE_B_CSV.replace(",1F0,1B0", ",1B0,1F0"))
  with pytest.raises(ConfigError, match=r"schedule=.*swapped.csv'.*stage 1, action B0: runs "
                                        "before F0"):
    stages.make_schedule(Cfg(str(swapped)))
  assert Action("F", 0) in stages.make_schedule(Cfg(str(good))).actions[1]
