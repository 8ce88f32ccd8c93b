"""--mode=plan: its per-device state bytes equal what a real run allocates; 64 devices; budget."""
import json
import math
import types

import jax
import numpy as np

from spmdtask.plan import (advice, chips, hlo, oom, planner, printout, roofline, targets,
                           xla_log)
from spmdtask.core import memory
from tests import subproc, util


def allocated_bytes_per_device(state) -> dict:
  """Device -> bytes of the shards of `state` that live on it (the test oracle)."""
  out = {}
  for leaf in jax.tree.leaves(state):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def test_plan_bytes_equal_a_real_runs_arrays(tmp_path):
  run = util.build_run("lm.TinyLmFsdp")
  got = planner.run_plan(run, str(tmp_path), "lm.TinyLmFsdp")
  on_disk = json.loads((tmp_path / "plan.json").read_text())
  for key in ("num_devices", "state_bytes_total", "state_bytes_per_device", "compiled",
              "flops_per_step", "arrays"):
    assert key in on_disk
  assert on_disk["num_devices"] == 8
  per_device = got["params_bytes_per_device"] + got["opt_state_bytes_per_device"]
  total = got["params_bytes_total"] + got["opt_state_bytes_total"]
  assert abs(per_device - total / 8) / (total / 8) < 0.02, (per_device, total / 8)
  program, state = util.program_and_state("lm.TinyLmFsdp", 8)
  allocated = allocated_bytes_per_device(state)
  assert sorted(set(allocated.values())) == [got["state_bytes_per_device"]]
  # The compiled step's arguments are that state plus this device's batch rows.
  batch_bytes = sum(np.asarray(x).nbytes for x in run.datasets["train"].batch_at(0).values()) // 8
  assert got["compiled"]["argument_size_in_bytes"] == got["state_bytes_per_device"] + batch_bytes
  # FSDP over 8: gathers in the forward / backward, reductions of the gradients.
  assert got["collectives"]["all-gather"]["count"] > 0
  assert got["flops_per_step"]["model"] == program.work.train_flops * 16
  compiled_line = next(l for l in printout.format_plan(got) if l.startswith("compiled step"))
  assert compiled_line.endswith("(XLA:CPU's figures, not a TPU's or GPU's: --plan_topology "
                                "compiles for the chip)")


def test_64_device_plan_and_memory_budget(tmp_path):
  out = subproc.run(subproc.main_cmd(
      "lm.TinyLmFsdpTp", str(tmp_path), "task.ici_mesh_shape=(1, 8, 8)",
      flags=["--mode=plan", "--plan_devices=64", "--device_memory_gib=0.001"]),
      num_devices=1, timeout=120)
  assert out.returncode == 4, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  plan_json = json.loads((tmp_path / "plan.json").read_text())
  assert plan_json["num_devices"] == 64 and plan_json["mesh"] == {"data": 1, "fsdp": 8, "model": 8}
  # q [L, d, heads 4, hd] has its heads padded to the 8-way model axis: named.
  assert any("params/layers/block/attn/q is padded" in w for w in plan_json["warnings"])
  err = [l for l in out.stderr.splitlines() if l.startswith("spmdtask: plan:")]
  assert len(err) == 1 and "--device_memory_gib=0.001" in err[0]
  assert "What fills the chip: temporaries" in err[0] and "the temporaries alone over" in err[0]
  assert "a chip with more" not in err[0]  # a CPU plan under a budget: no chip to swap


HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %x), dimensions={0}
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %a), to_apply=%add
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, """ \
  """backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_collectives_count_loop_bodies_per_trip():
  assert hlo.collectives(HLO) == {"all-reduce": {"count": 1, "bytes": 32},
                                  "all-gather": {"count": 3, "bytes": 3 * 128}}


# XLA:TPU's forms: a loop body whose all-reduce (channel 5) also runs once in a layer peeled
# out of the loop (same id, in ENTRY), two same-shape all-reduces sharing channel 9 in the body
# (two ops: XLA:TPU gave Mixtral's expert gradients such pairs), an async all-gather cloned
# into its start, continuation (with a matmul fused in) and done fusions (one op, channel 7),
# and channel 3 reused in ENTRY by two different all-reduces.
TPU_HLO = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%ag_start (p0: bf16[1,128,512]) -> (bf16[1,128,512], bf16[1,512,512], u32[]) {
  %all-gather.1 = bf16[1,512,512]{2,1,0:T(8,128)(2,1)S(1)} all-gather(%p0), channel_id=7, """ \
  """replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}
  ROOT %cc = (bf16[1,128,512], bf16[1,512,512], u32[]) custom-call(%all-gather.1), """ \
  """custom_call_target="AsyncCollectiveStart"
}

