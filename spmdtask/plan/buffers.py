"""The largest arrays of a compiled program, read from its optimized HLO text (also the one
XLA writes out before XLA:TPU refuses a program for lack of HBM), and the need XLA:TPU's
out-of-memory message states. Pure.

`hlo_arrays(text)` lists the arrays a per-device program writes to memory: the result of
every instruction in a computation that runs as such (the ENTRY, loop bodies and
conditions, branches), not those inside a fusion (a fusion's inner values never reach
HBM whole), and not views (parameters, tuple elements, bitcasts); those in the device's
main memory (HBM), or with `on_host` those XLA placed in the host's memory (a layout's
memory space S(5): offloaded activations); never on-chip scratch (VMEM and the other
memory spaces of a layout's `S(n)`). Each with its shape,
bytes, and what it is (the JAX op it came from, from XLA's metadata). It says which arrays
a program makes, not how long they live: an array listed is one the program holds at
some point, and one not listed (e.g. a whole float32 logits array) is never made.

`compiler_need(message)` reads XLA:TPU's RESOURCE_EXHAUSTED message: the bytes the program
needs and the HBM it may use (the message lists no arrays in libtpu's AOT compile).
"""
import dataclasses
import re

from spmdtask.plan import hlo


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One array: `shape` as HLO writes it ('bf16[80,1,8192,8192]'), its bytes per device,
  `what` made it (the JAX op name, or XLA's instruction), and `kind` (the HLO opcode, or
  XLA's allocation type)."""
  shape: str
  bytes: int
  what: str
  kind: str

  @property
  def dtype(self) -> str:
    return self.shape.split("[")[0]

  @property
  def dims(self) -> tuple[int, ...]:
    return hlo.dims(self.shape)

  def as_json(self) -> dict:
    return dataclasses.asdict(self)


_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ([a-z][a-z0-9]*\[[0-9,]*\])(\{[^ ]*\})? "
                   r"([\w\-]+)\(")
_SPACE = re.compile(r"S\((\d+)\)\}$")  # a layout's memory space; none: the device's HBM
HOST_SPACE = 5  # XLA's memory space of the host's (pinned) memory
MOE_SCOPE = "moe"  # the name scope of a block's Mixture of Experts (layers.moe.MoeFfn)
_FUSED = re.compile(r"\b(?:calls|to_apply)=\{?%([\w.\-]+)")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_VIEWS = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "iota",
          "after-all", "partition-id", "replica-id"}


def op_name(name: str) -> str:
  """A JAX op name, short: its last three path parts, the op's parameters ('[...]') dropped:
  'jit(step)/jvp(Lm)/layers/while/body/mlp/dot_general[dimension_numbers=...]' ->
  'body/mlp/dot_general'."""
  parts = [p for p in re.sub(r"\[[^\[\]]*\]", "", name).split("/") if p]
  return "/".join(parts[-3:])


def hlo_arrays(text: str, top: int | None = 10, on_host: bool = False,
               within: str | None = None) -> list[Buffer]:
  """The `top` (None: all) largest arrays the per-device program `text` writes in the
  device's HBM (with `on_host`: in the host's memory), largest first; one per shape and op
  (module doc). With `within`, only those a JAX op made under that name scope (a part of
  its op name: a Flax module's name, e.g. 'moe')."""
  want = HOST_SPACE if on_host else 0
  comps, _ = hlo.computations(text)
  inner = {m for lines in comps.values() for line in lines for m in _FUSED.findall(line)}
  seen, out = set(), []
  for name, lines in comps.items():
    if name in inner:
      continue
    for line in lines:
      m = _LINE.match(line)
      if not m or m.group(4) in _VIEWS:
        continue
      space = _SPACE.search(m.group(3) or "")
      if (int(space.group(1)) if space else 0) != want:
        continue
      what = _OP_NAME.search(line)
      if within and not (what and within in what.group(1).split("/")):
        continue
      what = op_name(what.group(1)) if what else m.group(1)
      key = (m.group(2), what)
      if key not in seen:
        seen.add(key)
        out.append(Buffer(m.group(2), hlo.shape_bytes(m.group(2)), what, m.group(4)))
  return sorted(out, key=lambda b: -b.bytes)[:top]


def plan_section(text: str | None, top: int) -> dict:
  """A compiled program's `top` largest arrays in the device's HBM (`largest_arrays`);
  where XLA placed some in the host's memory (offloaded activations), there
  (`largest_host_arrays`); where it has Mixture-of-Experts layers, those their dispatch
  makes (`largest_moe_arrays`), as JSON; none where its optimized program `text` is
  unknown."""
  if text is None:
    return {"largest_arrays": []}
  out = {"largest_arrays": [b.as_json() for b in hlo_arrays(text, top)]}
  moe = hlo_arrays(text, top, within=MOE_SCOPE)
  if moe:  # a Mixture of Experts' dispatch: its token buffers, by expert, and their FFN
    out["largest_moe_arrays"] = [b.as_json() for b in moe]
  host = [b.as_json() for b in hlo_arrays(text, top, on_host=True)]
  return {**out, "largest_host_arrays": host} if host else out


_SIZE = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_NUM = r"([\d.]+)([KMGT]?)B?"
_NEEDS = (re.compile(rf"Used {_NUM} of {_NUM} hbm"),  # XLA:TPU's two wordings
          re.compile(rf"HLO temporaries \({_NUM}\) exceeds available HBM \({_NUM}\)"))


def _bytes(number: str, unit: str) -> float:
  return float(number) * _SIZE[unit]  # XLA's 'G' is 2**30 bytes (16 GiB HBM: '15.75G' usable)


def compiler_need(message: str) -> tuple[float, float] | None:
  """(bytes the program needs, bytes of HBM XLA lets it use) from XLA:TPU's out-of-memory
  message, or None where it has neither wording."""
  for pattern in _NEEDS:
    m = pattern.search(message)
    if m:
      return _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4))
  return None
