"""The schedule's step estimate: a collective hidden behind compute costs nothing, one the
compute waits for costs its link time; XLA:TPU's programs with async collectives and with
them forced synchronous."""
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask.plan import chips, overlap, roofline, xla_cost
from tests import subproc

V5E = chips.CHIPS["v5e"]
_DOT = ("  %d = bf16[1024,4096]{1,0} dot(%x, %w), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}\n")


def scheduled(hidden: bool) -> str:
  """An async all-gather (2 MiB result, 4 devices) with a 34 GFLOP matmul scheduled between
  its start and done (`hidden`), or before its start."""
  return ("HloModule m, is_scheduled=true\n\nENTRY %main (p0: bf16[256,1024], x: "
          "bf16[1024,4096], w: bf16[4096,4096]) -> (bf16[1024,1024], bf16[1024,4096]) {\n"
          "  %p0 = bf16[256,1024]{1,0} parameter(0)\n"
          "  %x = bf16[1024,4096]{1,0} parameter(1)\n"
          "  %w = bf16[4096,4096]{1,0} parameter(2)\n"
          + ("" if hidden else _DOT) +
          "  %ags = (bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%p0), "
          "channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true\n"
          + (_DOT if hidden else "") +
          "  %agd = bf16[1024,1024]{1,0} all-gather-done(%ags)\n"
          "  ROOT %t = (bf16[1024,1024]{1,0}, bf16[1024,4096]{1,0}) tuple(%agd, %d)\n}\n")


@pytest.mark.parametrize("hidden", [True, False])
def test_an_all_gather_behind_a_matmul_is_hidden_one_before_it_exposed(hidden):
  text = scheduled(hidden)
  cost = xla_cost.per_step(text)
  bound = roofline.estimate(V5E, cost["flops"], cost["bytes accessed"], 0.0, 0.0, 0.0, 1.0)
  got = overlap.estimate(text, V5E, cost["flops"], cost["bytes accessed"],
                         roofline_bound=bound["step_seconds_lower_bound"])
  link = 3 / 4 * 2 * 1024 * 1024 / V5E.ici_ingress_bytes_per_s  # all but its own quarter
  matmul = 2 * 1024 * 4096 * 4096 / V5E.peak_bf16_flops_per_s  # 174 µs: compute-bound
  assert math.isclose(got["collective_seconds"], link, rel_tol=1e-12)
  assert math.isclose(got["compute_seconds"], matmul, rel_tol=1e-12) and got["hbm_seconds"] == 0
  assert got["exposed_seconds"] == (0.0 if hidden else pytest.approx(link, rel=1e-12))
  assert got["step_seconds"] == pytest.approx(matmul + (0.0 if hidden else link), rel=1e-12)
  assert got["step_seconds"] >= bound["step_seconds_lower_bound"]
  assert [r["kind"] for r in got["top_exposed"]] == ([] if hidden else ["all-gather"])


def test_an_int8_matmul_is_charged_at_the_int8_rate():
  """The same 34 GFLOP matmul with s8 operands (a quantized projection): the roofline and
  the schedule charge it at v5e's 394 TOP/s int8 rate, half the bf16 time, and say so."""
  text = scheduled(True).replace("bf16[1024,4096]{1,0} parameter(1)",
                                 "s8[1024,4096]{1,0} parameter(1)").replace(
      "bf16[4096,4096]{1,0} parameter(2)", "s8[4096,4096]{1,0} parameter(2)").replace(
      "%d = bf16[1024,4096]", "%d = s32[1024,4096]")
  flops = 2 * 1024 * 4096 * 4096
  assert overlap.low_precision_flops(text) == {"s8": flops}
  cost = xla_cost.per_step(text)
  bound = roofline.estimate(V5E, cost["flops"], 0.0, 0.0, 0.0, 0.0, 1.0,
                            low_flops=overlap.low_precision_flops(text))
  assert bound["seconds"]["compute"] == pytest.approx(flops / 394e12, rel=1e-12)
  assert bound["low_precision_flops"] == {"s8": {"flops": flops, "peak": 394e12}}
  got = overlap.estimate(text, V5E, cost["flops"], 0.0)
  assert got["compute_seconds"] == pytest.approx(flops / 394e12, rel=1e-12)
  assert chips.CHIPS["v5e"].peak_for("bf16") == V5E.peak_bf16_flops_per_s
  assert chips.GPUS["h100"].peak_for("f8e4m3fn") == 1979e12
  assert chips.GPUS["h100"].peak_for("s8") == chips.GPUS["h100"].peak_bf16_flops_per_s

# XLA:TPU's own switches for its async collectives (libtpu reads them when it starts).
SYNC = ("--xla_tpu_enable_async_collective_fusion=false --xla_enable_async_all_gather=false "
        "--xla_enable_async_all_reduce=false --xla_enable_async_collective_permute=false "
        "--xla_tpu_enable_async_all_to_all=false --xla_enable_async_reduce_scatter_fusion=false")