%ag_more (p0: bf16[1,128,512], p1: bf16[1,512,512], p2: u32[], x: bf16[64,512]) -> """ \
  """(bf16[64,64], bf16[1,128,512], bf16[1,512,512], u32[]) {
  %dot.1 = bf16[64,64]{1,0} convolution(%x, %x), dim_labels=bf_oi->bf
  %all-gather.3 = bf16[1,512,512]{2,1,0} all-gather(%p0), channel_id=7, """ \
  """replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}
  ROOT %t = (bf16[64,64], bf16[1,128,512], bf16[1,512,512], u32[]) tuple(%dot.1, %p0, """ \
  """%all-gather.3, %p2)
}

%ag_done (p1: bf16[1,128,512], p2: bf16[1,512,512]) -> bf16[1,512,512] {
  %all-gather.2 = bf16[1,512,512]{2,1,0:T(8,128)(2,1)} all-gather(%p1), channel_id=7, """ \
  """replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={1}
  ROOT %cc = bf16[1,512,512]{2,1,0} custom-call(%p1, %p2, %all-gather.2), """ \
  """custom_call_target="AsyncCollectiveDone"
}

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %g = f32[1024]{0} get-tuple-element(%p), index=1
  %ar.5 = f32[1024]{0} all-reduce(%g), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%add
  %psum.27 = f32[1024]{0} all-reduce(%g), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%add
  %psum.28 = f32[1024]{0} all-reduce(%g), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%add
  %async-collective-start = (bf16[1,128,512], bf16[1,512,512], u32[]) fusion(%w), """ \
  """kind=kCustom, calls=%ag_start
  %s0 = bf16[1,128,512] get-tuple-element(%async-collective-start), index=0
  %s1 = bf16[1,512,512] get-tuple-element(%async-collective-start), index=1
  %s2 = u32[] get-tuple-element(%async-collective-start), index=2
  %more = (bf16[64,64], bf16[1,128,512], bf16[1,512,512], u32[]) fusion(%s0, %s1, %s2, %x), """ \
  """kind=kCustom, calls=%ag_more
  %m1 = bf16[1,128,512] get-tuple-element(%more), index=1
  %m2 = bf16[1,512,512] get-tuple-element(%more), index=2
  %async-collective-done = bf16[1,512,512]{2,1,0} fusion(%m1, %m2), kind=kCustom, calls=%ag_done
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %zero = s32[] constant(1)
  %t = (s32[], f32[1024]) tuple(%zero, %a)
  %w = (s32[], f32[1024]) while(%t), condition=%cond, body=%body
  %peeled = f32[1024]{0} all-reduce(%a), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%add
  %ar.3a = f32[16]{0} all-reduce(%a), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  %ar.3b = f32[256]{0} all-reduce(%a), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
}
"""


def test_collectives_are_counted_by_instruction():
  # 7 trips (i from 1 to 8) of the body's three all-reduces (the two channel-9 ones both)
  # and its all-gather (start, continuation and done: one op); the peeled layer's
  # all-reduce once more; both channel-3 all-reduces once.
  assert hlo.collectives(TPU_HLO) == {
      "all-reduce": {"count": 7 * 3 + 1 + 2, "bytes": 7 * 3 * 4096 + 4096 + 64 + 1024},
      "all-gather": {"count": 7, "bytes": 7 * 2 * 512 * 512}}
  assert sorted(hlo.scheduled_collectives(TPU_HLO)) == [
      "ar.3a", "ar.3b", "ar.5", "async-collective-start", "peeled", "psum.27", "psum.28"]


# XLA:GPU's async forms: a start's shape holds its operands beside its results (`(operand,
# result)`; combined: `((operands), (results))`; a reduce-scatter's `((operand), result)`);
# an all-reduce-start's is its result. Each counts its results only.
GPU_HLO = """HloModule m

ENTRY %main (a: bf16[8192,4000]) -> bf16[128,4000] {
  %ag = (bf16[128,4000]{1,0}, bf16[8192,4000]{1,0}) all-gather-start(%a), channel_id=1, """ \
  """replica_groups={{0,1}}, dimensions={0}
  %agc = ((bf16[64,8]{1,0}, bf16[64,16]{1,0}), (bf16[128,8]{1,0}, bf16[128,16]{1,0})) """ \
  """all-gather-start(%a, %a), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %rs = ((bf16[8192,4000]{1,0}), bf16[128,4000]{1,0}) reduce-scatter-start(%a), channel_id=3, """ \
  """replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  %ar = f32[1024]{0} all-reduce-start(%a), channel_id=4, replica_groups={{0,1}}, to_apply=%add
  %cp = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%a), channel_id=5, """ \
  """source_target_pairs={{0,1},{1,0}}
}
"""


def test_async_collectives_count_their_results_not_their_operands():
  assert hlo.collectives(GPU_HLO) == {
      "all-gather": {"count": 2, "bytes": 2 * 8192 * 4000 + 2 * 128 * 24},
      "reduce-scatter": {"count": 1, "bytes": 2 * 128 * 4000},
      "all-reduce": {"count": 1, "bytes": 4 * 1024},
      "collective-permute": {"count": 1, "bytes": 4 * 16}}


# XLA:TPU's (AOT, v5p:2x2x1) exchanges of a dropless MoE's tokens: a ragged all-to-all
# into a receive buffer, then a plain one; one channel id for both (told apart by kind).
A2A_HLO = """HloModule m

