"""XLA's cost analysis of a compiled program, per step: every loop body counted per trip.

`compiled.cost_analysis()` (and XLA's HloCostAnalysis under it) counts a `while` body
once, so a scanned 32-layer stack reports one layer's FLOPs. Here XLA's own
HloCostAnalysis runs on the optimized module (for whatever backend compiled it) and on
each loop body taken as the entry of the same module; a step then costs

    once(ENTRY) + sum over loop bodies B of once(B) x (runs(B) - runs(B's parent))

where runs() are the trip products of `hlo.multipliers` and once(B) already holds B's
nested loops once: every computation ends up weighted by how often it runs.
"""
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


def per_step(text: str) -> dict:
  """{'flops', 'bytes accessed', 'transcendentals'} per execution of the module (per
  device), loops counted per trip; plus the loops found ('loops': body, trips)."""
  client = jax.devices("cpu")[0].client  # the analysis is backend-neutral: any client
  total = _once(client, text)
  mult = hlo.multipliers(text)
  loops = hlo.loops(text)
  for loop in {l.body: l for l in loops}.values():
    extra = mult.get(loop.body, 0) - mult.get(loop.parent, 0)
    if extra > 0:
      body = _once(client, _as_entry(text, loop.body))
      for k in KEYS:
        total[k] += extra * body[k]
  total["loops"] = [{"body": l.body, "trips": l.trips} for l in loops]
  return total
