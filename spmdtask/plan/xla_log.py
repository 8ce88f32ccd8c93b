"""Reading what XLA printed while it compiled a program: its warnings the plan names. Pure."""
import re

_REMAT = re.compile(r"Involuntary full rematerialization.*?from sharding (\{.*?\}) to (\{.*?\}) "
                    r"efficiently for HLO operation %([\w.\-]+) = (\S+) ")


def remat_warnings(log_text: str) -> list[dict[str, str]]:
  """XLA's 'involuntary full rematerialization' messages: op, its shape, the two shardings."""
  return [{"op": op, "shape": shape, "from": src, "to": dst}
          for src, dst, op, shape in _REMAT.findall(log_text)]
