"""A step-time estimate from the compiled program's schedule: which collectives its compute
hides and which it waits for. Pure.

XLA's scheduler writes its decision into the optimized program: an async collective is a
start, then the instructions it overlaps, then its done; a synchronous collective stops the
compute until it ends. This walks every scheduled computation (the ENTRY, loop bodies,
branches) in its order with two clocks per chip:
  compute  one instruction after another; each takes max(FLOPs / peak, HBM bytes / HBM
           bandwidth), counted as compute time where FLOPs bind and HBM time where bytes do;
  link     one collective after another (ICI; DCN on a clock of its own): each takes its
           received bytes / the link's rate (`roofline.link_seconds`), from its start or
           when the link frees, whichever is later.
A done waits for its collective's end: the wait is that collective's exposed time (a
synchronous collective is wholly exposed: its link time, plus any wait for the link). A
loop costs its trips times one walk of its body (and condition); a conditional its
longest branch. So

  estimate = compute + HBM-bound time + exposed communication,

each summed over the step's instructions, loops per trip. FLOPs per instruction are XLA's
cost analysis of the computation it runs (a fusion's, `xla_cost.fused_flops`), else its
matmuls' (dots, convolutions) from their shapes; HBM bytes are an
instruction's operands and result (a fused dynamic-slice reads its slice, a fused
dynamic-update-slice writes its update), layout views and control flow none; fused
kernels' traced FLOPs (`kernel_flops`) are spread evenly over their calls. Both are then
scaled to XLA's per-step totals (`flops`, `hbm_bytes`) so that the walk's compute and HBM
sums equal the roofline's; what the shapes cannot place (none of them found) runs after
the schedule. The walk thus never beats the roofline's compute, HBM, ICI or DCN term;
offload and inter-stage transfer terms are not walked, and where one exceeds the walk the
estimate is that term (`roofline_bound`). Async copies (host offload) cost nothing here.
"""
import functools
import math
import re

from spmdtask.plan import hlo, roofline, xla_cost
from spmdtask.plan.chips import Chip

TOP = 5  # the most exposed collectives the plan names
_FREE = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "iota",
         "after-all", "partition-id", "replica-id", "copy-start", "copy-done", "while",
         "conditional", "call", "custom-call-start", "opt-barrier", "add-dependency"}
_LABELS = re.compile(r"dim_labels=\w*_(\w+)->")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_LOW = re.compile(r"^(s8|u8|f8\w*)$")  # int8 / fp8 element types: the quantized matmuls'
_KERNEL = re.compile(r'custom_call_target="(?:tpu_custom_call|__cudnn\$fmha)')


