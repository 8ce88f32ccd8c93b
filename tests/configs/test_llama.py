"""configs/llama.py: each registered Llama has its published parameter count (abstract params,
nothing allocated) and plans on emulated devices."""
import fiddle as fdl
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.layers.block import num_params

PUBLISHED = {"Llama2_7B": 6_738_415_616, "Llama2_13B": 13_015_864_320,
             "Llama2_70B": 68_976_648_192, "Llama3_8B": 8_030_261_248,
             "Llama31_70B": 70_553_706_496, "Llama31_405B": 405_853_388_800,
             "Llama32_1B": 1_235_814_400, "Llama32_3B": 3_212_749_824}
# Experiments that size a published model for another slice (MaxText's tuning configs):
# the model whose count they have.
SAME_MODEL = {"Llama31_8B_V6e256": "Llama3_8B", "Llama2_70B_V5p512": "Llama2_70B"}


@pytest.mark.parametrize("name", sorted(PUBLISHED) + sorted(SAME_MODEL))
def test_parameter_count_is_the_published_one(name):
  model = fdl.build(registry.get(f"llama.{name}")().task().model)
  row = {"inputs": np.zeros((8,), np.int32), "targets": np.zeros((8,), np.int32),
         "weights": np.ones((8,), np.float32)}
  # jax.eval_shape: shapes only
  assert num_params(model, row) == PUBLISHED[SAME_MODEL.get(name, name)]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_sets_up_on_8_devices_from_shapes_alone(name):
  """program.setup (layouts by eval_shape, every split-dims mapping validated; those sized
  for 256+ chips keep their two FSDP axes, 405B its 4-way model axis): the state is float32
  params + Adam moments split 8 ways, and nothing is allocated (405B's state alone is
  4.9 TB)."""
  import resource  # pylint: disable=g-import-not-at-top
  from spmdtask.core import memory, program as program_lib  # pylint: disable=g-import-not-at-top
  from tests import util  # pylint: disable=g-import-not-at-top
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  registered = util.build_run(f"llama.{name}").task
  micro = registered.train.num_microbatches
  overrides = [f"datasets['train'].batch_size={8 * micro}", "datasets['train'].seq_len=128"]
  fsdp_b, model = registered.ici_mesh_shape[2:]
  if fsdp_b > 1:  # sized for 256+ chips: FSDP 16 x 16 (405B: x 4 model) shrunk to 8 devices
    overrides.append(f"task.ici_mesh_shape=(1, {8 // (2 * model)}, 2, {model})")
  run = util.build_run(f"llama.{name}", overrides)
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0))
  mesh_shape = {a: int(s) for a, s in program.mesh.shape.items()}
  totals = memory.totals(memory.state_rows(program.layout, mesh_shape))
  n = PUBLISHED[name]
  assert totals["num_params"] == n
  assert abs(totals["state_bytes_per_device"] - 12 * n / 8) / (12 * n / 8) < 0.01
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before < 1e9


def test_vocabulary_is_set_once():
  exp = registry.get("llama.Llama3_8B")()
  cfg = exp.task()
  cfg.model.vocab_size = 1000  # one change reaches every input
  assert {d.vocab_size for d in [*exp.datasets().values(), *exp.decode_datasets().values()]} \
      == {1000}


def test_llama32_1b_plans_from_shapes_alone(tmp_path):
  """The real 1.2B model (rows shortened to 256 tokens) planned on the 8 test devices: the
  count is printed, the state is sized, and no param is allocated (peak RSS grows far less
  than the 4.9 GB of float32 params)."""
  import resource  # pylint: disable=g-import-not-at-top
  from spmdtask.plan import planner, printout  # pylint: disable=g-import-not-at-top
  from tests import util  # pylint: disable=g-import-not-at-top
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  run = util.build_run("llama.Llama32_1B", ["datasets['train'].batch_size=8",
                                            "datasets['train'].seq_len=256"])
  got = planner.make_plan(run, "llama.Llama32_1B")
  grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
  n = PUBLISHED["Llama32_1B"]
  assert got["num_params"] == n and got["mesh"] == {"data": 1, "fsdp": 8, "fsdp_b": 1, "model": 1}
  lines = printout.format_plan(got)
  assert "(1,235,814,400 params)" in lines[0]
  # Decoding's cache beside it: k and v, 16 layers x 8 KV heads x 64, bfloat16.
  assert got["decode_cache"] == {"bytes_per_token_per_row": 2 * 16 * 8 * 64 * 2,
                                 "max_seq_len": 131072}
  assert any(l.startswith("decode cache (--mode=decode, not in this step's memory): 32,768 B "
                          "per token of a row over all layers") for l in lines), lines
  # float32 params + Adam's two moments, split 8 ways (a few replicated norms aside).
  assert abs(got["state_bytes_per_device"] - 12 * n / 8) / (12 * n / 8) < 0.01
  assert grown < 2e9, grown