def fsdp_stack_estimate() -> dict:
  """The step estimate of a 4-layer FSDP MLP stack's gradient (scanned, 4 chips), compiled by
  XLA:TPU for v5e:2x2 under whatever LIBTPU_INIT_ARGS this process started with."""
  from spmdtask.plan import targets
  mesh = Mesh(np.array(targets.tpu("v5e:2x2").devices), ("fsdp",))

  def loss(ws, x):
    return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)

  step = jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P(None, "fsdp")),
                                               NamedSharding(mesh, P("fsdp"))))
  compiled = step.lower(jax.ShapeDtypeStruct((4, 1024, 1024), jnp.bfloat16),
                        jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)).compile()
  text = compiled.as_text()
  cost = xla_cost.per_step(text)
  return overlap.estimate(text, V5E, cost["flops"], cost["bytes accessed"])


def test_forcing_collectives_synchronous_exposes_their_whole_link_time():
  asynchronous = fsdp_stack_estimate()
  out = subproc.run([sys.executable, "-c", "import json; from tests.plan.test_overlap import "
                     "fsdp_stack_estimate as f; print(json.dumps(f()))"],
                    num_devices=1, timeout=120, LIBTPU_INIT_ARGS=SYNC)
  assert out.returncode == 0, out.stderr[-2000:]
  synchronous = json.loads(out.stdout.splitlines()[-1])
  # The same collectives, the same link time: 4 layers' weights gathered forward and
  # backward, their gradients reduced.
  assert synchronous["collective_seconds"] == pytest.approx(asynchronous["collective_seconds"],
                                                            rel=1e-9)
  link = synchronous["collective_seconds"]
  # Synchronous: the step waits for every byte; its estimate is its compute, HBM and link time.
  assert synchronous["exposed_seconds"] == pytest.approx(link, rel=1e-9)
  assert synchronous["step_seconds"] == pytest.approx(
      synchronous["compute_seconds"] + synchronous["hbm_seconds"] + link, rel=1e-9)
  # Asynchronous: XLA's scheduler hides part of it behind the layers' matmuls.
  assert asynchronous["exposed_seconds"] < 0.8 * link
  assert asynchronous["step_seconds"] == pytest.approx(
      asynchronous["compute_seconds"] + asynchronous["hbm_seconds"]
      + asynchronous["exposed_seconds"], rel=1e-9)


def test_a_fusion_reads_only_the_slice_a_nested_fusion_takes_of_a_stack():
  """XLA:TPU's async collective fusions nest the fusion that dynamic-slices a layer's input
  out of the scanned stack: the outer fusion reads that one slice, not the stack."""
  mib = 2 * 1024 * 1024  # one bf16[1,1024,1024]
  text = (
      "HloModule m, is_scheduled=true\n\n"
      "%inner (p0: bf16[80,1024,1024], p1: s32[]) -> bf16[1,1024,1024] {\n"
      "  %p0 = bf16[80,1024,1024]{2,1,0} parameter(0)\n"
      "  %p1 = s32[] parameter(1)\n"
      "  %z = s32[] constant(0)\n"
      "  ROOT %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), "
      "dynamic_slice_sizes={1,1024,1024}\n}\n\n"
      "%outer (q0: bf16[80,1024,1024], q1: s32[], q2: bf16[1,1024,1024]) -> "
      "bf16[1,1024,1024] {\n"
      "  %q0 = bf16[80,1024,1024]{2,1,0} parameter(0)\n"
      "  %q1 = s32[] parameter(1)\n"
      "  %q2 = bf16[1,1024,1024]{2,1,0} parameter(2)\n"
      "  %f = bf16[1,1024,1024]{2,1,0} fusion(%q0, %q1), kind=kLoop, calls=%inner\n"
      "  ROOT %a = bf16[1,1024,1024]{2,1,0} add(%f, %q2)\n}\n\n"
      "ENTRY %main (s: bf16[80,1024,1024], i: s32[], y: bf16[1,1024,1024]) -> "
      "bf16[1,1024,1024] {\n"
      "  %s = bf16[80,1024,1024]{2,1,0} parameter(0)\n"
      "  %i = s32[] parameter(1)\n"
      "  %y = bf16[1,1024,1024]{2,1,0} parameter(2)\n"
      "  ROOT %o = bf16[1,1024,1024]{2,1,0} fusion(%s, %i, %y), kind=kOutput, calls=%outer\n}\n")
  prog = overlap._Program(text)  # pylint: disable=protected-access
  fused = next(i for i in prog.instrs[prog.entry] if i.op == "fusion")
  # The slice and y read, the sum written, the index's 4 bytes: not the 160 MiB stack.
  assert prog.instruction_bytes(fused) == 3 * mib + 4
