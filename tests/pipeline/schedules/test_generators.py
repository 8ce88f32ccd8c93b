"""The generators: valid schedules of the documented shape; clear errors for impossible ones."""
import pytest

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import generators
from spmdtask.pipeline.schedules import schedule as sl
from spmdtask.pipeline.schedules.schedule import Action

CASES = [(name, p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 4, 8, 12)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2),
                         ("interleaved_1f1b", 3)) if not (name[0] == "i" and m % p)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_generated_schedule_validates(name, p, m, v):
  s = generators.generate(name, p, m, v)
  assert (s.num_stages, s.num_microbatches, s.num_chunks) == (p, m, v)
  assert len(sl.validate(s)) == sum(map(len, s.actions))


def kinds(row):
  return "".join(a.kind for a in row)


def test_one_f_one_b_shape():
  s = generators.one_f_one_b(4, 6)
  # Stage s: p-1-s warm-up forwards, alternation, then the remaining backwards.
  assert [kinds(r) for r in s.actions] == ["FFF" + "FB" * 3 + "BBB", "FF" + "FB" * 4 + "BB",
                                           "F" + "FB" * 5 + "B", "FB" * 6]
  assert [str(a) for a in s.actions[1][:6]] == ["F0", "F1", "F2", "B0", "F3", "B1"]


def test_gpipe_shape():
  assert [kinds(r) for r in generators.gpipe(2, 3).actions] == ["FFFBBB"] * 2


def test_interleaved_follows_megatron_order():
  s = generators.interleaved_1f1b(2, 4, 2)
  # Forwards go through the chunks in groups of p = 2 microbatches, backwards mirror them;
  # stage s warms up with 2(p-1-s) + (v-1)p = 4 - 2s chunk forwards.
  assert " ".join(map(str, s.actions[0][:8])) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1"
  assert " ".join(map(str, s.actions[1][:6])) == "F0 F1 F0.1 B0.1 F1.1 B1.1"
  assert s.placement == "loop" and s.virtual_stage(1, 1) == 3


def test_zb_h1_keeps_1f1b_order_of_f_and_i():
  p, m = 4, 8
  zb, ref = generators.zb_h1(p, m), generators.one_f_one_b(p, m)
  for s in range(p):
    assert [(a.kind.replace("I", "B"), a.microbatch) for a in zb.actions[s] if a.kind != "W"] \
        == [(a.kind, a.microbatch) for a in ref.actions[s]]
    # Stage s leaves s weight-grad passes pending and runs them after its last I.
    assert kinds(zb.actions[s]).endswith("I" + "W" * (s + 1))
  assert zb.actions[0][4:7] == (Action("I", 0), Action("W", 0), Action("F", 4))


@pytest.mark.parametrize("args,needles", [
    (("zb_h2", 4, 8, 1), ["'zb_h2'", "gpipe, 1f1b, interleaved_1f1b, zb_h1"]),
    (("interleaved_1f1b", 4, 6, 2), ["multiple of the stages (4)", "Use 8 microbatches"]),
    (("1f1b", 4, 8, 2), ["chunks=2", "interleaved_1f1b"]),
    (("gpipe", 0, 8, 1), ["stages >= 1"]),
    (("zb_h1", 4, 0, 1), ["microbatches >= 1"]),
])
def test_impossible_requests(args, needles):
  with pytest.raises(ConfigError) as e:
    generators.generate(*args)
  for needle in needles:
    assert needle in str(e.value)
