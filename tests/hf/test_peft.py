"""LoRA adapters in and out of PEFT's format (spmdtask/hf/peft.py, merge.py; the command
tools/convert_hf.py):
a PEFT adapter imported onto its base gives PEFT's logits; exported back it is the same
tensors and an adapter_config.json PEFT loads; --merge_lora gives the merged model's logits;
an adapter made for another architecture is a ConfigError (exit 2) that writes nothing.

The fixture (tests/tools/data/peft/: a PEFT adapter of tests/tools/data/llama/ with random
nonzero A and B, PEFT's logits and the merged model's) was made with peft and torch
(tests/tools/data/README.md, which also records PEFT loading this export); no torch here.
"""
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.hf import convert, families, files, llama, merge, peft
from spmdtask.hf.jobs import checkpoints, exports, imports
from tests import subproc as h
from tests import util
from tests.hf import checks

DATA = checks.DATA
BASE, PEFT = os.path.join(DATA, "llama"), os.path.join(DATA, "peft")
LLAMA = llama.FAMILY.experiment


def _logits(exp, lines, params):
  model = util.build_run(exp, lines).task.model
  tokens = np.load(os.path.join(PEFT, "tokens.npy"))
  return np.asarray(jax.jit(model.apply)({"params": params}, tokens))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """(job dir, override lines) of the fixture base + adapter through --from_hf --adapter."""
  job = str(tmp_path_factory.mktemp("peft") / "job")
  return job, imports.from_hf(BASE, job, PEFT)


def test_a_peft_adapter_imported_gives_pefts_logits(imported, capsys):
  job, lines = imported
  exp = "finetune.LlamaLoraImport"
  assert "task.model.lora.rank=4" in lines and "task.model.lora.alpha=8.0" in lines
  params = checkpoints.read_checkpoint(job, lines, exp)
  assert params["layers"]["block"]["attn"]["o_lora_a"].shape == (2, 4, 8, 4)  # [L, h, hd, r]
  assert params["layers"]["block"]["mlp"]["wo_lora_b"].shape == (2, 4, 32)    # [L, r, d]
  want = np.load(os.path.join(PEFT, "logits.npy"))
  err = float(np.abs(_logits(exp, lines, params) - want).max())
  # float32 both sides, |logits| <= 12: rounding, far below the adapter's effect (4.75).
  assert err <= 1e-4, err
  with open(os.path.join(job, imports.SOURCE_FILE)) as f:
    assert json.load(f)["base_model_name_or_path"] == "tiny-llama"


def test_export_gives_the_same_tensors_and_a_config_peft_reads(imported, tmp_path):
  job, _ = imported
  out = str(tmp_path / "adapter")
  assert exports.to_hf(job, out) == [peft.CONFIG_FILE, peft.ADAPTER_FILE]
  want_cfg, want = peft.read(PEFT)
  got_cfg, got = peft.read(out)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    assert got[k].dtype == np.float32
  for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias",
              "base_model_name_or_path", "use_rslora", "use_dora", "fan_in_fan_out"):
    assert got_cfg[key] == want_cfg[key], key
  assert sorted(got_cfg["target_modules"]) == sorted(want_cfg["target_modules"])
  base = files.read_hf(BASE)[0]
  assert peft.lora_fields(base, got_cfg, "x") == peft.lora_fields(base, want_cfg, "x")


def test_merge_lora_export_gives_the_merged_models_logits(imported, tmp_path):
  job, _ = imported
  merged, again = str(tmp_path / "merged"), str(tmp_path / "again")
  assert exports.to_hf(job, merged, merge_lora=True) == [
      "config.json", "generation_config.json", "model.safetensors"]
  lines = imports.from_hf(merged, again)  # a plain Llama now: no adapter tensors
  params = checkpoints.read_checkpoint(again, lines, LLAMA)
  assert "q_lora_a" not in params["layers"]["block"]["attn"]
  err = float(np.abs(_logits(LLAMA, lines, params)
                     - np.load(os.path.join(PEFT, "merged_logits.npy"))).max())
  assert err <= 1e-4, err
  with pytest.raises(ConfigError, match="--merge_lora: the job .* has no LoRA adapters"):
    exports.to_hf(again, str(tmp_path / "none"), merge_lora=True)


