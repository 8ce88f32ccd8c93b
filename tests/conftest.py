"""Gives every test 8 emulated CPU devices, compiled at LLVM -O0 (set before jax is imported)."""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import forkserver  # pylint: disable=wrong-import-position
from tests.subproc import EXTRA_XLA_FLAGS, FAST_COMPILE  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") +
    f" {FAST_COMPILE} {EXTRA_XLA_FLAGS} --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs reads this at import: "true" (its default) makes its filesystem probe each bucket over
# gRPC, which the GCS emulator lacks (~60 s of retries per probe); tests/gcs_emulator.env_for
# sets it for subprocesses, and an in-process test may import gcsfs before it sets anything.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: an end-to-end test that takes over ~20 s on 2 cores (deselect: -m 'not slow')")


def pytest_collection_finish(session):
  del session
  forkserver.freeze_gc()  # every test module is imported


def pytest_collection_modifyitems(items):
  # The long end-to-end tests first (those of the files with the most slow tests first), so
  # that short ones fill the end. README's command runs `--dist worksteal`: each worker starts
  # on its half of this order and an idle one takes half of another's queue, so neither
  # waits for the other at the end (xdist's default `load` left one worker idle for the last
  # 7 minutes of the suite; `--dist loadfile` was slower still: 55:39 against 43:39, heavy
  # files pinned to one worker and the largest tests last).
  def slow(item):
    return item.get_closest_marker("slow") is not None
  per_file = collections.Counter(item.path for item in items if slow(item))
  items.sort(key=lambda item: (not slow(item), -per_file[item.path]))
