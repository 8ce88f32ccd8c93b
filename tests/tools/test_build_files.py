"""The Bazel view stays in sync: every module and test file has a target with the right deps."""
import os
import re

from tools import update_build


def test_every_python_file_has_a_target():
  for package in update_build.PACKAGES:
    build = open(os.path.join(update_build.ROOT, package, "BUILD")).read()
    srcs = set(re.findall(r'srcs = \["([^"]+)"\]', build))
    files = {f for f in os.listdir(os.path.join(update_build.ROOT, package)) if f.endswith(".py")}
    assert files == srcs, f"{package}/BUILD: missing {files - srcs}, extra {srcs - files}"
    for f in files:
      if package.startswith("tests") and f.startswith("test_"):
        assert re.search(rf'py_test\(\n    name = "{f[:-3]}"', build), f


def test_build_files_are_current():
  assert update_build.main(["--check"]) == 0, "run python tools/update_build.py"