def _hf(hidden, ff, layers, heads, kv, vocab, max_pos, theta=None, scaling=None, tied=False,
        head_dim=None):
  """The fields of a published Hugging Face Llama config.json (meta-llama/*)."""
  cfg = {"model_type": "llama", "hidden_act": "silu", "hidden_size": hidden,
         "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
         "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": max_pos,
         "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": tied,
         "attention_bias": False, "mlp_bias": False}
  if theta is not None:  # Llama 2's config.json has no rope_theta (LlamaConfig's 10000.0)
    cfg["rope_theta"] = theta
  if scaling is not None:
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": scaling, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  if head_dim is not None:
    cfg["head_dim"] = head_dim
  return cfg


HF_CONFIGS = {
    "Llama2_7B": _hf(4096, 11008, 32, 32, 32, 32000, 4096),
    "Llama2_13B": _hf(5120, 13824, 40, 40, 40, 32000, 4096),
    "Llama2_70B": _hf(8192, 28672, 80, 64, 8, 32000, 4096),
    "Llama3_8B": _hf(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0),
    "Llama31_70B": _hf(8192, 28672, 80, 64, 8, 128256, 131072, 500000.0, 8.0),
    "Llama31_405B": _hf(16384, 53248, 126, 128, 8, 128256, 131072, 500000.0, 8.0),
    "Llama32_1B": _hf(2048, 8192, 16, 32, 8, 128256, 131072, 500000.0, 32.0, True, 64),
    "Llama32_3B": _hf(3072, 8192, 28, 24, 8, 128256, 131072, 500000.0, 32.0, True, 128),
}


def test_each_experiment_is_its_published_hf_config():
  """Every model field (eps, θ, scaling, context, tying) equals what spmdtask.hf reads from
  the published config.json; the converter names that experiment."""
  from spmdtask.hf.jobs import published  # pylint: disable=g-import-not-at-top
  for name, cfg in HF_CONFIGS.items():
    assert published.published_experiment(cfg) == f"llama.{name}", name
  assert published.published_experiment({**HF_CONFIGS["Llama3_8B"], "rms_norm_eps": 1e-6}) \
      is None


def test_data_dir_switches_every_input_to_the_prepared_corpus(tmp_path):
  from configs import llama  # pylint: disable=g-import-not-at-top
  from tools import prepare_text_data  # pylint: disable=g-import-not-at-top
  for i in range(10):
    (tmp_path / f"doc{i}.txt").write_text(f"document {i}: " + "words " * (50 + 30 * i))
  prepare_text_data.prepare(str(tmp_path / "*.txt"), str(tmp_path / "data"), "bytes",
                            eval_fraction=0.8, num_shards=1)  # 8 eval documents: 8 prompts

  class OnMyText(llama.Llama32_1B):  # not registered: a user's subclass
    data_dir = str(tmp_path / "data")
    batch_size, seq_len = 4, 64

  exp = OnMyText()
  exp.task().model.vocab_size = 257  # the corpus's (bytes); the inputs check it
  train = fdl.build(exp.datasets()["train"])
  prompts = fdl.build(exp.decode_datasets()["prompts"])
  batch = train.batch_at(0)
  assert batch["inputs"].shape == (4, 64) and "segment_ids" in batch
  assert prompts.tokenizer.decode(prompts.batch_at(0)["prompts"][0][:9]) == "document "


def test_tuned_experiments_carry_the_libtpu_flags_of_their_numbers():
  from spmdtask import task as task_lib  # pylint: disable=g-import-not-at-top
  flags = {name: registry.get(f"llama.{name}")().task().xla_flags
           for name in ("Llama3_8B", *SAME_MODEL)}
  for by_kind in flags.values():
    task_lib.check_xla_flags(by_kind)
  assert flags["Llama3_8B"] is None  # MaxText's v5e compile it is compared with sets none
  assert "--xla_tpu_scoped_vmem_limit_kib=98304" in flags["Llama31_8B_V6e256"]["tpu"].split()
  assert "--xla_tpu_enable_data_parallel_all_reduce_opt=true" in (
      flags["Llama2_70B_V5p512"]["tpu"].split())