def _broken(tmp_path, edit_cfg=None, edit_tensors=None) -> str:
  """A copy of the fixture adapter with its config and/or tensors edited."""
  out = tmp_path / "bad_adapter"
  shutil.copytree(PEFT, out)
  cfg, tensors = peft.read(str(out))
  if edit_cfg:
    edit_cfg(cfg)
    (out / peft.CONFIG_FILE).write_text(json.dumps(cfg))
  if edit_tensors:
    from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
    edit_tensors(tensors)
    st_numpy.save_file(tensors, str(out / peft.ADAPTER_FILE))
  return str(out)


def _gpt2_modules(cfg):
  cfg["target_modules"] = ["c_attn", "q_proj"]


def _rank_8(tensors):
  key = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
  tensors[key] = np.zeros((8, 32), np.float32)


def _third_layer(tensors):
  tensors["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"] = np.zeros(
      (4, 32), np.float32)


@pytest.mark.parametrize("edit_cfg,edit_tensors,message", [
    (_gpt2_modules, None, r"target_modules names \['c_attn'\].*another architecture"),
    (None, _rank_8, r"up_proj.lora_A.weight is \[8, 32\], this model needs \[4, 32\]"),
    (None, _third_layer, r"no place for.*layers.2.self_attn"),
    (lambda c: c.update(use_dora=True), None, r"use_dora=True: DoRA.*cannot express "
     r"exactly, so nothing was imported"),
    (lambda c: c.update(peft_type="IA3"), None, r"peft_type='IA3'"),
], ids=["modules", "shape", "layers", "dora", "ia3"])
def test_an_adapter_for_another_architecture_is_refused_writing_nothing(
    tmp_path, edit_cfg, edit_tensors, message):
  adapter, job = _broken(tmp_path, edit_cfg, edit_tensors), str(tmp_path / "job")
  with pytest.raises(ConfigError, match=message):
    imports.from_hf(BASE, job, adapter)
  assert not os.path.exists(job)


def test_the_command_line_exits_2_and_only_warns_of_another_base_name(tmp_path):
  adapter, job = _broken(tmp_path, _gpt2_modules), str(tmp_path / "job")
  r = h.run([sys.executable, "tools/convert_hf.py", f"--from_hf={BASE}",
             f"--adapter={adapter}", f"--job_log_dir={job}"], num_devices=1)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "c_attn" in r.stderr and "Traceback" not in r.stderr and not os.path.exists(job)
  cfg = {"base_model_name_or_path": "someone/other-llama"}
  assert "warning" in peft.base_mismatch(cfg, BASE, {})
  assert peft.base_mismatch({"base_model_name_or_path": "x/llama"}, BASE, {}) is None


def test_new_adapters_start_as_peft_does_and_export(tmp_path):
  """--lora_rank: fresh adapters on the imported base (B = 0: the base model's logits),
  exported as a PEFT adapter; rank 0 is refused before anything is written."""
  job, out = str(tmp_path / "job"), str(tmp_path / "adapter")
  new = {"r": 2, "lora_alpha": 4.0, "target_modules": "all-linear"}
  lines = imports.from_hf(BASE, job, new_lora=new)
  params = checkpoints.read_checkpoint(job, lines, "finetune.LlamaLoraImport")
  attn = params["layers"]["block"]["attn"]
  assert attn["q_lora_a"].shape == (2, 32, 2) and not attn["q_lora_b"].any()
  assert np.abs(attn["q_lora_a"]).max() > 0
  plain = convert.to_params(*files.read_hf(BASE))
  np.testing.assert_array_equal(attn["q"], plain["layers"]["block"]["attn"]["q"])
  exports.to_hf(job, out)
  cfg, tensors = peft.read(out)
  assert cfg["r"] == 2 and cfg["lora_alpha"] == 4.0 and len(tensors) == 2 * 7 * 2
  with pytest.raises(ConfigError, match=r"r=0"):
    imports.from_hf(BASE, str(tmp_path / "bad"), new_lora={**new, "r": 0})
  assert not os.path.exists(tmp_path / "bad")


