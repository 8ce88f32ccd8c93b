"""Reading a compiled program's optimized HLO text: collectives per step, XLA's warnings. Pure.

`collectives(text)` counts every collective of the per-device program by kind, with the
bytes of its result (the data each device ends up with: all-gather's gathered array,
all-reduce's reduced one, reduce-scatter's shard). Collectives inside a `while` body
(a scanned layer stack, gradient accumulation) are counted once per trip, from the
loop's `known_trip_count`, so the totals are per train step.
"""
import collections
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%([\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, e.g. 'f32[4,128]{1,0}' or a tuple '(f32[2], bf16[3,4])'."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  """(computation name -> its instruction lines, the ENTRY computation's name)."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m and not line.startswith(" "):
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
    elif current is not None and line.strip() and line.strip() != "}":
      comps[current].append(line)
  return comps, entry


def _multipliers(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
  """How many times each computation runs per execution of ENTRY (while trips multiply)."""
  mult = collections.defaultdict(int)
  mult[entry] = 1
  order = [entry]
  for name in order:  # breadth first; HLO computations form a DAG
    for line in comps.get(name, ()):
      body = _WHILE_BODY.search(line)
      trips = _TRIPS.search(line)
      for called in _CALLED.findall(line):
        factor = int(trips.group(1)) if (body and trips and called == body.group(1)) else 1
        mult[called] = max(mult[called], mult[name] * factor)
        if called not in order:
          order.append(called)
  return mult


def collectives(text: str) -> dict[str, dict[str, int]]:
  """kind -> {'count': ops executed per step, 'bytes': result bytes per device per step}."""
  comps, entry = computations(text)
  if entry is None:
    return {}
  mult = _multipliers(comps, entry)
  out: dict[str, dict[str, int]] = {}
  for name, lines in comps.items():
    for line in lines:
      m = _OP.search(line)
      if m and mult.get(name, 0):
        row = out.setdefault(m.group(2), {"count": 0, "bytes": 0})
        row["count"] += mult[name]
        row["bytes"] += mult[name] * shape_bytes(m.group(1))
  return out


_REMAT = re.compile(r"Involuntary full rematerialization.*?from sharding (\{.*?\}) to (\{.*?\}) "
                    r"efficiently for HLO operation %([\w.\-]+) = (\S+) ")


def remat_warnings(log_text: str) -> list[dict[str, str]]:
  """XLA's 'involuntary full rematerialization' messages: op, its shape, the two shardings."""
  return [{"op": op, "shape": shape, "from": src, "to": dst}
          for src, dst, op, shape in _REMAT.findall(log_text)]


def dims(shape: str) -> tuple[int, ...]:
  """'f32[16,64,64]{2,1,0}' -> (16, 64, 64)."""
  m = _ARRAY.search(shape)
  return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()
