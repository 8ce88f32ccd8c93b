"""Remat policies by name (spmdtask.core.remat): every preset gives no remat's loss and
gradients under each execution strategy (scan on 1 and 8 devices, the SPMD pipeline, MPMD),
the presets save what they say, and factory or unknown names are config errors."""
import functools

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.core import remat
from tests import util

ONE_DEVICE = ("task.ici_mesh_shape=(1, 1, 1)",)
# (experiment, devices, the field that holds its remat policy, extra overrides)
STRATEGIES = {
    "scan-1": ("lm.TinyLm", 1, "task.model.remat_policy", ONE_DEVICE),
    "scan-8": ("lm.TinyLmFsdpTp", 8, "task.model.remat_policy", ()),
    "spmd-pipeline-8": ("lm.TinyLmPipeline", 8, "task.pipeline.remat_policy", ()),
    "mpmd-8": ("lm.TinyLmMpmd", 8, "task.model.remat_policy", ()),
}


def keep_grads(learning_rate):
  """SGD whose state is the step's gradients (a momentum trace that decays fully)."""
  return optax.chain(optax.trace(decay=0.0), optax.scale_by_learning_rate(learning_rate))


def _grads_optimizer(cfg):
  cfg.task.train.optimizer = fdl.Partial(keep_grads)
  cfg.task.train.clip_grad_norm = None


def _program(strategy: str, policy: str | None):
  exp, devices, field, extra = STRATEGIES[strategy]
  run = util.build_run(exp, list(extra) + [f"{field}={policy!r}"], edit=_grads_optimizer)
  batch = run.datasets["train"].batch_at(0)
  return program_lib.setup(run.task, batch, devices=jax.devices()[:devices]), batch


@functools.lru_cache(maxsize=None)
def _initial(strategy: str):
  """No remat's program (and its batch): its init and its canonical conversion serve every
  policy's program (policies change no layout), so each policy compiles only its train step."""
  return _program(strategy, None)


def _loss_and_grads(strategy: str, policy: str | None):
  """(first step's loss, its canonical gradients) under `policy`."""
  initial, _ = _initial(strategy)
  program, batch = _initial(strategy) if policy is None else _program(strategy, policy)
  state, metrics = program.train(initial.init(), program.global_batch(batch))
  return float(metrics["loss"]), jax.device_get(initial.to_canonical(state).opt_state[0].trace)


# Every preset runs through a scan: on 8 devices one of each kind (recompute all, save on the
# device, offload), on 1 device the others. The pipelines (slow to compile) try one that saves
# and one that offloads: what differs between presets is only the set of names.
SCAN_8 = ("full", "save_dot_except_mlp", "minimal_offloaded")


@pytest.mark.parametrize("strategy,presets", [
    ("scan-1", tuple(p for p in remat.PRESETS if p not in SCAN_8)), ("scan-8", SCAN_8),
    ("spmd-pipeline-8", ("minimal", "save_qkv_proj_offloaded"))])  # (MPMD: suite time)
@pytest.mark.slow
def test_presets_give_no_remats_loss_and_grads(strategy, presets):
  want_loss, want_grads = _loss_and_grads(strategy, None)
  for name in presets:
    loss, grads = _loss_and_grads(strategy, name)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=name)
    util.assert_trees_close(grads, want_grads, terms=util.TINY_LM_TOKENS)


def test_presets_save_their_names_and_offload_only_when_asked(capsys):
  def layer(x):  # one named value per name, so the saved residuals tell which are kept
    for n in remat.NAMES:
      x = jnp.sin(checkpoint_name(x * 2.0, n))
    return x

  def saved(name):
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=remat.policy(name)),
                                            jnp.ones(3))
    lines = capsys.readouterr().out.splitlines()
    return ({ln.split("'")[1] for ln in lines if "named '" in ln},
            sum("<host>" in ln for ln in lines))

  assert saved("full") == (set(), 0)
  assert saved("minimal") == (set(remat.SAVED["minimal"]), 0)
  assert saved("save_qkv_proj") == ({"q_proj", "k_proj", "v_proj"}, 0)
  assert saved("save_dot_except_mlp") == ({"q_proj", "k_proj", "v_proj", "attn_out"}, 0)
  assert saved("save_q_attn_out") == ({"q_proj", "attn_out"}, 0)
  assert saved("save_qkv_weights") == ({"q_weight", "k_weight", "v_weight"}, 0)
  assert saved("minimal_offloaded") == (set(), len(remat.SAVED["minimal"]) + 1)  # all on the host
  assert remat.offloads("minimal_offloaded") and not remat.offloads("minimal")


def test_offloaded_presets_keep_the_layer_input_on_the_host(capsys):
  """A layer whose input is used only through its name (as `layers.block.Block`'s): a preset
  keeps the raw input for the backward; its offloaded form keeps only the host copy, inside a
  scan too (the carry is not stacked on the device)."""
  def layer(x):
    x = checkpoint_name(x, remat.LAYER_INPUT)
    return x + jnp.sin(checkpoint_name(jnp.sin(x), remat.Q_PROJ))

  def residuals(name, scanned=False):
    fn = jax.checkpoint(layer, policy=remat.policy(name))
    if scanned:
      fn = lambda x, f=fn: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=4)[0]
    jax.ad_checkpoint.print_saved_residuals(fn, jnp.ones(3))
    return capsys.readouterr().out.splitlines()

  assert residuals("full") == ["f32[3] from the argument x"]
  assert [ln.split(" ")[0] for ln in residuals("full_offloaded")] == ["f32<host>[3]"]
  assert sorted(ln.split(" ")[0] for ln in residuals("save_qkv_proj_offloaded")) == [
      "f32<host>[3]", "f32<host>[3]"]
  assert [ln.split(" ")[0] for ln in residuals("full_offloaded", scanned=True)] == [
      "f32<host>[4,3]"]


@pytest.mark.parametrize("name,why", [
    ("offload_dot_with_no_batch_dims", "is a jax.checkpoint_policies factory"),
    ("save_only_these_names", "is a jax.checkpoint_policies factory"),
    ("minimal_offload", "is not a remat policy"),
    (3, "is not a remat policy"),
])
def test_factories_and_unknown_names_are_config_errors(name, why):
  with pytest.raises(ConfigError, match=rf"task.model.remat_policy={name!r} {why}.*minimal, "
                                        r".*minimal_offloaded.*nothing_saveable"):
    remat.check("task.model.remat_policy", name)


def test_choices_are_presets_and_jax_policies_but_no_factories():
  assert set(remat.jax_policies()) == {
      "checkpoint_dots", "checkpoint_dots_with_no_batch_dims", "dots_saveable",
      "dots_with_no_batch_dims_saveable", "everything_saveable", "nothing_saveable"}
  for name in remat.choices():
    remat.check("f", name)
    assert remat.policy(name) is not None
