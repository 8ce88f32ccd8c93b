"""--mode=plan for TPU topologies: XLA:TPU compiles on this CPU machine (libtpu), the
roofline estimate, per-step costs with loop trips, DCN across slices, missing libtpu."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask.core import memory, program as program_lib
from spmdtask.plan import (advice, chips, flops, hlo, planner, printout, stage_roofline,
                           targets, xla_cost)
from spmdtask.errors import ConfigError, PlanExceeded
from tests import subproc, util

FSDP4 = ["task.ici_mesh_shape=(1, 4, 1)"]


@pytest.fixture(scope="session")
def tinylm_v5e(tmp_path_factory):
  out = tmp_path_factory.mktemp("v5e")
  run = util.build_run("lm.TinyLm", FSDP4)
  return planner.run_plan(run, str(out), "lm.TinyLm", topology="v5e:2x2"), out


def test_tinylm_on_v5e_2x2(tinylm_v5e):
  got, out = tinylm_v5e
  assert json.loads((out / "plan.json").read_text())["estimate"] == got["estimate"]
  # What libtpu prints goes to the log (test_exit_4_and_a_clean_console: its first start in
  # a fresh process; here another test may have started it in this worker already).
  assert (out / "logs" / "plan_xla.log").is_file()
  t = got["target"]
  assert (t["platform"], t["topology"], t["chips"], t["device_kind"]) == (
      "tpu", "v5e:2x2", 4, "TPU v5 lite")
  chip = chips.CHIPS["v5e"]
  assert t["chip"] == chip.as_json() and chip.hbm_bytes == 16 * 2**30
  assert got["mesh"] == {"data": 1, "fsdp": 4, "model": 1}
  assert 0 < got["compiled"]["peak_estimate_bytes"] < chip.hbm_bytes
  # FSDP: weights gathered for use, gradients reduced; scanned layers count per trip.
  assert got["collectives"]["all-gather"]["count"] >= 4
  est = got["estimate"]
  secs = est["seconds"]
  assert est["bound"] == max(secs, key=secs.get)
  assert est["step_seconds_lower_bound"] == max(secs.values())
  per_chip = got["flops_per_step"]["xla_per_device"]
  assert math.isclose(secs["compute"], per_chip / chip.peak_bf16_flops_per_s)
  assert math.isclose(secs["hbm"], got["hbm_bytes_per_step_per_device"] / chip.hbm_bytes_per_s)
  assert math.isclose(secs["ici"], got["collective_bytes_received_per_device"]["ici"]
                      / (chip.ici_bidirectional_bytes_per_s / 2))
  model = got["flops_per_step"]["model"]
  assert math.isclose(est["mfu_upper_bound"],
                      model / 4 / (est["step_seconds_lower_bound"] * chip.peak_bf16_flops_per_s))
  assert math.isclose(est["tokens_per_second_upper_bound"],
                      16 * 64 / est["step_seconds_lower_bound"])
  # XLA's FLOPs with the 4 scanned layers counted per trip cover the model's formula
  # (plus what the formula leaves out); counted once they do not.
  assert model <= got["flops_per_step"]["xla"] <= 1.5 * model
  assert got["flops_per_step"]["xla_loop_bodies_once"] < model
  assert [l["trips"] for l in got["loops"]].count(4) >= 2  # forward and backward scans
  # The schedule's estimate (plan.overlap) sits on the roofline, its line beside it.
  step = got["step_estimate"]
  assert step["step_seconds"] >= est["step_seconds_lower_bound"]
  assert math.isclose(step["collective_seconds"], secs["ici"])
  assert 0 < step["exposed_seconds"] <= step["collective_seconds"]
  assert all(r["what"] and r["where"] for r in step["top_exposed"])
  assert any(l.startswith("step ~ ") and "exposed communication" in l
             for l in printout.format_plan(got))


def _stack(unroll):
  def f(w, x):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w, unroll=unroll)[0].sum()
  return f


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_per_step_cost_counts_each_trip(platform):
  """A scanned 6-layer stack costs what the unrolled stack does (XLA's own count)."""
  devices = jax.devices()[:4] if platform == "cpu" else targets.tpu("v5e:2x2").devices
  # Each backend's native matmul type: XLA:TPU would convert f32 weights to bf16 first
  # (work the unrolled program fuses away).
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  mesh = Mesh(np.asarray(devices), ("fsdp",))
  w = jax.ShapeDtypeStruct((6, 256, 256), dtype, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((32, 256), dtype, sharding=NamedSharding(mesh, P("fsdp")))
  looped = jax.jit(_stack(1)).lower(w, x).compile()
  unrolled = jax.jit(_stack(True)).lower(w, x).compile()
  text = looped.as_text()
  assert [l.trips for l in hlo.loops(text)] == [6]
  per_step = xla_cost.per_step(text)["flops"]
  expected = xla_cost.per_step(unrolled.as_text())["flops"]
  assert abs(per_step - expected) / expected < 0.02, (per_step, expected)
  once = looped.cost_analysis()
  once = once[0] if isinstance(once, list) else once
  assert per_step > 4 * float(once["flops"])  # XLA's own count: the body once


def test_plan_over_two_slices_has_dcn_collectives(tmp_path):
  run = util.build_run("lm.TinyLm", ["task.ici_mesh_shape=(1, 4, 1)",
                                     "task.dcn_mesh_shape=(2, 1, 1)"])
  got = planner.run_plan(run, str(tmp_path), "lm.TinyLm", topology="v5e:2x2", num_slices=2)
  assert got["target"]["num_slices"] == 2 and got["target"]["chips"] == 8
  assert got["mesh"] == {"data": 2, "fsdp": 4, "model": 1}
  # Data parallel across slices: the gradients are all-reduced over DCN.
  assert got["collectives"]["all-reduce (dcn)"]["bytes"] > 0
  assert got["collective_bytes_received_per_device"]["dcn"] > 0
  assert got["estimate"]["seconds"]["dcn"] > 0
  with pytest.raises(ConfigError, match="task.dcn_mesh_shape"):
    planner.run_plan(util.build_run("lm.TinyLm", FSDP4), str(tmp_path), "lm.TinyLm",
                  topology="v5e:2x2", num_slices=2)


def test_mpmd_plan_on_v5e_compiles_every_stage_program(tmp_path):
  # The pipeline is built compile-only on the topology's chips (nothing placed there);
  # each stage's programs compile for XLA:TPU, its gradient reduction among them.
  got = planner.run_plan(util.build_run("lm.TinyLmMpmd"), str(tmp_path), "lm.TinyLmMpmd",
                      topology="v5e:2x4")
  programs = {p["name"]: p for p in got["programs"]}
  assert {p["devices"] for p in programs.values()} == {4}
  assert programs["stage 1 gradient reduction"]["compiled"]["peak_estimate_bytes"] > 0
  stages, f, est = got["stage_plans"], got["flops_per_step"], got["estimate"]
  assert [st["stage"] for st in stages] == [0, 1]
  # Every stage program's schedule walked; the busiest stage's sum is at least its roofline.
  sched = got["step_estimate"]
  assert sched["step_seconds"] >= stages[sched["stage"]]["busy_seconds"] * (1 - 1e-9)
  assert sched["step_seconds"] == pytest.approx(
      sched["compute_seconds"] + sched["hbm_seconds"] + sched["exposed_seconds"], rel=1e-9)
  assert all(st["flops_per_step"] > 0 for st in stages)
  # The step's bound: the busiest stage's busy time; the MFU ceiling over all 8 chips.
  assert sum(st["flops_per_step"] for st in stages) == pytest.approx(f["xla"], rel=1e-12)
  assert est["step_seconds_lower_bound"] == max(st["busy_seconds"] for st in stages)
  assert 0 < est["mfu_upper_bound"] < 1
  assert abs(est["mfu_upper_bound"] - f["model"] / (
      est["step_seconds_lower_bound"] * chips.CHIPS["v5e"].peak_bf16_flops_per_s * 8)) < 1e-9


def test_mpmd_part_programs_count_their_pallas_kernels():
  """A part's forward and backward with splash attention, compiled by XLA:TPU: its cost
  analysis counts none of the kernels' FLOPs; `stage_roofline.measure` adds those traced
  from the part's jitted function and abstract args (the plan's per-stage FLOPs)."""
  run = util.build_run("lm.TinyLmMpmd", ["datasets['train'].seq_len=128",
                                         "task.model.attention_impl='splash'",
                                         "task.pipeline.submesh_shapes=((1, 4, 1), (1, 4, 1))"])
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example, devices=list(targets.tpu("v5e:2x4").devices))
  parts = [lw for lw in program.lowerings(example) if lw.stage == 0 and lw.fn is not None]
  assert [lw.name for lw in parts] == ["stage 0 part 0 forward", "stage 0 part 0 backward"]
  traced = []
  for lw in parts:
    compiled = lw.lower().compile()
    text = compiled.as_text()
    with jax.set_mesh(lw.mesh):
      traced.append(flops.traced_flops(lw.fn, *lw.args, kernels_only=True))
    got = stage_roofline.measure(lw, compiled)
    assert hlo.kernel_calls(text) > 0 and got.calls_per_step == 4
    assert got.kernel_flops == traced[-1] / 4
    assert got.flops == xla_cost.per_step(text)["flops"] + traced[-1] / 4
  # Layer 0's attention over a microbatch of 4 rows x 128 tokens, 4 heads of 32: the forward
  # kernel's 2 matmuls over its one (causal, partly masked) block of 128 x 128; the
  # backward recomputes the forward (full remat) and runs 7 more in its dq and dkv kernels.
  forward = 2 * 2 * 4 * 128 * 128 * 4 * 32
  assert traced == [forward, forward + 3.5 * forward]


def test_compute_bound_counts_pallas_kernels():
  """XLA's cost analysis sees none of a Pallas kernel's FLOPs: the plan adds the traced ones,
  and the MFU ceiling is the model's FLOPs over that bound."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] @ y_ref[...]

  def step(x, y):  # a [256, 256] @ [256, 256] kernel in 4 blocks, then a plain matmul
    z = pl.pallas_call(kernel, grid=(2, 2),
                       in_specs=[pl.BlockSpec((128, 256), lambda i, j: (i, 0)),
                                 pl.BlockSpec((256, 128), lambda i, j: (0, j))],
                       out_specs=pl.BlockSpec((128, 128), lambda i, j: (i, j)),
                       out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32))(x, y)
    return z @ y

  target = targets.tpu("v5e:2x2")
  one = NamedSharding(Mesh(np.array(target.devices[:1]), ("x",)), P())
  arg = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=one)
  compiled = jax.jit(step).lower(arg, arg).compile()
  kernel_flops = flops.traced_flops(step, arg, arg, kernels_only=True)
  assert kernel_flops == 2 * 256**3
  blind = planner.compiled_report(compiled, target, 1, 4 * 256**3, 256)
  assert any("fused kernel call(s) (Pallas" in w for w in blind["warnings"])
  got = planner.compiled_report(compiled, target, 1, 4 * 256**3, 256, kernel_flops)
  xla_alone = blind["flops_per_step"]["xla_per_device"]
  assert xla_alone == pytest.approx(2 * 256**3, rel=0.01)  # the plain matmul only
  assert got["flops_per_step"]["xla_per_device"] == xla_alone + kernel_flops
  assert not any("model formula" in w for w in got["warnings"])
  assert any("as if no block were skipped" in w and "up to 25% high" in w for w in got["warnings"])
  chip, est = target.chip, got["estimate"]
  assert est["seconds"]["compute"] == pytest.approx(4 * 256**3 / chip.peak_bf16_flops_per_s,
                                                    rel=0.01)
  assert est["mfu_upper_bound"] == pytest.approx(
      4 * 256**3 / (est["step_seconds_lower_bound"] * chip.peak_bf16_flops_per_s))


def test_out_of_hbm_names_the_largest_arrays(tmp_path):
  # d_ff 2^21: 4 layers x 2 x 128 x 2^21 fp32 weights (8 GiB), replicated, plus Adam:
  # XLA:TPU itself refuses to compile more than the chip's HBM.
  run = util.build_run("lm.TinyLm", ["task.model.d_ff=2097152"])
  with pytest.raises(PlanExceeded, match="XLA refused.*exceeds available HBM \\(15.75G\\)\\. What fills the chip: "
                     "temporaries.*GiB.*state 36.0 GiB.*each alone.*mlp/w.*more devices"):
    planner.run_plan(run, str(tmp_path), "lm.TinyLm", topology="v5e:2x2")
  on_disk = json.loads((tmp_path / "plan.json").read_text())
  assert "exceeds available HBM" in on_disk["compiler_out_of_memory"]
  assert on_disk["params_bytes_per_device"] > 8 * 2**30


def test_bad_topology_names_the_flag():
  with pytest.raises(ConfigError, match="--plan_topology=v9x:2x2"):
    targets.tpu("v9x:2x2")
  with pytest.raises(ConfigError, match="libtpu refused"):
    targets.tpu("v5e:3x5")


def test_exit_4_and_a_clean_console(tmp_path):
  out = subproc.run(subproc.main_cmd(
      "lm.TinyLm", str(tmp_path), *FSDP4,
      flags=["--mode=plan", "--plan_topology=v5e:2x2", "--device_memory_gib=0.001"]),
      num_devices=1, timeout=180)
  assert out.returncode == 4, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  for noise in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "jellyfish"):
    assert noise not in out.stderr + out.stdout
  assert "TPU_WORKER_HOSTNAMES" in (tmp_path / "logs" / "plan_xla.log").read_text()
  assert "bound by" in out.stdout and "v5e:2x2 (4 TPU v5 lite chips)" in out.stdout
  err = [l for l in out.stderr.splitlines() if l.startswith("spmdtask: plan:")]
  assert len(err) == 1 and "--device_memory_gib=0.001" in err[0]


# Runs spmdtask.main in a process where `import libtpu` fails, as it does without it.
WITHOUT_LIBTPU = """
import sys
class NoLibtpu:
  def find_spec(self, name, path=None, target=None):
    if name == "libtpu" or name.startswith("libtpu."):
      raise ModuleNotFoundError("No module named 'libtpu'", name=name)
sys.meta_path.insert(0, NoLibtpu())
from absl import app
from spmdtask import main
sys.argv = ["spmdtask.main"] + sys.argv[1:]
app.run(main.main)
"""


def test_without_libtpu_exit_2_with_the_pip_line(tmp_path):
  cmd = subproc.main_cmd("lm.TinyLm", str(tmp_path), flags=["--mode=plan",
                                                           "--plan_topology=v5e:2x2"])
  out = subproc.run([cmd[0], "-c", WITHOUT_LIBTPU] + cmd[3:], num_devices=1, timeout=120)
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  assert "pip install 'spmdtask[tpu]'" in out.stderr and "libtpu" in out.stderr


def test_gpu_plan_without_a_gpu(tmp_path):
  """XLA:GPU compiles for 8 H100s from XLA's description of the device (needs only JAX's
  CUDA plugin and cuDNN, no GPU or other CUDA library): `pip install 'spmdtask[gpu_plan]'`."""
  pytest.importorskip("jax_plugins.xla_cuda12")
  run = util.build_run("lm.TinyLm", ["task.ici_mesh_shape=(1, 8, 1)"])
  got = planner.run_plan(run, str(tmp_path), "lm.TinyLm", topology="h100:8")
  assert (got["target"]["platform"], got["target"]["chips"]) == ("gpu", 8)
  assert got["target"]["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert 0 < got["compiled"]["peak_estimate_bytes"] < chips.GPUS["h100"].hbm_bytes
  model = got["flops_per_step"]["model"]
  assert model <= got["flops_per_step"]["xla"] <= 1.5 * model
  est = got["estimate"]
  assert est["step_seconds_lower_bound"] == max(est["seconds"].values())
  assert sum(c["count"] for c in got["collectives"].values()) > 0


def test_the_shipped_8b_lora_layout_on_v5e_2x4_warns_of_nothing():
  # The 7 warnings were its replicated adapters: now one line (no compile needed).
  run = util.build_run("finetune.Llama31_8B_Lora")
  target = targets.tpu("v5e:2x4")
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example, devices=list(target.devices))
  mesh = {a: int(s) for a, s in program.mesh.shape.items()}
  rows = memory.state_rows(program.layout, mesh)
  assert advice.warnings(rows, mesh, [], (8, 2048)) == []
  adapters = advice.replicated_adapters(rows, mesh)
  mib = 2**20  # k, v: 2 MiB; q, o: 8; wi, wg, wo: 28 (f32 [32, 16, out] or [32, in, 16])
  assert adapters == {"arrays": 7, "of": 14, "params_bytes_per_device": 104 * mib,
                      "opt_state_bytes_per_device": 208 * mib}
  assert printout.adapters_line(adapters) == (
      "LoRA adapters: 7 of 14 held whole on every device (an adapter is split as the dims of "
      "its base weight it keeps): 104.0 MiB per device, with their optimizer state 208.0 MiB")