# --- Every family: each made offline by tests/tools/data/make_peft_families.py (peft 0.21.2,
# transformers 5): a rank-4 adapter with random A and B on every module PEFT can adapt,
# PEFT's logits of the family's tokens.npy and merge_and_unload()'s.
FAMILIES = ("qwen3", "gemma3", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=FAMILIES)
def family_round_trip(request, tmp_path_factory):
  """Per family: the adapter imported (--from_hf --adapter), its logits from the job's
  checkpoint (one compile); those params out as --to_hf writes PEFT's adapter (peft.from_params
  of the import's config, as read) and merged as --merge_lora merges them (merge.merged).
  (--to_hf's files, both kinds, are the Llama adapter's tests' above: the export reads the
  job's checkpoint back, the same params.)"""
  name = request.param
  hf, cfg, tokens, _ = checks.fixture(name)
  adapter = os.path.join(DATA, f"peft_{name}")
  job = str(tmp_path_factory.mktemp(f"peft_{name}") / "job")
  lines = imports.from_hf(hf, job, adapter)
  exp = families.lora_experiment(cfg)
  params = checkpoints.read_checkpoint(job, lines, exp)
  apply = jax.jit(util.build_run(exp, lines).task.model.apply)
  logits = np.asarray(apply({"params": params}, tokens))
  src = imports.source(job)
  held = families.of(src["config"]).held(src["config"], src["dtypes"])[0]  # V3: no MTP
  out = (peft.adapter_config(held, src["lora"], None)["target_modules"],
         peft.from_params(held, src["lora"], params))
  # The merged params, run by the same compiled LoRA model with its adapters' B at 0 (so it
  # is the plain model).
  plain = merge.merged(src["lora"], params)
  zero_b = jax.tree_util.tree_map_with_path(
      lambda p, x: np.zeros_like(x) if p[-1].key.endswith(peft.B_SUFFIX) else x, params)
  merged_logits = np.asarray(apply({"params": _with_adapters(plain, zero_b)}, tokens))
  return name, adapter, out, logits, merged_logits


def _with_adapters(plain, lora_params):
  """`plain` params with the adapter leaves of `lora_params` beside their weights."""
  if not isinstance(lora_params, dict):
    return plain
  return {k: _with_adapters(plain[k], v) if k in plain else v for k, v in lora_params.items()}


def test_every_familys_adapter_in_gives_pefts_logits_and_goes_out_the_same(
    family_round_trip):
  """Adapter in -> spmdtask's logits vs PEFT's <= 1e-4; out -> the fixture's tensors (1e-6)
  and target_modules; merged as --merge_lora merges -> merge_and_unload()'s logits <= 1e-4.
  float32 both sides, |logits| <= 9.5: the adapters move the logits by 7 to 14."""
  name, adapter, (got_modules, got_tensors), logits, merged_logits = family_round_trip
  want = np.load(os.path.join(adapter, "logits.npy"))
  err = float(np.abs(logits - want).max())
  assert err <= 1e-4, (name, err)
  want_cfg, want_tensors = peft.read(adapter)
  assert sorted(got_tensors) == sorted(want_tensors)
  for k, x in want_tensors.items():
    np.testing.assert_allclose(got_tensors[k], x, rtol=0, atol=1e-6, err_msg=k)
  assert sorted(got_modules) == sorted(want_cfg["target_modules"])
  err = float(np.abs(merged_logits - np.load(os.path.join(adapter, "merged_logits.npy"))).max())
  assert err <= 1e-4, (name, err)