class _Program:
  """The parsed module: computations, their instructions and the shapes they define."""

  def __init__(self, text: str):
    self.comps, self.entry = hlo.computations(text)
    self.instrs = {n: hlo.instructions(lines) for n, lines in self.comps.items()}
    self.shapes = {i.name: i.shape for ins in self.instrs.values() for i in ins}
    self.xla_flops = xla_cost.fused_flops(text)
    self._flops: dict[str, float] = {}
    self._io: dict[str, tuple[dict[int, float], float]] = {}

  def dims(self, name: str) -> tuple[int, ...]:
    return hlo.dims(self.shapes.get(name, ""))

  def flops(self, comp: str) -> float:
    """FLOPs of one run of a computation that runs inside an instruction: XLA's where it
    can analyse it alone, else its matmuls' from their shapes."""
    if comp not in self._flops:
      self._flops[comp] = self.xla_flops.get(comp) if comp in self.xla_flops else sum(
          self.instruction_flops(i) for i in self.instrs.get(comp, ()))
    return self._flops[comp]

  def instruction_flops(self, ins: hlo.Instruction) -> float:
    out = math.prod(hlo.dims(ins.shape))
    if ins.op == "dot" and ins.operands:
      m = _CONTRACT.search(ins.line)
      lhs = self.dims(ins.operands[0])
      k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
      return 2.0 * out * k
    if ins.op == "convolution" and len(ins.operands) > 1:
      rhs, labels = self.dims(ins.operands[1]), _LABELS.search(ins.line)
      o = rhs[labels.group(1).index("o")] if labels and len(rhs) == len(labels.group(1)) else 1
      return 2.0 * out * math.prod(rhs) / max(o, 1)
    return sum(self.flops(c) for c in ins.called)

  def low_kind(self, ins: hlo.Instruction) -> str | None:
    """The operand element type ('s8', 'f8e4m3fn', ...) of an int8 / fp8 matmul that `ins`
    is or runs inside it (a fusion's), else None: what rate its FLOPs are charged at."""
    if ins.op in ("dot", "convolution") and ins.operands:
      kind = self.shapes.get(ins.operands[0], "").split("[")[0]
      return kind if _LOW.match(kind) else None
    return next((k for c in ins.called for i in self.instrs.get(c, ())
                 if (k := self.low_kind(i))), None)

  def _fused_io(self, comp: str) -> tuple[dict[int, float], float]:
    """(parameter number -> bytes read, bytes written) of a fused computation: a parameter
    read only through dynamic-slices (its own, or those of the fusions nested in it, as in
    XLA:TPU's async collective fusions) reads their slices, one updated in place reads none;
    an output made by a dynamic-update-slice writes its update."""
    if comp not in self._io:
      self._io[comp] = self._read_write(comp)
    return self._io[comp]

  def _read_write(self, comp: str) -> tuple[dict[int, float], float]:
    instrs = self.instrs.get(comp, [])
    by_name = {i.name: i for i in instrs}
    params = {i.name: int(re.search(r"parameter\((\d+)\)", i.line).group(1))
              for i in instrs if i.op == "parameter"}
    users: dict[str, list[hlo.Instruction]] = {}
    for i in instrs:
      for o in i.operands:
        users.setdefault(o, []).append(i)
    def sliced(u: hlo.Instruction, name: str) -> float | None:
      """Bytes `u` reads of `name` where it reads a part only (a dynamic-slice, or a nested
      fusion that reads that parameter only through slices), else None."""
      if u.op == "dynamic-slice" and u.operands[0] == name:
        return float(hlo.shape_bytes(u.shape))
      if u.op == "fusion" and u.called:
        inner = self._fused_io(u.called[0])[0]
        parts = [inner.get(j) for j, o in enumerate(u.operands) if o == name]
        return sum(parts) if parts and None not in parts else None
      return None

    reads = {}
    for name, k in params.items():
      use = users.get(name, [])
      parts = [sliced(u, name) for u in use]
      if use and None not in parts:
        reads[k] = float(sum(parts))
      elif any(u.op == "dynamic-update-slice" and u.operands[0] == name for u in use):
        reads[k] = 0.0
    root = next((i for i in reversed(instrs) if i.line.lstrip().startswith("ROOT ")), None)
    outs = ([by_name.get(o) for o in root.operands] if root and root.op == "tuple"
            else [root])
    written = sum(hlo.shape_bytes(self.shapes[o.operands[1]])
                  if o.op == "dynamic-update-slice" and len(o.operands) > 1
                  else hlo.shape_bytes(o.shape) for o in outs if o is not None)
    return reads, float(written)

  def instruction_bytes(self, ins: hlo.Instruction) -> float:
    if ins.op in _FREE:
      return 0.0
    if ins.op == "fusion" and ins.called:
      reads, written = self._fused_io(ins.called[0])
      return written + sum(reads.get(k, hlo.shape_bytes(self.shapes.get(o, "")))
                           for k, o in enumerate(ins.operands))
    return float(hlo.shape_bytes(ins.shape)
                 + sum(hlo.shape_bytes(self.shapes.get(o, "")) for o in ins.operands))

  def kernel_calls(self, ins: hlo.Instruction) -> int:
    return len(_KERNEL.findall(ins.line)) + sum(
        len(_KERNEL.findall(l)) for c in ins.called for l in self.comps.get(c, ()))


def _where(op_name: str, comp: str, trips: dict[str, int]) -> str:
  phase = "backward" if "transpose(" in op_name else "forward"
  return phase + (f", in a loop of {trips[comp]} trips" if comp in trips else "")


