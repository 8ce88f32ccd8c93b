"""Gives every test 8 emulated CPU devices and a shared XLA cache (set before jax is imported)."""
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The test processes share the subprocesses' persistent XLA cache: the same program (a
# 1-device reference run, a model every test builds) compiles once per suite run.
from tests import subproc  # pylint: disable=g-import-not-at-top,wrong-import-position

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", subproc.CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: an end-to-end test that takes over ~20 s on 2 cores (deselect: -m 'not slow')")
