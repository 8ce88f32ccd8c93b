"""Every strategy for every stacked model: cold starts from the 1-device initial weights with
packed text (segment ids, positions) and dropout under the SPMD pipeline and MPMD, each equal
to one device; config errors; the stage programs' activation splits."""
import re

import fiddle as fdl
import jax
import numpy as np
import pytest

from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from spmdtask.core.strategy import StackFacts
from tests import util

STEPS = 3
DROPOUT = ("task.model.dropout_rate=0.1",)


def one_device(exp, overrides=(), edit=None, steps=STEPS):
  axes = util.build_run(exp, overrides).task.mesh_axis_names
  ones = "task.ici_mesh_shape=" + str((1,) * len(axes))
  return util.train_steps(exp, steps, jax.devices()[:1], (ones, *overrides), edit)


# (TinyVit under MPMD equals it on one device too, measured once: suite time.)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
  return util.packed_text_corpus(tmp_path_factory)


def _text(corpus):
  return ["task.model.vocab_size=257"] + [
      f"datasets['{s}'].{k}" for s in ("train", "eval")
      for k in (f"data_dir='{corpus}'", "batch_size=16", "seq_len=64")] + [
      f"decode_datasets['prompts'].data_dir='{corpus}'",
      "decode_datasets['prompts'].num_examples=4", "decode_datasets['prompts'].batch_size=4"]


def _spmd(cfg):
  cfg.task.mesh_axis_names = ("stage", "data", "fsdp", "model")
  cfg.task.ici_mesh_shape = (2, 2, 1, 2)
  cfg.task.pipeline = fdl.Config(PipelineConfig, num_stages=2, num_microbatches=4)


def _mpmd(cfg):
  cfg.task.pipeline = fdl.Config(MpmdConfig, layer_cuts=(2,),
                                 submesh_shapes=((2, 1, 2), (4, 1, 1)), num_microbatches=4)


def init_params(program):
  return jax.device_get(program.to_canonical(program.init()).params)


@pytest.mark.slow
def test_packed_text_with_dropout_cold_starts_under_both_pipelines_equal_one_device(corpus):
  """lm.TextLm (packed rows: segment ids, positions) with dropout under the SPMD pipeline
  and MPMD starts from the one-device initial weights and trains with its losses and params.
  (Without dropout, lm.TinyLmPipeline and lm.TinyLmMpmd equal one device too:
  tests/layers/test_transformer.py, tests/pipeline/mpmd/test_program.py.)"""
  over = _text(corpus) + list(DROPOUT)
  batch = util.build_run("lm.TextLm", over).datasets["train"].batch_at(0)
  assert batch["segment_ids"].max() > 1  # packed rows
  want, want_params, program, _ = one_device("lm.TextLm", over)
  want_init = init_params(program)
  # MPMD draws microbatch m's key as 4-microbatch gradient accumulation does.
  accumulated = one_device("lm.TextLm", over + ["task.train.num_microbatches=4"])
  # Dropout is on: the masks of 4 microbatches' keys change the losses.
  assert not np.allclose(accumulated[0], want, rtol=1e-3)
  # The SPMD pipeline splits inside the forward: masks are the whole batch's (row ids).
  for edit, (want, want_params) in ((_spmd, (want, want_params)),
                                    (_mpmd, accumulated[:2])):
    got, params, program, _ = util.train_steps("lm.TextLm", STEPS, overrides=over, edit=edit)
    util.assert_trees_equal(init_params(program), want_init)  # identical initial params
    np.testing.assert_allclose(got, want, rtol=1e-5)
    util.assert_trees_close(params, want_params, terms=util.TINY_LM_TOKENS, rtol=1e-4)


def test_interleaved_with_one_chunk_is_a_config_error():
  run = util.build_run("lm.TinyLmMpmd", ["task.pipeline.schedule='interleaved_1f1b'"])
  with pytest.raises(ConfigError, match="num_chunks=1 would run un-interleaved"):
    run.task.pipeline.validate(StackFacts(num_layers=4, batch_size=16, mesh=None))


# (An MPMD plan compiles every stage program: tests/plan/test_plan_tpu.py, on v5e.)


def test_stage_programs_hold_activations_split_as_the_mapping_says():
  """Each part is traced under its stage's submesh: stage 0 (data 2 x model 2) constrains the
  heads and feed-forward activations over `model`; stage 1 (data 4) over the batch only."""
  run = util.build_run("lm.TinyLmMpmd")
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example)
  got = {}
  for lw in program.lowerings(example):
    if lw.name.endswith("forward"):
      text = lw.lower().as_text()
      got[lw.stage] = (re.findall(r"sdy.mesh @\w+ = <([^>]*)>", text),
                       set(re.findall(r"sdy.sharding_constraint %\S+ <@\w+, (\[[^\n]*?\])>",
                                      text)), re.findall(r"manual_axes=(\{[^}]*\})", text))
  # Each part runs per device on the data axis (one gradient reduction a step, mpmd.local):
  # inside, the batch dim names the automatic data axes only (fsdp).
  assert got[0][0] == ['["data"=2, "fsdp"=1, "model"=2]'] and set(got[0][2]) == {'{"data"}'}
  assert '[{"fsdp"}, {}, {"model"}, {}]' in got[0][1]  # heads [b, t, h, hd]
  assert '[{"fsdp"}, {}, {"model"}]' in got[0][1]  # ff [b, t, d_ff]
  assert got[1][0] == ['["data"=4, "fsdp"=1, "model"=1]'] and set(got[1][2]) == {'{"data"}'}
  assert '[{"fsdp"}, {}, {"model"}]' in got[1][1]  # logits (model has size 1 here)
