"""The execution-strategy contract is the only seam: no module outside a strategy's own
inspects strategy types or fields; layers/ import no pipeline module, pipeline/ no model
family; the package's import graph (every import, also inside functions) has no cycle."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY_TYPES = {"Scan", "PipelineConfig", "MpmdConfig"}
# Fields only a strategy's own modules may read (reading them elsewhere is type knowledge).
STRATEGY_FIELDS = {"layer_cuts", "submesh_shapes", "circular_repeat", "stage_axis",
                   "microbatch_size"}  # (num_chunks is also a Schedule field)
# The strategies' own modules (and the MPMD program, report and auto cuts, which are MPMD's).
OWN = {"spmdtask/pipeline/scan.py", "spmdtask/pipeline/spmd.py",
       "spmdtask/pipeline/mpmd_config.py", "spmdtask/pipeline/mpmd_stages.py",
       "spmdtask/pipeline/mpmd_program.py", "spmdtask/pipeline/mpmd_report.py",
       "spmdtask/pipeline/auto_cuts.py"}


def _sources():
  for d in ("spmdtask", "spmdtask/inputs", "spmdtask/layers", "spmdtask/pipeline"):
    for f in sorted(os.listdir(os.path.join(ROOT, d))):
      if f.endswith(".py"):
        yield f"{d}/{f}"


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


def import_graph() -> dict[str, set[str]]:
  """spmdtask module -> the spmdtask modules it imports (anywhere in the file)."""
  modules = {p[:-3].replace("/", "."): p for p in _sources()}
  graph = {}
  for mod, path in modules.items():
    deps = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    graph[mod] = {d for d in deps if d in modules and d != mod}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == "open":
        return stack[stack.index(d):] + [d]
      if d not in state:
        found = visit(d)
        if found:
          return found
    state[m] = "done"
    stack.pop()
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def test_the_import_graph_has_no_cycle():
  graph = import_graph()
  assert len(graph) > 40
  assert find_cycle(graph) is None, find_cycle(graph)
  # A cycle is found when there is one.
  assert find_cycle({**graph, "spmdtask.model": graph["spmdtask.model"] | {"spmdtask.program"}})


def test_layers_import_no_pipeline_and_pipeline_no_model_family():
  graph = import_graph()
  for mod, deps in graph.items():
    if mod.startswith("spmdtask.layers."):
      assert not {d for d in deps if d.startswith("spmdtask.pipeline")}, (mod, deps)
    if mod.startswith("spmdtask.pipeline."):
      assert not {d for d in deps if d.startswith("spmdtask.layers")}, (mod, deps)


def test_no_module_over_400_lines_no_class_over_200():
  for path in _sources():
    text = open(os.path.join(ROOT, path)).read()
    assert text.count("\n") <= 400, path
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.ClassDef):
        assert node.end_lineno - node.lineno < 200, (path, node.name)


if __name__ == "__main__":  # prints the graph: python -m tests.test_strategy_contract
  for m, deps in sorted(import_graph().items()):
    print(f"{m} -> {', '.join(sorted(deps)) or '(none)'}")
