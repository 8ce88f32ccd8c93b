"""The device groups of a collective in optimized HLO text: its size, its members, the hosts
they span. Pure."""
import math
import re

import numpy as np


def group_size(line: str) -> int:
  """Devices per replica group: explicit {{0,1},..}, iota [G,S]<=[N], or mesh[..] {axes}."""
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([^']+)'", m.group(2)))
  return 1


def replica_groups(line: str) -> list[list[int]] | None:
  """The device groups of a collective line (logical ids: positions in the program's device
  assignment): explicit {{0,1},{2,3}}, iota [G,S]<=[dims]T(perm), or mesh['a'=2,'b'=4]
  {'b'}; None for a form not read here (or no groups: one group of all)."""
  m = re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", line)
  if m:
    return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
  if m:
    shape = [int(d) for d in m.group(1).split(",")]
    ids = np.arange(math.prod(shape)).reshape([int(d) for d in m.group(2).split(",")])
    if m.group(3):
      ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    return ids.reshape(-1, shape[-1]).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, inner = [a for a, _ in axes], re.findall(r"'([^']+)'", m.group(2))
    ids = np.arange(math.prod(int(n) for _, n in axes)).reshape([int(n) for _, n in axes])
    order = [names.index(a) for a in names if a not in inner] + [names.index(a) for a in inner]
    return ids.transpose(order).reshape(-1, group_size(line)).tolist()
  return None


def hosts_spanned(line: str, host_of) -> int:
  """The most hosts one group of a collective line spans (1 without `host_of`)."""
  groups = replica_groups(line) if host_of is not None else None
  return max((len({host_of[i] for i in g}) for g in groups or ()), default=1)
