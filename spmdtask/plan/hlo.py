"""Reading a compiled program's optimized HLO text: collectives per step. Pure.

`collectives(text)` counts every collective of the per-device program by kind, with the
bytes of its result (the data each device ends up with: all-gather's gathered array,
all-reduce's reduced one, reduce-scatter's shard). Collectives inside a `while` body
(a scanned layer stack, gradient accumulation) are counted once per trip, so the totals
are per train step. A loop's trips: its `known_trip_count` (XLA:CPU's) or, where there is
none (XLA:TPU), its condition `i < N` and the constant start of `i`. A collective counts
once per scheduled instruction that performs it (names are unique in a module; XLA:TPU
reuses `channel_id`s): an async op's done and updates, XLA:TPU's continuation and done
fusions continue its start (`scheduled_collectives`)."""
import collections
import dataclasses
import math
import re

from spmdtask.plan import replica_groups as groups

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute")  # ragged: dropless MoE's (result: the receive buffer)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
# A shape (a tuple up to two deep, e.g. XLA:GPU's `((operands), results)`), then the op.
_OP = re.compile(r"=\s*(\((?:[^()]|\([^()]*\))*\)|\S+)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%([\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")
_SCHEDULED = re.compile(r"\b(?:body|condition|branch_computations|true_computation|"
                        r"false_computation)=\{?((?:%[\w.\-]+(?:, )?)+)")
_WHILE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .* while\(%([\w.\-]+)\), condition=%([\w.\-]+), "
                    r"body=%([\w.\-]+)")