# --- Refused by name: adapter_config.json keys spmdtask cannot express exactly.
# A value of each EXACT key that changes the math (what PEFT 0.21 would accept there).
CHANGES_THE_MATH = {
    "alora_invocation_tokens": [128, 7], "use_dora": True, "use_rslora": True,
    "layer_replication": [[0, 2], [1, 2]], "rank_pattern": {"q_proj": 8},
    "alpha_pattern": {"q_proj": 16}, "bias": "lora_only", "lora_bias": True,
    "modules_to_save": ["lm_head"], "trainable_token_indices": [5],
    "layers_to_transform": [0], "layers_pattern": "layers",
    "target_parameters": ["mlp.experts.gate_up_proj"], "fan_in_fan_out": True,
    "use_qalora": True, "use_bdlora": True, "velora_config": {"rank": 2},
    "monteclora_config": {"n": 2}, "arrow_config": {"top_k": 2}, "kasa_config": {"k": 1},
    "loftq_config": {"loftq_bits": 4}, "megatron_config": {"tp": 2}}


def _fields():
  with open(os.path.join(DATA, "peft_lora_fields.json")) as f:
    return json.load(f)["fields"]


def test_every_peft_lora_config_field_has_a_verdict():
  """PEFT 0.21.2's LoraConfig fields (tests/tools/data/peft_lora_fields.json): each is read,
  ignored (no effect once the weights are saved) or refused unless at its plain value; a
  field added by a newer PEFT fails here, and an unknown key is refused at import."""
  fields = _fields()
  verdicts = set(peft.READ) | set(peft.IGNORED) | set(peft.EXACT)
  assert sorted(set(fields) - verdicts) == []
  assert sorted(set(peft.EXACT)) == sorted(CHANGES_THE_MATH)
  for key in peft.EXACT:  # PEFT's default is plain LoRA
    assert fields[key] in peft.EXACT[key][0] or fields[key] is None, key
  cfg, adapter = files.read_hf(BASE)[0], peft.read(PEFT)[0]
  plain = peft.lora_fields(cfg, {**adapter, **{k: fields[k] for k in peft.EXACT}}, "x")
  assert plain["rank"] == 4 and len(plain["targets"]) == 7
  with pytest.raises(ConfigError, match=r"x: some_new_knob=1: a setting this reader does not "
                     r"know.*nothing was imported"):
    peft.lora_fields(cfg, {**adapter, "some_new_knob": 1}, "x")


@pytest.mark.parametrize("key", sorted(CHANGES_THE_MATH))
def test_each_setting_that_changes_the_math_is_refused_by_name(key):
  cfg, adapter = files.read_hf(BASE)[0], peft.read(PEFT)[0]
  value = CHANGES_THE_MATH[key]
  with pytest.raises(ConfigError) as e:
    peft.lora_fields(cfg, {**adapter, key: value}, "ADAPTER/adapter_config.json")
  msg = str(e.value)
  assert msg.startswith(f"ADAPTER/adapter_config.json: {key}={value!r}: "), msg
  assert "cannot express exactly, so nothing was imported" in msg and "\n" not in msg


@pytest.mark.parametrize("init,ok", [(True, True), ("gaussian", True), ("pissa", False),
                                     ("olora", False), ("loftq", False), ("corda", False)])
def test_an_init_that_rewrote_the_base_is_refused(init, ok):
  cfg, adapter = files.read_hf(BASE)[0], peft.read(PEFT)[0]
  if ok:
    peft.lora_fields(cfg, {**adapter, "init_lora_weights": init}, "x")
    return
  with pytest.raises(ConfigError, match=rf"init_lora_weights={init!r}: an init that rewrites "
                     r"the base weights.*path_initial_model_for_weight_conversion"):
    peft.lora_fields(cfg, {**adapter, "init_lora_weights": init}, "x")


def test_an_alora_adapter_is_refused_writing_nothing(tmp_path):
  """The issue's case: an aLoRA adapter was imported as plain LoRA (logits up to 1.2
  apart from PEFT's)."""
  adapter = _broken(tmp_path, lambda c: c.update(alora_invocation_tokens=[12, 7]))
  job = str(tmp_path / "job")
  with pytest.raises(ConfigError, match=r"alora_invocation_tokens=\[12, 7\]: an activated LoRA"):
    imports.from_hf(BASE, job, adapter)
  assert not os.path.exists(job)


