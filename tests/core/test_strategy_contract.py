"""The execution-strategy contract is the only seam: no module outside a strategy's own
inspects strategy types or fields (the import direction is `tests/test_layout.py`'s)."""
import ast
import os

from tests.subproc import REPO as ROOT
STRATEGY_TYPES = {"Scan", "PipelineConfig", "MpmdConfig"}
# Fields only a strategy's own modules may read (reading them elsewhere is type knowledge).
STRATEGY_FIELDS = {"layer_cuts", "submesh_shapes", "circular_repeat", "stage_axis",
                   "microbatch_size"}  # (num_chunks is also a Schedule field)
# The strategies' own modules (and the MPMD program, report and auto cuts, which are MPMD's).
OWN = {"spmdtask/core/scan.py", "spmdtask/pipeline/spmd.py",
       "spmdtask/pipeline/mpmd/config.py", "spmdtask/pipeline/mpmd/stages.py",
       "spmdtask/pipeline/mpmd/program.py", "spmdtask/pipeline/mpmd/report.py",
       "spmdtask/pipeline/mpmd/auto_cuts.py"}


def _sources():
  for d, _, files in sorted(os.walk(os.path.join(ROOT, "spmdtask"))):
    for f in sorted(files):
      if f.endswith(".py"):
        yield os.path.relpath(os.path.join(d, f), ROOT)


def _name(node) -> str:
  return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _violations(path: str) -> list[str]:
  out = []
  for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
    if isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) == 2:
      types = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
      out += [f"isinstance(..., {_name(t)}) line {node.lineno}" for t in types
              if _name(t) in STRATEGY_TYPES]
    if isinstance(node, ast.Call) and _name(node.func) in ("getattr", "hasattr"):
      arg = node.args[1] if len(node.args) > 1 else None
      if isinstance(arg, ast.Constant) and arg.value in STRATEGY_FIELDS:
        out.append(f"{_name(node.func)}(..., {arg.value!r}) line {node.lineno}")
    if isinstance(node, ast.Attribute) and node.attr in STRATEGY_FIELDS:
      out.append(f".{node.attr} line {node.lineno}")
  return out


def test_no_strategy_type_or_field_is_inspected_outside_the_strategy_modules():
  found = {p: v for p in _sources() if p not in OWN for v in [_violations(p)] if v}
  assert not found, found
