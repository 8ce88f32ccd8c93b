"""Gives every test 8 emulated CPU devices, compiled at LLVM -O0 (set before jax is imported)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.subproc import EXTRA_XLA_FLAGS, FAST_COMPILE  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") +
    f" {FAST_COMPILE} {EXTRA_XLA_FLAGS} --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: an end-to-end test that takes over ~20 s on 2 cores (deselect: -m 'not slow')")


def pytest_collection_modifyitems(items):
  # xdist hands tests out in this order: the long end-to-end ones first, so that the short ones
  # fill the end and no worker idles while another finishes a long test. (The expensive
  # fixtures those share with short tests are session-scoped: the split sets them up once.)
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