ENTRY %main (a: bf16[8,2,128]) -> bf16[4,2,128] {
  %ragged = bf16[8,2,128]{2,1,0:T(2,128)(2,1)} ragged-all-to-all(%a, %b, %c, %d, %e, """ \
  """/*index=5*/%d), channel_id=1, replica_groups={{0,1,2,3}}
  %a2a = bf16[4,2,128]{2,1,0:T(2,128)(2,1)} all-to-all(%x), channel_id=1, """ \
  """replica_groups={{0,1,2,3}}, dimensions={0}
}
"""


def test_ragged_all_to_all_is_a_collective_of_its_own():
  assert hlo.collectives(A2A_HLO) == {"ragged-all-to-all": {"count": 1, "bytes": 2 * 8 * 2 * 128},
                                      "all-to-all": {"count": 1, "bytes": 2 * 4 * 2 * 128}}


def test_remat_warning_names_the_param_of_that_shape():
  log = ("W spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The compiler "
         "cannot go from sharding {devices=[2,4]<=[8]} to {devices=[8,1]<=[8]} efficiently for "
         "HLO operation %copy.3 = f32[256,128]{1,0} copy(%p), sharding={...}. As the last")
  program, _ = util.program_and_state("lm.TinyLm", 8)
  rows = memory.state_rows(program.layout, dict(program.mesh.shape))
  (w,) = advice.warnings(rows, dict(program.mesh.shape), xla_log.remat_warnings(log), (16, 64))
  assert "param params/embedding" in w and "%copy.3" in w


def test_a_replicated_param_is_named_when_splitting_it_would_save_a_share_of_the_state():
  """FSDP over 8: a replicated 2.5 MiB norm beside 8.8 GiB of split weights is not worth a
  line (under 1% of the state a device holds); a replicated 512 MiB embedding is."""
  def row(path, shape, shards, spec):
    total = 4 * math.prod(shape)
    return memory.ArrayRow(f"params/{path}", "params", shape, shape, "float32", spec, total,
                           total // shards, shards)
  split = row("layers/wi", (80, 8192, 28672), 8, (None, "fsdp", None))  # 8.8 GiB a device
  norm = row("layers/norm", (80, 8192), 1, (None, None))
  embedding = row("embedding", (16384, 8192), 1, (None, None))
  mesh = {"fsdp": 8}
  assert advice.warnings([split, norm], mesh, [], (8, 2048)) == []
  (w,) = advice.warnings([split, norm, embedding], mesh, [], (8, 2048))
  assert w.startswith("params/embedding [16384, 8192] (512.0 MiB) is replicated on all 8")


def test_out_of_memory_paragraph_names_the_temporaries_and_the_fixes_that_apply():
  # XLA:TPU's line for a step whose temporaries do not fit; 8 rows per device at once.
  line = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
          "temporaries (21.60G) exceeds available HBM (15.75G).")
  plan = {"state_bytes_per_device": 3 * 2**30, "params_bytes_per_device": 2**30,
          "opt_state_bytes_per_device": 2 * 2**30, "arrays": [],
          **planner.out_of_memory_report(line)}
  plan["target"] = {"chip": chips.CHIPS["v5e"].as_json()}
  task = util.build_run("lm.TinyLm", ["task.model.loss_vocab_tiles=1",
                                      "task.model.remat_policy='minimal'"]).task
  text = oom.paragraph(plan, task, 16e9, "HBM", 8, (64, 1024))
  assert text.count(line.rstrip(".")) == 1  # the compiler's line once
  assert "temporaries (activations" in text and "21.6 GiB and the train state 3.0 GiB" in text
  assert "the temporaries alone over the 15.75 GiB" in text and "Largest state arrays" not in text
  # TinyLm (the model's own account, core.model.SizesActivations): 4 layers of float32
  # [8 rows, 1024, 128] inputs; 'minimal' keeps q, k, v, context (128 + 64 + 64 + 128 wide),
  # attn_out and mlp_out (128 each) besides.
  assert "the layers' inputs, kept for the backward, float32[4, 8, 1024, 128] 16.0 MiB" in text
  assert "(q_proj, k_proj, v_proj, attn_context, attn_out, mlp_out), float32[4, 8, 1024, 640] " \
         "80.0 MiB" in text
  # Logits 8 x 1024 x 256 x 4 B, 7/8 of them saved by 8 tiles; 2 microbatches leave 10.8 GiB
  # + 3 GiB < 15.75 GiB.
  assert "the loss's float32 logits, float32[8, 1024, 256] 8.0 MiB" in text
  assert "task.model.loss_vocab_tiles=8: the loss over vocab tiles, never the whole float32 " \
         "logits, at least 7.0 MiB less (alone, perhaps not enough)" in text
  assert "task.train.num_microbatches=2 (4 rows per device at once): temporaries about " \
         "10.8 GiB" in text
  assert "remat_policy='minimal_offloaded': what it keeps, the layers' inputs included, moves " \
         "to host memory, at least 96.0 MiB less (alone" in text and "remat_policy='full'" in text
  assert "more devices" not in text  # the state is not what fills it
  assert "a chip with more than 24.6 GiB of HBM: v4 (32.0 GiB), v5p (95.0 GiB), v6e" in text


# XLA:GPU on 2 hosts of 4 GPUs: an all-gather within each host (axis_2) and an all-reduce
# across the hosts (axis_1), in the device-mesh form of replica groups.
HOSTS_HLO = """HloModule m

