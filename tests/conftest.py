"""Gives every test 8 emulated CPU devices, compiled at LLVM -O0 (set before jax is imported)."""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def pytest_collection_modifyitems(items):
  # xdist hands tests out in this order: the long end-to-end ones first (those of the files
  # with the most slow tests first), so that the short ones fill the end and no worker idles
  # while another finishes a long test. (`--dist loadfile` was measured slower on the whole
  # suite, 55:39 against 43:39 for a tree of 24 tests fewer: heavy files pinned to one worker ran side by side and the
  # largest single tests came last, as xdist reorders files by their test count.)
  def slow(item):
    return item.get_closest_marker("slow") is not None
  per_file = collections.Counter(item.path for item in items if slow(item))
  items.sort(key=lambda item: (not slow(item), -per_file[item.path]))
