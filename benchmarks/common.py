"""Shared by the benchmarks: 8 emulated CPU devices unless XLA_FLAGS says otherwise."""
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiddle as fdl  # pylint: disable=g-import-not-at-top,wrong-import-position

from spmdtask import main as main_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

# The design notes' reference LM: d 256, 4 layers, ff 1024, vocab 1024, seq 256, batch 8.
REFERENCE_LM = [
    "task.model.d_model=256", "task.model.num_layers=4", "task.model.num_heads=4",
    "task.model.num_kv_heads=4", "task.model.head_dim=64", "task.model.d_ff=1024",
    "task.model.vocab_size=1024", "task.model.mlp_activation='gelu'",
    "task.model.remat_policy=None", "datasets['train'].vocab_size=1024",
    "datasets['train'].seq_len=256", "datasets['train'].batch_size=8",
]


def build(exp: str, overrides):
  return fdl.build(main_lib.resolved_config(exp, list(overrides)))