def estimate(text: str, chip: Chip, flops: float, hbm_bytes: float, kernel_flops: float = 0.0,
             num_slices: int = 1, roofline_bound: float = 0.0, model_flops: float = 0.0,
             host_of: tuple[int, ...] | None = None) -> dict:
  """The step estimate of a compiled program (its optimized text) on `chip` (module doc):
  `flops` and `hbm_bytes` are XLA's per device per step (kernels' FLOPs included,
  `kernel_flops` of them), `roofline_bound` the roofline's step bound, `model_flops` the
  model formula's per device (for the MFU), `host_of` the host of each device (GPUs:
  collectives across hosts, `roofline.link_seconds`). Returns seconds per step (`step_seconds` =
  compute + hbm + exposed communication, never below `roofline_bound`), the collectives'
  link time, the exposed share, the scales applied to the shapes' FLOPs and bytes, and the
  `TOP` collectives by exposed time per step (kind, result shape, op name, where)."""
  prog = _Program(text)
  mult, colls = hlo.multipliers(text), hlo.scheduled_collectives(text, num_slices, host_of)
  trips = {l.body: l.trips or 1 for l in hlo.loops(text)}
  origins = {c: hlo.async_origins(prog.instrs[c], prog.comps) for c in hlo.scheduled(text)}

  def link_op(comp: str, ins: hlo.Instruction) -> bool:  # on the link clock, not compute
    return ins.name in colls or (hlo.is_async_done(ins, prog.comps)
                                 and origins[comp].get(ins.name, ins.name) in colls)

  # Per-step sums of the shapes' FLOPs, bytes and kernel calls: the scales to XLA's totals.
  shape_f = shape_b = calls = 0.0
  for comp, runs in ((c, mult.get(c, 0)) for c in origins):
    for ins in prog.instrs[comp]:
      if not link_op(comp, ins):
        shape_f += runs * prog.instruction_flops(ins)
        shape_b += runs * prog.instruction_bytes(ins)
        calls += runs * prog.kernel_calls(ins)
  per_call = kernel_flops / calls if calls else 0.0
  matmul = flops - (kernel_flops if calls else 0.0)
  f_scale = matmul / shape_f if shape_f else 0.0
  b_scale = hbm_bytes / shape_b if shape_b else 0.0
  records = []

  @functools.cache
  def walk(comp: str) -> tuple[float, float, float]:
    """(seconds, of them compute-bound, HBM-bound) of one run of a scheduled computation;
    its collectives' exposure is appended to `records` (per run of `comp`)."""
    t = busy_f = busy_b = 0.0
    link_free = {False: 0.0, True: 0.0}
    pending: dict[str, tuple[float, dict]] = {}
    origin = origins[comp]
    for ins in prog.instrs[comp]:
      if ins.op == "while":
        body = re.search(r"body=%([\w.\-]+)", ins.line).group(1)
        cond = re.search(r"condition=%([\w.\-]+)", ins.line).group(1)
        n = trips.get(body, 1)
        parts = [walk(body), walk(cond)]
        t += n * sum(p[0] for p in parts)
        busy_f += n * sum(p[1] for p in parts)
        busy_b += n * sum(p[2] for p in parts)
        continue
      if ins.op == "conditional":
        branches = [walk(b) for b in hlo.branches(ins.line) if b in prog.comps]
        longest = max(branches, default=(0.0, 0.0, 0.0))
        t, busy_f, busy_b = t + longest[0], busy_f + longest[1], busy_b + longest[2]
        continue
      ops = colls.get(ins.name)
      if ops:
        dcn = any(op.dcn for op in ops)
        link = sum(roofline.link_seconds(op, chip) for op in ops)
        begin = max(t, link_free[dcn])
        link_free[dcn] = begin + link
        rec = {"kind": ops[0].kind + (" (dcn)" if dcn else ""), "instruction": ins.name,
               "shape": _result_shape(ins, prog), "link_seconds": link, "computation": comp,
               "op_name": _op_name(ins, prog)}
        if hlo.is_async_start(ins, prog.comps):
          pending[ins.name] = (begin + link, rec)
          continue
        records.append({**rec, "exposed_seconds": begin + link - t, "async": False})
        t = begin + link
        continue
      if link_op(comp, ins):  # a done: the compute waits for its collective
        end, rec = pending.pop(origin[ins.name], (0.0, None))
        if rec is None:
          continue
        records.append({**rec, "exposed_seconds": max(0.0, end - t), "async": True})
        t = max(t, end)
        continue
      f = f_scale * prog.instruction_flops(ins) + per_call * prog.kernel_calls(ins)
      kind = prog.low_kind(ins)
      tf = f / (chip.peak_for(kind) if kind else chip.peak_bf16_flops_per_s)
      tb = b_scale * prog.instruction_bytes(ins) / chip.hbm_bytes_per_s
      t += max(tf, tb)
      busy_f, busy_b = busy_f + (tf if tf >= tb else 0.0), busy_b + (tb if tb > tf else 0.0)
    for end, rec in pending.values():  # a start with no done found: waited for at the end
      records.append({**rec, "exposed_seconds": max(0.0, end - t), "async": True})
      t = max(t, end)
    return t, busy_f, busy_b

  step, busy_f, busy_b = walk(prog.entry) if prog.entry else (0.0, 0.0, 0.0)
  # What the shapes could not place (no matmul or no byte found): after the schedule.
  rest_f = (matmul if not shape_f else 0.0) + (kernel_flops if not calls else 0.0)
  rest = (rest_f / chip.peak_bf16_flops_per_s, (hbm_bytes if not shape_b else 0.0)
          / chip.hbm_bytes_per_s)
  step += max(rest)
  busy_f, busy_b = busy_f + (rest[0] if rest[0] >= rest[1] else 0), busy_b + (
      rest[1] if rest[1] > rest[0] else 0)
  for r in records:
    r["runs"] = mult.get(r["computation"], 1)
    r["where"] = _where(r["op_name"], r["computation"], trips)
  link_total = sum(r["link_seconds"] * r["runs"] for r in records)
  exposed = sum(r["exposed_seconds"] * r["runs"] for r in records)
  top = sorted(records, key=lambda r: -r["exposed_seconds"] * r["runs"])[:TOP]
  out = {"step_seconds": max(step, roofline_bound), "walk_seconds": step,
         "compute_seconds": busy_f, "hbm_seconds": busy_b, "exposed_seconds": exposed,
         "collective_seconds": link_total,
         "exposed_fraction": exposed / link_total if link_total else 0.0,
         "flops_scale": f_scale, "bytes_scale": b_scale,
         "mfu_estimate": (model_flops / (max(step, roofline_bound) * chip.peak_bf16_flops_per_s)
                          if step and model_flops else None),
         "top_exposed": [{"kind": r["kind"], "shape": r["shape"], "op_name": r["op_name"],
                          "where": r["where"], "runs": r["runs"], "async": r["async"],
                          "exposed_seconds_per_step": r["exposed_seconds"] * r["runs"],
                          "link_seconds_per_step": r["link_seconds"] * r["runs"]}
                         for r in top if r["exposed_seconds"] > 0]}
  return out


