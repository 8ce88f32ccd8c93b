"""Schedules as data: the text form round-trips, and every broken rule is one clear error."""
import pytest

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import generators
from spmdtask.pipeline.schedules import schedule as sl
from spmdtask.pipeline.schedules.schedule import Action, Schedule


def rows(*texts):
  return tuple(tuple(Action.parse(t) for t in text.split()) for text in texts)


def test_action_text():
  assert Action.parse("F3") == Action("F", 3, 0) and str(Action("F", 3)) == "F3"
  assert Action.parse("I12.1") == Action("I", 12, 1) and str(Action("I", 12, 1)) == "I12.1"
  for bad in ("X1", "F", "F1.", "f1", "F-1"):
    with pytest.raises(ValueError):
      Action.parse(bad)


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved_1f1b", 4, 8, 2), ("zb_h1", 4, 6, 1)])
def test_text_round_trip(name, p, m, v, tmp_path):
  s = generators.generate(name, p, m, v)
  assert sl.loads(sl.dumps(s)) == s
  sl.dump(s, tmp_path / "s.txt")
  assert sl.load(str(tmp_path / "s.txt")) == s


def test_text_form_is_readable_and_header_optional():
  s = generators.one_f_one_b(2, 2)
  assert sl.dumps(s) == ("stages=2 microbatches=2 chunks=1 placement=loop\n"
                         "stage0: F0 F1 B0 B1\nstage1: F0 B0 F1 B1\n")
  text = "# a comment\nstage1: F0 B0 F1 B1  # stage rows in any order\n\nstage0: F0 F1 B0 B1\n"
  assert sl.loads(text) == s
  v = sl.loads("stage0: F0 F0.1 B0.1 B0\nstage1: F0 F0.1 B0.1 B0\n")
  assert (v.num_chunks, v.num_microbatches, v.placement) == (2, 1, "loop")


@pytest.mark.parametrize("text,needles", [
    ("stage0: F0 X1\n", ["line 1", "stage0", "'X1'"]),
    ("stage0: F0 B0\nstage0: F0 B0\n", ["line 2", "second row"]),
    ("stage0: F0 B0\nstages=1\n", ["line 2", "header"]),
    ("stages=0\nstage0: F0 B0\n", ["line 1", "'stages=0'"]),
    ("stages=2\nstage0: F0 B0\n", ["stage0 .. stage1"]),
    ("# nothing\n", ["no `stageN"]),
])
def test_text_errors_name_the_line(text, needles):
  with pytest.raises(ConfigError) as e:
    sl.loads(text, source="file x.txt")
  for needle in ["file x.txt"] + needles:
    assert needle in str(e.value)


def test_load_missing_file():
  with pytest.raises(ConfigError, match="Cannot read the schedule file"):
    sl.load("/nonexistent/schedule.txt")


def test_dependencies_follow_the_placement():
  loop = Schedule(2, 1, rows("F0 F0.1 B0.1 B0", "F0 F0.1 B0.1 B0"), num_chunks=2)
  # Virtual stages 0,1,2,3 = (s0,c0), (s1,c0), (s0,c1), (s1,c1).
  assert sl.dependencies(loop, 0, Action("F", 0, 1)) == [(1, Action("F", 0, 0))]
  assert sl.dependencies(loop, 0, Action("F", 0, 0)) == []
  assert sl.dependencies(loop, 1, Action("B", 0, 0)) == [(1, Action("F", 0, 0)),
                                                         (0, Action("B", 0, 1))]
  vee = Schedule(2, 1, rows("F0 F0.1 I0.1 W0.1 B0", "F0 F0.1 B0.1 B0"), num_chunks=2,
                 placement="v")
  # Virtual stages 0,1,2,3 = (s0,c0), (s1,c0), (s1,c1), (s0,c1): the V turns on stage 1.
  assert sl.dependencies(vee, 1, Action("F", 0, 1)) == [(1, Action("F", 0, 0))]
  assert sl.dependencies(vee, 1, Action("B", 0, 1)) == [(1, Action("F", 0, 1)),
                                                        (0, Action("I", 0, 1))]
  assert sl.dependencies(vee, 0, Action("W", 0, 1)) == [(0, Action("I", 0, 1))]
  assert sl.validate(vee) == [(0, Action("F", 0, 0)), (1, Action("F", 0, 0)),
                              (1, Action("F", 0, 1)), (0, Action("F", 0, 1)),
                              (0, Action("I", 0, 1)), (0, Action("W", 0, 1)),
                              (1, Action("B", 0, 1)), (1, Action("B", 0, 0)),
                              (0, Action("B", 0, 0))]


@pytest.mark.parametrize("stage_rows,needles", [
    (("F0 F1 B0 B1", "F0 B0 F1"), ["stage 1, action B1", "missing"]),
    (("F0 F1 B0 B1", "F0 B0 F1 B1 F1"), ["stage 1, action F1", "runs twice"]),
    (("F0 F1 B0 B1", "F0 B0 B1 F1"), ["stage 1, action B1", "runs before F1", "forward"]),
    (("F0 F1 I0 W0 I1 W1", "F0 I0 F1 W1 I1 W0"), ["stage 1, action W1", "runs before I1"]),
    (("F0 F1 I0 W0 I1", "F0 B0 F1 B1"), ["stage 0, action W1", "missing"]),
    (("F0 F1 B0 I0 W0 B1", "F0 B0 F1 B1"), ["stage 0, action I0", "mixes B"]),
    (("F0 F1 B0 B1 F2", "F0 B0 F1 B1"), ["stage 0, action F2", "microbatch 2 is out of range"]),
    (("F0 F1 B0 B1 F0.1", "F0 B0 F1 B1"), ["stage 0, action F0.1", "chunk 1 is out of range"]),
    (("F0 B0 F1 B1", "F1 B1 F0 B0"), ["stage 0, action B0", "deadlock",
                                      "stage 1 at F1 waits for F1 on stage 0"]),
])
def test_each_broken_rule_is_named(stage_rows, needles):
  with pytest.raises(ConfigError) as e:
    sl.validate(Schedule(2, 2, rows(*stage_rows)), source="--schedule_file=s.txt")
  message = str(e.value)
  assert message.startswith("--schedule_file=s.txt: ") and "Rule: " in message
  for needle in needles:
    assert needle in message


def test_mixed_split_and_unsplit_backward_is_valid():
  # Stage 0 splits its backward, stage 1 does not: I on stage 0 waits for B on stage 1.
  s = Schedule(2, 2, rows("F0 F1 I0 I1 W0 W1", "F0 B0 F1 B1"))
  order = sl.validate(s)
  assert order.index((1, Action("B", 1))) < order.index((0, Action("I", 1)))


def test_field_errors():
  with pytest.raises(ConfigError, match="placement='v' needs exactly 2 chunks"):
    sl.validate(Schedule(1, 1, rows("F0 B0"), placement="v"))
  with pytest.raises(ConfigError, match="1 stage rows for num_stages=2"):
    sl.validate(Schedule(2, 1, rows("F0 B0")))
  with pytest.raises(ConfigError, match="num_microbatches=0"):
    sl.validate(Schedule(1, 0, rows("")))