_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_STARTS = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = ")  # a line that starts an instruction
_RUNS_INSIDE = re.compile(r"\b(?:calls|to_apply)=\{?%([\w.\-]+)")  # not a schedule of its own


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, e.g. 'f32[4,128]{1,0}' or a tuple '(f32[2], bf16[3,4])'."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  """(computation name -> its instructions, each one line though its text may hold newlines
  (MaxText's kernels' attributes do), the ENTRY computation's name)."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    m = HEADER.match(line)
    if m and not line.startswith(" "):
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
    elif current is not None and line.strip() and line.strip() != "}":
      if comps[current] and not _STARTS.match(line):  # the instruction before, continued
        comps[current][-1] += line
      else:
        comps[current].append(line)
  return comps, entry


def _definitions(lines: list[str]) -> dict[str, str]:
  """Instruction name -> the rest of its line ('shape op(operands), attrs')."""
  return {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}


def _constant(defs: dict[str, str], name: str, depth: int = 3) -> int | None:
  """The integer value of `name` if it is a scalar constant (through copies), else None."""
  rhs = defs.get(name, "")
  m = re.search(r"\bconstant\((-?\d+)\)", rhs)
  if m:
    return int(m.group(1))
  m = re.search(r"\bcopy\(%([\w.\-]+)\)", rhs)
  return _constant(defs, m.group(1), depth - 1) if (m and depth) else None


def _condition_trips(comps, cond: str, parent_defs: dict[str, str], init: str) -> int | None:
  """Trips of a loop whose condition is `i < N` (or `<=`), with `i` a tuple element."""
  defs = _definitions(comps.get(cond, []))
  root = next((l for l in comps.get(cond, []) if l.lstrip().startswith("ROOT ")), "")
  m = re.search(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=(LT|LE)", root)
  if not m:
    return None
  bound = _constant(defs, m.group(2))
  index = re.search(r"get-tuple-element\(.*index=(\d+)", defs.get(m.group(1), ""))
  if bound is None or index is None:
    return None
  start = 0
  elements = re.search(r"\btuple\((.*?)\)", parent_defs.get(init, ""))
  if elements:
    names = re.findall(r"%([\w.\-]+)", elements.group(1))
    k = int(index.group(1))
    if k < len(names) and _constant(parent_defs, names[k]) is not None:
      start = _constant(parent_defs, names[k])
  return max(0, bound - start + (m.group(3) == "LE"))


@dataclasses.dataclass(frozen=True)
class Loop:
  """A `while` of the program: its body, the computation holding it, its trips (None:
  unknown, counted once)."""
  body: str
  parent: str
  trips: int | None


def loops(text: str) -> list[Loop]:
  """Every while loop of the module with its trip count."""
  comps, _ = computations(text)
  out = []
  for name, lines in comps.items():
    defs = None
    for line in lines:
      w = _WHILE.match(line)
      if not w:
        continue
      known = _TRIPS.search(line)
      if known:
        trips = int(known.group(1))
      else:
        defs = defs if defs is not None else _definitions(lines)
        trips = _condition_trips(comps, w.group(2), defs, w.group(1))
      out.append(Loop(w.group(3), name, trips))
  return out


def multipliers(text: str, unknown_trips: int = 1) -> dict[str, int]:
  """How many times each computation runs per execution of ENTRY (while trips multiply;
  a data-dependent loop's, which cannot be read, are `unknown_trips`)."""
  comps, entry = computations(text)
  if entry is None:
    return {}
  trips = {l.body: unknown_trips if l.trips is None else l.trips or 1 for l in loops(text)}
  mult = collections.defaultdict(int)
  mult[entry] = 1
  order = [entry]
  for name in order:  # breadth first; HLO computations form a DAG
    for line in comps.get(name, ()):
      body = _WHILE_BODY.search(line)
      for called in _CALLED.findall(line):
        factor = trips.get(called, 1) if (body and called == body.group(1)) else 1
        mult[called] = max(mult[called], mult[name] * factor)
        if called not in order:
          order.append(called)
  return dict(mult)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the program: its kind, result bytes per device, how often it runs
  per step, the devices in its group, and whether it crosses slices (DCN)."""
  kind: str
  bytes: int
  runs: int
  group_size: int
  dcn: bool = False
  hosts: int = 1  # the most hosts one of its groups spans (GPUs: where `host_of` is given)

  @property
  def label(self) -> str:
    """Its kind as the plan's tables name it: e.g. 'all-reduce', 'all-reduce (dcn)'."""
    return self.kind + (" (dcn)" if self.dcn else "")


# Across slices XLA:TPU hands a collective to the megascale runtime as a host-transfer
# send / recv pair, named after the collective it implements.
_DCN_SEND = re.compile(r"=\s*\((\S+?), .*\bsend\(.*xla_megascale_runtime.*"
                       r'_xla_host_transfer_rendezvous="([a-z\-]+?)(?:-start)?[.\d_"]')


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a computation: its name (unique in the module), result shape, op,
  operand names and the computations that run inside it (a fusion's, an async op's, a
  reduction's; not a loop's or branch's, which are scheduled of their own); `line` is its
  whole text."""
  name: str
  shape: str
  op: str
  operands: tuple[str, ...]
  called: tuple[str, ...]
  line: str


def runs_inside(line: str) -> list[str]:
  """The computations that run inside an instruction line (`Instruction.called`)."""
  return _RUNS_INSIDE.findall(line)


def _closing(text: str, start: int) -> int:
  """The index just past the bracket group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += (text[i] in "([{") - (text[i] in ")]}")
    if depth == 0:
      return i + 1
  return len(text)


def instructions(lines: list[str]) -> list[Instruction]:
  """A computation's instruction lines (`computations`) parsed, in their (scheduled) order."""
  out = []
  for line in lines:
    m = _DEF.match(line)
    if not m:
      continue
    rhs = m.group(2)
    shape_end = _closing(rhs, 0) if rhs.startswith("(") else rhs.find(" ")
    op = re.match(r"\s*([\w\-]+)\(", rhs[shape_end:])
    if not op:
      continue
    args_at = shape_end + op.end() - 1
    args = rhs[args_at:_closing(rhs, args_at)]
    out.append(Instruction(m.group(1), rhs[:shape_end], op.group(1),
                           tuple(re.findall(r"%([\w.\-]+)", args)),
                           tuple(_RUNS_INSIDE.findall(line)), line))
  return out


def scheduled(text: str) -> list[str]:
  """The computations that run as a schedule of their own: the ENTRY, loop bodies and
  conditions, a conditional's branches (a fusion's or an async op's computation runs
  inside its caller's instruction)."""
  comps, entry = computations(text)
  names = [entry] if entry else []
  for lines in comps.values():
    for line in lines:
      for group in _SCHEDULED.findall(line):
        names += [c.lstrip("%") for c in group.split(", ") if c.strip("%, ")]
  return list(dict.fromkeys(n for n in names if n in comps))


_ASYNC_TAIL = re.compile(r"-(done|update)$")


def async_origins(instrs: list[Instruction], comps: dict[str, list[str]]) -> dict[str, str]:
  """Instruction -> the async start it continues, in one scheduled computation: an
  `X-start` or `async-start` is its own origin; an `X-done` / `X-update`, a tuple element
  of one, and XLA:TPU's continuation and done fusions (computations holding the same
  collective, fed by the start's outputs) carry the origin of the operand they continue.
  A start is an op ending in -start or XLA:TPU's fusion whose computation ends in the
  `AsyncCollectiveStart` custom call."""
  origin: dict[str, str] = {}
  for ins in instrs:
    if is_async_start(ins, comps):
      origin[ins.name] = ins.name
      continue
    fed = next((origin[o] for o in ins.operands if o in origin), None)
    if fed is not None and (ins.op == "get-tuple-element" or _ASYNC_TAIL.search(ins.op)
                            or (ins.op == "fusion" and inner_collectives(ins, comps))):
      origin[ins.name] = fed
  return origin


def _wraps(ins: Instruction, comps, target: str) -> bool:
  return ins.op == "fusion" and any(f'custom_call_target="{target}"' in l
                                    for c in ins.called for l in comps.get(c, ()))


def is_async_start(ins: Instruction, comps) -> bool:
  """An `X-start`, `async-start`, or XLA:TPU's start fusion (`AsyncCollectiveStart`)."""
  return ins.op.endswith("-start") or _wraps(ins, comps, "AsyncCollectiveStart")


def is_async_done(ins: Instruction, comps) -> bool:
  """An `X-done`, `async-done`, or XLA:TPU's done fusion (`AsyncCollectiveDone`)."""
  return ins.op.endswith("-done") or _wraps(ins, comps, "AsyncCollectiveDone")


def inner_collectives(ins: Instruction, comps, depth: int = 4) -> list[str]:
  """The collective lines inside the computations `ins` calls (fusions nest)."""
  out = []
  for c in ins.called:
    for inner in instructions(comps.get(c, [])):
      if _OP.search(_LAYOUT.sub("", inner.line)):
        out.append(inner.line)
      elif depth and inner.called:
        out += inner_collectives(inner, comps, depth - 1)
  return out


_LAYOUT = re.compile(r"\{[^{}]*\}")  # a layout, e.g. {2,1,0:T(8,128)(2,1)S(1)}


def _top_level(shape: str) -> list[str]:
  """The elements of a tuple shape '(a, (b, c))' -> ['a', '(b, c)']."""
  out, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    depth += (ch in "([") - (ch in ")]")  # dims' commas are inside brackets
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      out.append(shape[start:i].strip())
      start = i + 1
  return out


def result_shape(shape: str, kind: str, start: bool) -> str:
  """The result part of a collective's HLO shape (layouts removed). An async start's shape
  holds its operands too: `(operand, result)` for an all-gather, `((operands), (results))`
  combined, `(operand, result, u32[], u32[])` for a collective-permute (XLA:GPU); an
  all-reduce-start's is its result alone."""
  if not start or kind == "all-reduce" or not shape.startswith("("):
    return shape
  parts = _top_level(shape)
  return parts[1] if len(parts) > 1 else shape


def collective_result(line: str) -> tuple[str, str] | None:
  """(kind, result shape without layouts) of the collective an HLO line performs, or None."""
  m = _OP.search(_LAYOUT.sub("", line))
  return (m.group(2), result_shape(m.group(1), m.group(2), bool(m.group(3)))) if m else None


def branches(line: str) -> list[str]:
  """The computations a `conditional` line may run."""
  return [c.strip("%, ") for g in _SCHEDULED.findall(line) for c in g.split(", ")
          if c.strip("%, ")]


def _collective(line: str, num_slices: int, runs: int, host_of=None) -> Collective | None:
  """The collective one HLO line performs (a bare or -start op, or a send across slices)."""
  m, dcn = _OP.search(_LAYOUT.sub("", line)), _DCN_SEND.search(line)
  if dcn:
    return Collective(dcn.group(2), shape_bytes(dcn.group(1)), runs, num_slices, True)
  if m:
    shape = result_shape(m.group(1), m.group(2), bool(m.group(3)))
    return Collective(m.group(2), shape_bytes(shape), runs, groups.group_size(line),
                      hosts=groups.hosts_spanned(line, host_of))
  return None


def scheduled_collectives(text: str, num_slices: int = 1, host_of: tuple[int, ...] | None = None,
                          unknown_trips: int = 1) -> dict[str, list[Collective]]:
  """Per instruction of a scheduled computation that performs collectives (a bare
  collective, an async start, a fusion that holds one), named by that instruction: its
  collectives, each with the runs per step of its computation. An async op's done,
  update and XLA:TPU continuation fusions hold clones of its start's collective and are
  not counted again (`async_origins`). `host_of`: the host of each logical device (GPUs),
  for the hosts each collective spans; `unknown_trips` as `multipliers`."""
  comps, _ = computations(text)
  mult = multipliers(text, unknown_trips)
  out: dict[str, list[Collective]] = {}
  for name in scheduled(text):
    if not mult.get(name, 0):
      continue
    instrs = instructions(comps[name])
    origin = async_origins(instrs, comps)
    for ins in instrs:
      if origin.get(ins.name, ins.name) != ins.name:
        continue
      lines = [ins.line] if _collective(ins.line, num_slices, 1) else inner_collectives(
          ins, comps)
      ops = [c for c in (_collective(l, num_slices, mult[name], host_of) for l in lines) if c]
      if ops:
        out[ins.name] = ops
  return out


def collective_ops(text: str, num_slices: int = 1, host_of: tuple[int, ...] | None = None,
                   unknown_trips: int = 1) -> list[Collective]:
  """Every collective of the per-device program, counted per step (see module doc)."""
  return [op for ops in scheduled_collectives(text, num_slices, host_of,
                                              unknown_trips).values() for op in ops]


_KERNELS = ('custom_call_target="tpu_custom_call"', 'custom_call_target="__cudnn$fmha')


def kernel_calls(text: str) -> int:
  """How many fused-kernel calls the optimized program holds: Pallas kernels (XLA:TPU) and
  cuDNN's fused attention (XLA:GPU), custom calls whose FLOPs XLA's cost analysis cannot
  see (`plan.flops` traces them)."""
  return sum(text.count(k) for k in _KERNELS)


def collectives(text: str, num_slices: int = 1) -> dict[str, dict[str, int]]:
  """kind -> {'count': ops executed per step, 'bytes': result bytes per device per step};
  collectives across slices are kinds of their own, e.g. 'all-reduce (dcn)'."""
  return by_kind(collective_ops(text, num_slices))


def by_kind(ops: list[Collective]) -> dict[str, dict[str, int]]:
  """`collectives` of ops already read (`collective_ops`)."""
  out: dict[str, dict[str, int]] = {}
  for op in ops:
    row = out.setdefault(op.label, {"count": 0, "bytes": 0})
    row["count"] += op.runs
    row["bytes"] += op.runs * op.bytes
  return out


def dims(shape: str) -> tuple[int, ...]:
  """'f32[16,64,64]{2,1,0}' -> (16, 64, 64)."""
  m = _ARRAY.search(shape)
  return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()