def test_pefts_fused_moe_expert_form_is_refused_saying_what_to_target():
  """What PEFT 0.21 writes for gate/up/down_proj of a DeepSeek (transformers 5's fused
  experts, gate_up_proj at rank 2r): refused by name, attention adapters still import."""
  cfg = checks.fixture("deepseek_v3")[1]
  adapter = peft.read(os.path.join(DATA, "peft_deepseek_v3"))[0]
  fused = {**adapter, "target_parameters": ["gate_up_proj", "down_proj"],
           "rank_pattern": {r".*\.gate_up_proj": 8}, "alpha_pattern": {r".*\.gate_up_proj": 16}}
  with pytest.raises(ConfigError, match=r"target_parameters=\['gate_up_proj', 'down_proj'\]: "
                     r"adapters on parameters.*adapt attention only"):
    peft.lora_fields(cfg, fused, "x")
  with pytest.raises(ConfigError, match=r"target_modules names \['gate_proj'\], which no weight "
                     r"spmdtask can adapt in this deepseek_v3 model matches"):
    peft.lora_fields(cfg, {**adapter, "target_modules": ["q_a_proj", "gate_proj"]}, "x")
  assert peft.lora_fields(cfg, adapter, "x")["targets"] == ("o", "q_down", "q_up", "kv_down",
                                                            "kv_up")


def test_a_target_must_cover_every_layer_and_routed_experts_do_not_export():
  cfg, adapter = files.read_hf(BASE)[0], peft.read(PEFT)[0]
  part = {**adapter, "exclude_modules": ["model.layers.1.self_attn.q_proj"]}
  with pytest.raises(ConfigError, match=r"adapts model.layers.0.self_attn.q_proj but not "
                     r"model.layers.1.self_attn.q_proj: spmdtask's LoRA target 'q' adapts"):
    peft.lora_fields(cfg, part, "x")
  regex = {**adapter, "target_modules": r".*\.(q|v)_proj"}
  assert peft.lora_fields(cfg, regex, "x")["targets"] == ("q", "v")
  mixtral = checks.fixture("mixtral")[1]
  lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ("q", "experts")}
  with pytest.raises(ConfigError, match=r"--to_hf: the job adapts \['experts'\].*--merge_lora"):
    peft.exportable(mixtral, lora, "--to_hf")


def test_merging_adds_alpha_over_rank_times_a_b_to_dense_and_expert_weights():
  rng = np.random.default_rng(0)
  params = {"layers": {"attn": {"o": rng.normal(size=(2, 3, 4, 5)),
                                "o_lora_a": rng.normal(size=(2, 3, 4, 2)),
                                "o_lora_b": rng.normal(size=(2, 2, 5))},
                       "moe": {"wi": rng.normal(size=(2, 6, 5, 7)),
                               "wi_lora_a": rng.normal(size=(2, 6, 5, 2)),
                               "wi_lora_b": rng.normal(size=(2, 6, 2, 7)), "router": 1.0}}}
  out = merge.merged({"rank": 2, "alpha": 3.0}, params)
  assert sorted(out["layers"]["attn"]) == ["o"] and sorted(out["layers"]["moe"]) == [
      "router", "wi"]
  attn, moe = params["layers"]["attn"], params["layers"]["moe"]
  want_o = attn["o"] + 1.5 * np.einsum("lhkr,lrd->lhkd", attn["o_lora_a"], attn["o_lora_b"])
  want_wi = moe["wi"] + 1.5 * np.einsum("leir,lero->leio", moe["wi_lora_a"], moe["wi_lora_b"])
  # float32 (merged) vs float64 (here): rounding of values up to ~10.
  np.testing.assert_allclose(out["layers"]["attn"]["o"], want_o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["layers"]["moe"]["wi"], want_wi, rtol=1e-5, atol=1e-5)


def test_a_rank_above_a_weights_dims_is_refused_writing_nothing(tmp_path):
  job = str(tmp_path / "job")
  with pytest.raises(ConfigError, match=r"task.model.lora.rank=1000: rank 1000 > 16, the "
                     r"smaller dim of k in this model \(32 in x 16 out\)"):
    imports.from_hf(BASE, job, new_lora={"r": 1000, "lora_alpha": 2000.0,
                                         "target_modules": "all-linear"})
  assert not os.path.exists(job)