def _inner_lines(ins: hlo.Instruction, prog: _Program) -> list[str]:
  return [ins.line] + hlo.inner_collectives(ins, prog.comps)


def _result_shape(ins: hlo.Instruction, prog: _Program) -> str:
  found = next(filter(None, map(hlo.collective_result, _inner_lines(ins, prog))), None)
  return found[1] if found else ins.shape


def _op_name(ins: hlo.Instruction, prog: _Program) -> str:
  for line in _inner_lines(ins, prog):
    m = _OP_NAME.search(line)
    if m:
      return m.group(1)
  return ""


def low_precision_flops(text: str) -> dict[str, float]:
  """Per step, the FLOPs (XLA's, as `flops` counts them) of the instructions that are or
  run an int8 / fp8 matmul, by its operand element type, loop bodies weighted by their
  trips (`hlo.multipliers`)."""
  prog, mult = _Program(text), hlo.multipliers(text)
  inner = {c for instrs in prog.instrs.values() for i in instrs for c in i.called}
  out: dict[str, float] = {}
  for comp, instrs in prog.instrs.items():
    if comp in inner:
      continue
    for ins in instrs:
      kind = prog.low_kind(ins)
      if kind:
        out[kind] = out.get(kind, 0.0) + prog.instruction_flops(ins) * mult.get(comp, 1)
  return out