ENTRY %main (a: bf16[64,256]) -> bf16[256,256] {
  %ag = (bf16[64,256]{1,0}, bf16[256,256]{1,0}) all-gather-start(%a), channel_id=1, """ \
  """replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_2'}, dimensions={0}
  %ar = f32[1024]{0} all-reduce-start(%a), channel_id=2, """ \
  """replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1','axis_2'}, to_apply=%add
}
"""


def test_collectives_across_hosts_are_charged_at_the_hosts_network_rate():
  host_of = (0, 0, 0, 0, 1, 1, 1, 1)
  ag, ar = hlo.collective_ops(HOSTS_HLO, host_of=host_of)
  assert (ag.kind, ag.group_size, ag.hosts) == ("all-gather", 4, 1)
  assert (ar.kind, ar.group_size, ar.hosts) == ("all-reduce", 8, 2)
  assert roofline.network_bytes(ag) == 0
  # Each host reduces with the other (2 hosts: half the 4 KiB out, half in, both phases),
  # spread over its 4 GPUs' NICs.
  assert roofline.network_bytes(ar) == 2 * 4096 * (1 / 2) / 4
  h100 = chips.GPUS["h100"]
  assert roofline.link_seconds(ar, h100) == max(2 * 4096 * 7 / 8 / h100.ici_ingress_bytes_per_s,
                                                1024 / h100.dcn_bytes_per_s)
  assert roofline.collective_traffic([ag, ar])["dcn"] == 1024


KERNEL_HLO = """HloModule m

ENTRY %main (a: bf16[128,128]) -> bf16[128,128] {
  %a = bf16[128,128]{1,0} parameter(0)
  ROOT %k = bf16[128,128]{1,0} custom-call(%a), custom_call_target="tpu_custom_call"
}
"""


def test_a_kernel_whose_flops_no_one_counted_is_charged_the_model_formula():
  """A Pallas call XLA cannot see into and no trace counted (kernel_flops None): the compute
  bound takes the model formula's FLOPs, so the MFU bound cannot pass 1 (it read 2.7 for
  MaxText's 128k step when this fallback keyed on a warning's wording)."""
  mem = types.SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0,
                              alias_size_in_bytes=0, temp_size_in_bytes=0)
  compiled = types.SimpleNamespace(as_text=lambda: KERNEL_HLO, memory_analysis=lambda: mem,
                                   cost_analysis=lambda: {"flops": 1e6})
  v5p = chips.CHIPS["v5p"]
  target = targets.Target("tpu", (), "v5p:2x2x1", chip=v5p)
  model = 4 * v5p.peak_bf16_flops_per_s  # 1 s of compute on each of the 4 chips
  est = planner.compiled_report(compiled, target, 4, model, 1024.0)["estimate"]
  assert est["seconds"]["compute"] == 1.0
  assert est["mfu_upper_bound"] <= 1.0
  # With the kernel's FLOPs traced (none here) XLA's own count stands.
  est = planner.compiled_report(compiled, target, 4, model, 1024.0, 0.0)["estimate"]
  assert est["seconds"]["compute"] < 1e-6
