"""tools/plan_pipeline.py: the formula table as JSON (p = 4, m = 8, v = 2), balancing, errors.
Its main runs in this process (argparse's exits caught); one test runs the script itself."""
import contextlib
import io
import json
import os
import subprocess
import sys
from fractions import Fraction as Fr

import pytest

from tests import subproc
from tools import plan_pipeline

TOOL = os.path.join(subproc.REPO, "tools", "plan_pipeline.py")
P, M, V = 4, 8, 2


def run_tool(*flags) -> subprocess.CompletedProcess:
  """The tool's exit status, stdout and stderr, its main run in this process."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = plan_pipeline.main(list(flags))
    except SystemExit as e:  # argparse's usage errors
      code = e.code
  return subprocess.CompletedProcess(flags, code, out.getvalue(), err.getvalue())


def plan_json(*flags):
  out = run_tool(*flags, "--json")
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout)


@pytest.mark.parametrize("name,chunks,bubble,peaks", [
    ("gpipe", 1, Fr(P - 1, M + P - 1), [M] * P),
    ("1f1b", 1, Fr(P - 1, M + P - 1), [P - s for s in range(P)]),
    ("interleaved_1f1b", V, Fr(P - 1, V * M + P - 1),
     [Fr(2 * (P - 1 - s) + (V - 1) * P + 1, V) for s in range(P)]),
    ("zb_h1", 1, Fr(P - 1, 3 * M + P - 1), [P - s for s in range(P)]),
])
def test_formula_table(name, chunks, bubble, peaks):
  out = plan_json(f"--schedule={name}", f"--stages={P}", f"--microbatches={M}",
                  f"--chunks={chunks}", "--costs=1,1,1")
  assert out["bubble_fraction"] == pytest.approx(float(bubble), abs=1e-12)
  assert out["peak_activations"] == [float(x) for x in peaks]
  assert out["makespan"] == pytest.approx(3 * M / (1 - float(bubble)))


def test_text_chart_and_balancing():
  # The script itself, as users run it.
  out = subproc.run([sys.executable, TOOL, "--schedule=zb_h1", "--stages=2", "--microbatches=2",
                     "--layer_costs=1,2,3,4"], timeout=60)
  assert out.returncode == 0, out.stderr
  assert "stage0: F0 F1 ...I0 W0 I1 W1\nstage1: ...F0 I0 F1 I1 W0 W1" in out.stdout
  assert "bubble fraction (max over stages) 0.1429" in out.stdout  # (p-1)/(3m+p-1) = 1/7
  assert "balanced cuts of 4 layer costs into 2 parts: layer_cuts=(3,)" in out.stdout
  bal = plan_json("--stages=3", "--layer_costs=5,1,1,1,1,1,1,5")
  assert (bal["cuts"], bal["stage_costs"]) == ([1, 6], [5.0, 5.0, 6.0])


def test_schedule_file_validated_and_simulated(tmp_path):
  good = tmp_path / "good.txt"
  good.write_text("# my 1F1B\nstage0: F0 F1 B0 B1\nstage1: F0 B0 F1 B1\n")
  out = plan_json(f"--schedule_file={good}", "--costs=1,2,0", "--latency=0.5")
  assert out["makespan"] == 2 * 3 + 3 * 1 + 2 * 0.5  # (m+p-1)(F+B) and two link crossings
  assert out["peak_activations"] == [2.0, 1.0]


@pytest.mark.parametrize("text,needles", [
    ("stage0: F0 B0 F1 B1\nstage1: F1 B1 F0 B0\n", ["stage 0, action B0", "deadlock"]),
    ("stage0: F0 F1 B0 B1\nstage1: F0 B0 F1\n", ["stage 1, action B1", "missing"]),
    ("stage0: F0 F1 B0 B1\nstage1: F0 B0 F1 Q1\n", ["line 2", "'Q1'"]),
])
def test_invalid_schedule_file_exits_with_one_message(tmp_path, text, needles):
  bad = tmp_path / "bad.txt"
  bad.write_text(text)
  out = run_tool(f"--schedule_file={bad}")
  assert out.returncode == 2 and out.stdout == ""
  assert "Traceback" not in out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("plan_pipeline: error: ")
  for needle in [str(bad)] + needles:
    assert needle in lines[0]


@pytest.mark.parametrize("flags,needle", [
    (["--schedule=interleaved_1f1b", "--stages=4", "--microbatches=6", "--chunks=2"],
     "multiple of the stages"),
    (["--schedule=1f1b", "--stages=4"], "needs --stages and --microbatches"),
    (["--schedule=1f1b", "--stages=4", "--microbatches=8", "--costs=1,2"], "--costs='1,2'"),
    (["--layer_costs=1,2,3"], "needs --stages"),
    ([], "Nothing to plan"),
])
def test_bad_flags(flags, needle):
  out = run_tool(*flags)
  assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr


def test_layer_costs_from_an_experiment():
  out = plan_json("--stages=2", "--exp=lm.TinyLm", "--fdl_set=task.model.vocab_size=4096")
  costs = out["layer_costs"]
  # One cost per layer: the embedding runs with layer 0, the big-vocabulary head with layer 3.
  assert len(costs) == 4 and costs[-1] > 1.9 * costs[1]
  assert out["cuts"] == [3]  # layer_cuts=(3,): the last layer and the head alone
  assert out["stage_costs"] == [sum(costs[:3]), sum(costs[3:])]
