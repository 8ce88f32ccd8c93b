"""V-placement schedules with split backward: ZB-V and DualPipeV, as `schedule.Schedule` data.

Both put two chunks on each of p stages in a V ('v' placement): chunk 0 of stage s is model
part s, chunk 1 is part 2p-1-s, so the last stage runs parts p-1 and p back to back and the
first stage holds both the first and the last part. Backward is split into I (input grads)
and W (weight grads) where the schedule fills a bubble with W.

  zb_v        ZB-V (Qi et al., "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024,
              section 6): warm-up 2(p-s)-1 chunk-0 forwards, then s pairs of (F chunk 1,
              F chunk 0), then p-s rounds of (F, I, W) on chunk 1; the steady state
              alternates (F, I, W) on chunk 0 and chunk 1; the cool-down runs the remaining
              I passes and defers their W passes into the tail. Published (the paper and
              its authors' comparison table): zero bubble with T_F = T_B = T_W, at 1F1B's
              peak activation memory (p sets) on every stage; needs m >= 2p - 1. The
              simulator agrees: no stage idles between its first and last action, makespan
              3m + (p-1)/2 (only the staggered start of a half-stage forward per hop).
  dualpipe_v  DualPipeV (DeepSeek's DualPipe cut in half into a V; published with
              github.com/deepseek-ai/DualPipe, dualpipev.py): eight phases per stage:
              2(p-s-1) F0; s+1 (F0, F1); p-s-1 (I1, W1, F1); m-2p+s+1 (F0, B1, F1, B0)
              [the pairs DualPipe overlaps with each other's communication]; p-s-1
              (B1, F1, B0); s+1 (B1, B0) of which the second half split into I with W
              deferred; p-s-1 (W, I0); s+1 W. Needs m >= 2p. Published (DualPipe README,
              DualPipeV row, PP = 2p stages on p devices, costs per chunk): bubble
              (PP/2 - 1)(F&B + B - 3W), activation PP + 1 chunk-sets. `dualpipe_v_pairs`
              names the overlapped (F, B) pairs; simulated with them coupled
              (`simulate(paired=)`) and F = I = W, stage 0 idles exactly that, p - 1 stage
              units (F&B = F + B); the MPMD runner does not couple them, which only
              shortens the schedule (stage s idles (p-1-s)/2).

In the action names, chunk c of microbatch i is `F<i>.<c>` (schedule.Action).
"""
from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules.schedule import Action, Schedule


class _Row:
  """One stage's list, with per-(kind, chunk) microbatch counters and a FIFO of pending W."""

  def __init__(self):
    self.actions, self.count, self.pending_w, self.pairs = [], {}, [], []

  def pair(self, first: tuple[str, int], second: tuple[str, int]) -> None:
    """Two actions DualPipe overlaps (one's compute with the other's communication)."""
    self.pairs.append(len(self.actions))
    self.add(*first)
    self.add(*second)

  def add(self, kind: str, chunk: int) -> None:
    key = ("B" if kind == "I" else kind, chunk)  # I and B share one backward counter
    i = self.count.get(key, 0)
    self.count[key] = i + 1
    self.actions.append(Action(kind, i, chunk))
    if kind == "I":
      self.pending_w.append((i, chunk))

  def weight(self) -> None:
    """The oldest pending W (FIFO, as the published schedules run them)."""
    i, chunk = self.pending_w.pop(0)
    self.actions.append(Action("W", i, chunk))


def _check(name: str, p: int, m: int, least: int) -> None:
  if m < least:
    raise ConfigError(f"{name} needs at least {least} microbatches for {p} stages (its "
                      f"warm-up alone runs that many chunk-0 forwards on stage 0), got {m}.")


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
  p, m = num_stages, num_microbatches
  _check("zb_v", p, m, 2 * p - 1)
  rows = []
  for s in range(p):
    r = _Row()
    for _ in range(2 * (p - s) - 1):
      r.add("F", 0)
    for _ in range(s):
      r.add("F", 1)
      r.add("F", 0)
    for _ in range(p - s):
      r.add("F", 1)
      r.add("I", 1)
      r.weight()
    while r.count.get(("F", 1), 0) < m:
      if r.count.get(("F", 0), 0) < m:
        r.add("F", 0)
      r.add("I", 0)
      r.weight()
      r.add("F", 1)
      r.add("I", 1)
      r.weight()
    # Cool-down: the remaining I passes first (they are on the critical path back to stage
    # 0); their W passes fill the tail.
    for _ in range(s):
      r.add("I", 0)
      r.add("I", 1)
    for _ in range(p - s):
      r.add("I", 0)
      r.weight()
    while r.pending_w:
      r.weight()
    rows.append(tuple(r.actions))
  return Schedule(p, m, tuple(rows), num_chunks=2, placement="v")


def dualpipe_v(num_stages: int, num_microbatches: int) -> Schedule:
  return _dualpipe_v(num_stages, num_microbatches)[0]


def dualpipe_v_pairs(num_stages: int, num_microbatches: int) -> frozenset[tuple[int, int]]:
  """(stage, position) of each F whose next action (a B) DualPipeV runs overlapped with it:
  the pair starts once both inputs exist (`simulate(..., paired=)`)."""
  return _dualpipe_v(num_stages, num_microbatches)[1]


def _dualpipe_v(p: int, m: int) -> tuple[Schedule, frozenset[tuple[int, int]]]:
  _check("dualpipe_v", p, m, 2 * p)
  rows, pairs = [], set()
  for s in range(p):
    r = _Row()
    for _ in range(2 * (p - s - 1)):          # 1: nF0
      r.add("F", 0)
    for _ in range(s + 1):                    # 2: nF0F1
      r.add("F", 0)
      r.add("F", 1)
    for _ in range(p - s - 1):                # 3: nB1W1F1, split backward
      r.add("I", 1)
      r.weight()
      r.add("F", 1)
    for i in range(m - 2 * p + s + 1):        # 4: nF0B1F1B0, overlapped pairs
      if i == 0 and s == p - 1:               # (the turn of the V runs F0 then B1 plainly)
        r.add("F", 0)
        r.add("B", 1)
      else:
        r.pair(("F", 0), ("B", 1))
      r.pair(("F", 1), ("B", 0))
    for _ in range(p - s - 1):                # 5: nB1F1B0
      r.add("B", 1)
      r.pair(("F", 1), ("B", 0))
    split = False                             # 6: nB1B0, the second half split
    for i in range(s + 1):
      if i == (s + 1) // 2 and s % 2 == 1:
        split = True
      r.add("I" if split else "B", 1)
      if i == (s + 1) // 2 and s % 2 == 0:
        split = True
      r.add("I" if split else "B", 0)
    for _ in range(p - s - 1):                # 7: nWB0, split backward
      r.weight()
      r.add("I", 0)
    while r.pending_w:                        # 8: nW
      r.weight()
    rows.append(tuple(r.actions))
    pairs.update((s, i) for i in r.pairs)
  return Schedule(p, m, tuple(rows), num_chunks=2, placement="v"), frozenset(pairs)
