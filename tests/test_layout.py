"""The house: folders are the architecture, and imports run one way.

Every spmdtask module belongs to one room (a package, or a group of top-level modules); a
room imports only from the rooms `MAY_IMPORT` names (every import counts, also inside
functions). The graph has no cycle; modules stay under 400 lines and classes under 200.
"""
import ast
import os

from tests.subproc import REPO

# The rooms, lowest first, and what each may import besides itself.
SHARED = "shared"  # top level: errors, fs, console, native_output
MAY_IMPORT = {
    SHARED: set(),
    "core": {SHARED},
    "layers": {SHARED, "core"},
    "inputs": {SHARED, "core"},
    "task": {SHARED, "core"},
    "objectives": {SHARED, "core"},  # what a step minimizes besides the LM loss
    "pipeline.schedules": {SHARED},
    "plan": {SHARED, "core", "task"},
    "pipeline": {SHARED, "core"},
    "pipeline.mpmd": {SHARED, "core", "pipeline.schedules", "plan"},
    "run": {SHARED, "core", "task", "plan"},  # plan.chips: the MFU peak of the chip
    "hf": {SHARED, "core", "layers", "inputs"},  # HF names, layouts, tokenizers: pure
    # lm-evaluation-harness on the mesh: decode's programs (run), the job's chat (inputs).
    "harness": {SHARED, "core", "task", "inputs", "run"},
    "entry": {SHARED, "core", "task", "inputs", "plan", "pipeline", "pipeline.schedules",
              "pipeline.mpmd", "run", "objectives", "harness"},
    "recipe": {SHARED},  # runs the import, the prepare tools and main as subprocesses
    # HF dirs as job dirs: the mapping, checkpoints (run), config resolution (entry).
    "hf.jobs": {SHARED, "core", "hf", "run", "entry"},
}
TOP = {"errors": SHARED, "fs": SHARED, "console": SHARED, "native_output": SHARED,
       "task": "task", "main": "entry", "registry": "entry", "experiment": "entry",
       "overrides": "entry", "__init__": SHARED}


def modules() -> dict[str, str]:
  """'spmdtask.core.mesh' -> its path relative to the repository, for every module."""
  found = {}
  for d, dirs, files in os.walk(os.path.join(REPO, "spmdtask")):
    dirs[:] = [x for x in dirs if not x.startswith("__")]
    for f in files:
      if f.endswith(".py"):
        path = os.path.relpath(os.path.join(d, f), REPO)
        name = path[:-3].replace(os.sep, ".")
        found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
  return found


def room(module: str) -> str:
  parts = module.split(".")[1:] or ["__init__"]
  if len(parts) == 1 and parts[0] in TOP:
    return TOP[parts[0]]
  if parts[0] == "pipeline" and len(parts) > 1 and parts[1] in ("mpmd", "schedules"):
    return f"pipeline.{parts[1]}"
  if parts[0] == "hf" and len(parts) > 1 and parts[1] == "jobs":
    return "hf.jobs"
  return parts[0]


def import_graph() -> dict[str, set[str]]:
  """spmdtask module -> the spmdtask modules it imports (anywhere in the file)."""
  mods = modules()
  graph = {}
  for mod, path in mods.items():
    deps = set()
    for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                 for a in node.names}
    graph[mod] = {d for d in deps if d in mods and d != mod and not mod.startswith(d + ".")}
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


def test_every_import_runs_down_the_rooms():
  bad = [f"{m} ({room(m)}) imports {d} ({room(d)})"
         for m, deps in import_graph().items() for d in sorted(deps)
         if room(d) != room(m) and room(d) not in MAY_IMPORT[room(m)]
         and d != "spmdtask"]
  assert not bad, "\n".join(bad)


def test_the_rule_catches_an_upward_import():
  graph = import_graph()
  graph["spmdtask.core.mesh"] = graph["spmdtask.core.mesh"] | {"spmdtask.run.loop"}
  assert "run" not in MAY_IMPORT[room("spmdtask.core.mesh")]
  assert room("spmdtask.pipeline.mpmd.runner") == "pipeline.mpmd"
  assert room("spmdtask.pipeline.spmd") == "pipeline"
  assert room("spmdtask.hf.jobs.imports") == "hf.jobs" and room("spmdtask.hf.llama") == "hf"


def test_the_import_graph_has_no_cycle():
  graph = import_graph()
  assert len(graph) > 60
  assert find_cycle(graph) is None, find_cycle(graph)
  # A cycle is found when there is one.
  core_model = graph["spmdtask.core.model"] | {"spmdtask.core.program"}
  assert find_cycle({**graph, "spmdtask.core.model": core_model})


def test_no_framework_module_imports_a_model_family_or_a_config():
  for mod, path in modules().items():
    if room(mod) in ("layers", "hf"):  # hf maps HF families onto the layers' models
      continue
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      assert not [n for n in names if n.startswith(("spmdtask.layers", "configs"))], (mod, names)


def test_folders_are_the_architecture():
  top = sorted(f for f in os.listdir(os.path.join(REPO, "spmdtask")) if f.endswith(".py"))
  assert len(top) <= 10, top
  for package in ("core", "run", "plan", "layers", "inputs", "pipeline", "pipeline/mpmd",
                  "pipeline/schedules", "hf", "hf/jobs", "harness"):
    init = os.path.join(REPO, "spmdtask", package, "__init__.py")
    doc = ast.get_docstring(ast.parse(open(init).read()))
    assert doc and "Imports:" in doc, f"{init}: its docstring says what lives there and imports"
  assert not [p for p in modules().values() if os.path.basename(p).startswith("mpmd_")]
  assert not [f for f in os.listdir(os.path.join(REPO, "tools")) if f.startswith("bench")]
  assert os.path.exists(os.path.join(REPO, "benchmarks", "common.py"))


def test_no_module_over_400_lines_no_class_over_200():
  roots = ("spmdtask", "configs", "tools", "benchmarks")
  for top in roots:
    for d, _, files in os.walk(os.path.join(REPO, top)):
      for f in files:
        if not f.endswith(".py"):
          continue
        text = open(os.path.join(d, f)).read()
        assert text.count("\n") <= 400, os.path.join(d, f)
        for node in ast.walk(ast.parse(text)):
          if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno < 200, (f, node.name)


if __name__ == "__main__":  # prints the graph by room: python -m tests.test_layout
  for m, deps in sorted(import_graph().items()):
    print(f"{m} [{room(m)}] -> {', '.join(sorted(deps)) or '(none)'}")
