"""Supervised fine-tuning (TinyLmSft, masked rows): every layout trains like one device, and
every execution path normalizes the loss by the GLOBAL batch's target count (microbatching,
the SPMD pipeline, MPMD), not per row or per microbatch."""
import jax
import numpy as np
import pytest

from configs import lm
from spmdtask.core import host_input
from spmdtask.errors import ConfigError
from tests import util

# Three updates after the first step's (TinyLm's warmup starts at learning rate 0), each
# from Adam's moments of the earlier gradients; more steps repeat the same programs.
STEPS = 4
ONE_DEVICE = ["task.ici_mesh_shape=(1, 1, 1)"]


@pytest.fixture(scope="module")
def sft_reference():
  losses, params, _, _ = util.train_steps("lm.TinyLmSft", STEPS, jax.devices()[:1], ONE_DEVICE)
  return losses, params


# (fsdp 4 x model 2 too, measured once: tests/configs/test_qwen3.py trains TinyLm's layer on
# that mesh against one device; the masked rows' normalization is the data split's matter.)
@pytest.mark.parametrize("mesh", [(1, 8, 1), (4, 1, 2)], ids=["fsdp", "tp"])
def test_sft_on_8_devices_matches_one_device(mesh, sft_reference):
  ref_losses, ref_params = sft_reference
  losses, params, program, _ = util.train_steps("lm.TinyLmSft", STEPS,
                                                overrides=[f"task.ici_mesh_shape={mesh}"])
  assert program.mesh.size == 8
  assert losses[-1] < losses[0] - 0.1  # it learns (5.94 to 5.76 over these 4 steps)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  util.assert_trees_close(params, ref_params, terms=util.TINY_LM_TOKENS)


def test_tiny_lm_sft_rows_are_masked_conversations():
  run = util.build_run("lm.TinyLmSft")
  train = run.datasets["train"]
  assert host_input.target_masked(train) and not host_input.target_masked(
      util.build_run("lm.TinyLm").datasets["train"])
  batch = train.batch_at(0)
  targets = batch["weights"].sum(axis=1)
  # Prompt tokens weigh 0; rows hold different target counts; no segment's last input
  # (it predicts the next segment's first token) is a target.
  assert 0 < targets.min() < targets.max() < lm.TinyLmSft.seq_len - 4
  last = np.diff(batch["segment_ids"], axis=1, append=0) != 0
  assert not (batch["weights"] * last).any()
  assert set(np.unique(batch["weights"])) == {0.0, 1.0}


def test_tiny_lm_sft_refuses_a_data_dir_without_target_masks(tmp_path_factory):
  data = util.packed_text_corpus(tmp_path_factory)  # prepare_text_data.py: no masks
  with pytest.raises(ConfigError, match=r"(?s)data_dir=.*without target masks.*prepare_chat"):
    util.build_run("lm.TinyLmSft", [f"datasets['train'].data_dir={data!r}",
                                    "task.model.vocab_size=257"])


def _skewed_batch(rows=16, seq=64, vocab=256):
  """Rows whose target counts differ 60-fold (rows 0, 3, ...: 60 targets, the rest 1 or 2),
  so any split into microbatches gives them unequal weights."""
  g = np.random.default_rng(7)
  tokens = g.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
  weights = np.zeros((rows, seq), np.float32)
  for r in range(rows):
    n = 60 if r % 3 == 0 else 1 + r % 2
    weights[r, seq - n:] = 1.0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def _program(exp, devices, overrides=()):
  overrides = list(overrides) + (ONE_DEVICE if devices == 1 else [])
  run = util.build_run(exp, overrides)
  from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
  return program_lib.setup(run.task, _skewed_batch(), devices=jax.devices()[:devices])


def _one_step(program, layout=None):
  """(metrics, params after one step on the skewed batch, initial params); `layout`: a
  program of the same mesh and model whose init and canonical conversion serve (the same
  programs: microbatching changes only the train step), else `program`'s own."""
  layout = layout or program
  state = layout.init()
  initial = jax.device_get(layout.to_canonical(state).params)
  state, metrics = program.train(state, program.global_batch(_skewed_batch()))
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()
             if k in ("loss", "grad_norm", "target_tokens")}
  return metrics, jax.device_get(layout.to_canonical(state).params), initial


@pytest.mark.slow
def test_every_execution_path_divides_by_the_global_target_count():
  one = _program("lm.TinyLm", 1)
  want, want_params, params = _one_step(one)
  assert want["target_tokens"] == 6 * 60 + 5 * 1 + 5 * 2
  # The trap this guards against: a mean of per-microbatch means is visibly another loss.
  run = util.build_run("lm.TinyLm", ONE_DEVICE)
  model = run.task.model
  batch = _skewed_batch()
  loss = jax.jit(lambda p, b: model.apply({"params": p}, b, method=model.loss)[0])  # 1 compile
  means = [float(loss(params, {k: v[m::4] for k, v in batch.items()})) for m in range(4)]
  assert abs(np.mean(means) - want["loss"]) > 1e-3
  for exp, devices, more in [("lm.TinyLm", 1, ["task.train.num_microbatches=4"]),
                             ("lm.TinyLmPipeline", 8, []), ("lm.TinyLmMpmd", 8, [])]:
    got, got_params, _ = _one_step(_program(exp, devices, more), one if devices == 1 else None)
    assert got["target_tokens"] == want["target_tokens"], exp
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6, err_msg=exp)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5, err_msg=exp)
    util.assert_trees_close(got_params, want_params, terms=util.TINY_LM_TOKENS)
