"""XLA's cost analysis of a compiled program, per step: every loop body counted per trip.

`compiled.cost_analysis()` (and XLA's HloCostAnalysis under it) counts a `while` body
once, so a scanned 32-layer stack reports one layer's FLOPs. Here XLA's own
HloCostAnalysis runs on the optimized module (for whatever backend compiled it) and on
each loop body taken as the entry of the same module; a step then costs

    once(ENTRY) + sum over loop bodies B of once(B) x (runs(B) - runs(B's parent))

where runs() are the trip products of `hlo.multipliers` and once(B) already holds B's
nested loops once: every computation ends up weighted by how often it runs.
"""
import re

import jax
from jax._src.lib import _jax  # XLA's HloCostAnalysis binding (no public API yet)
from jaxlib import _hlo

from spmdtask.plan import hlo

KEYS = ("flops", "bytes accessed", "transcendentals")


def _as_entry(text: str, name: str) -> str:
  """The module text with computation `name` as its ENTRY (the header's aliasing and
  layouts, which describe the old ENTRY, dropped)."""
  out = []
  for line in text.splitlines():
    if line.startswith("HloModule "):
      line = line.split(",", 1)[0]
    if line.startswith("ENTRY "):
      line = line[len("ENTRY "):]
    if line.startswith(f"%{name} ") or line.startswith(f"{name} "):
      line = "ENTRY " + line
    out.append(line)
  return "\n".join(out)


def _once(client, text: str) -> dict[str, float]:
  costs = _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(text))
  return {k: float(costs.get(k, 0.0)) for k in KEYS}


def per_step(text: str, unknown_trips: int = 1) -> dict:
  """{'flops', 'bytes accessed', 'transcendentals'} per execution of the module (per
  device), loops counted per trip (a loop whose trips cannot be read, `unknown_trips`);
  plus the loops found ('loops': body, trips)."""
  client = jax.devices("cpu")[0].client  # the analysis is backend-neutral: any client
  total = _once(client, text)
  mult = hlo.multipliers(text, unknown_trips)
  loops = hlo.loops(text)
  for loop in {l.body: l for l in loops}.values():
    extra = mult.get(loop.body, 0) - mult.get(loop.parent, 0)
    if extra > 0:
      body = _once(client, _as_entry(text, loop.body))
      for k in KEYS:
        total[k] += extra * body[k]
  total["loops"] = [{"body": l.body, "trips": l.trips} for l in loops]
  return total


_MATMUL = re.compile(r" (?:convolution|dot)\(")
_METADATA = re.compile(r", metadata=\{[^}]*\}")  # its stack frame ids point into the module


def _blocks(text: str) -> dict[str, str]:
  """Computation name -> its text (header to closing brace), ENTRY's prefix dropped."""
  out, current = {}, None
  for line in text.splitlines():
    m = hlo.HEADER.match(line)
    if m and not line.startswith(" "):
      current = m.group(2)
      out[current] = [line.removeprefix("ENTRY ")]
    elif current is not None:
      out[current].append(line)
      if line.strip() == "}":
        current = None
  return {k: _METADATA.sub("", "\n".join(v)) for k, v in out.items()}


def fused_flops(text: str) -> dict[str, float]:
  """FLOPs of one run of each computation of the module that holds a dot or convolution
  (a fusion's, an async op's): XLA's HloCostAnalysis of it as the ENTRY of a module of its
  own, with the computations that run inside it. XLA counts what the shapes alone do not
  tell: a dilated or padded convolution's real taps."""
  client = jax.devices("cpu")[0].client
  comps, _ = hlo.computations(text)
  blocks, out = _blocks(text), {}

  def inside(name, acc):
    for line in comps.get(name, ()):
      for c in hlo.runs_inside(line):
        if c not in acc:
          inside(c, acc)
          acc.append(c)
    return acc

  for name, lines in comps.items():
    if any(_MATMUL.search(l) for l in lines):
      module = "\n\n".join(["HloModule fused"] + [blocks[c] for c in inside(name, [])]
                            + ["ENTRY " + blocks[name]])
      try:
        out[name] = _once(client, module)["flops"]
      except jax.errors.JaxRuntimeError:
        continue  # a form jaxlib cannot read back alone: the caller counts shapes instead
  return out


_STATED = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')


def stated_kernel_flops(text: str) -> float:
  """FLOPs per execution of the program that its fused kernels state themselves: each
  Pallas call's `cost_estimate` (megablox gmm's 2·m·k·n) times its computation's runs per
  step (loop trips). Kernels that state none (splash attention) count nothing here."""
  comps, _ = hlo.computations(text)
  mult = hlo.multipliers(text)
  return float(sum(mult.get(name, 0) * int(m.group(1)) for name in hlo.scheduled(text)
                   for line in comps[name] if hlo.kernel_calls(line)
                   for m in [_STATED.search(line)] if m))
