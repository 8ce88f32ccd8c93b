"""Experiment lookup: full name, dotted suffix, module path; did-you-mean errors."""
import pytest

from spmdtask import registry
from spmdtask.errors import ConfigError
from spmdtask.experiment import Experiment


def test_lookup_by_full_name_suffix_and_listing():
  cls = registry.get("configs.lm.TinyLm")
  assert registry.get("lm.TinyLm") is cls and registry.get("TinyLm") is cls
  assert {"configs.lm.TinyLm", "configs.lm.TinyLmFsdpTp",
          "configs.lm.TinyLmUneven"} <= set(registry.names())


def test_module_path_imports_and_registers():
  cls = registry.get("tests.registered_exps.OtherLm")
  assert cls.__module__ == "tests.registered_exps"


def test_unknown_lists_close_matches():
  with pytest.raises(ConfigError, match="Close matches: .*configs.lm.TinyLmFsdpTp"):
    registry.get("TinyLmFsdTp")


def test_ambiguous_suffix_lists_candidates(monkeypatch):
  registry.get("lm.TinyLm")  # every default module imported, into the real registry
  # A second 'TinyLm', registered in a copy only: other tests in this process use the bare name.
  monkeypatch.setattr(registry, "_EXPERIMENTS", dict(registry._EXPERIMENTS))  # pylint: disable=protected-access
  second = type("TinyLm", (registry.get("lm.TinyLm"),), {"__module__": "tests.registered_exps"})
  registry.register(second)
  with pytest.raises(ConfigError, match="ambiguous: it matches configs.lm.TinyLm, "
                     "tests.registered_exps.TinyLm"):
    registry.get("TinyLm")
  assert registry.get("lm.TinyLm") is not registry.get("registered_exps.TinyLm")


def test_register_twice_is_an_error():
  class TinyLm(Experiment):  # same qualified name as a registered class, different class
    pass
  TinyLm.__module__, TinyLm.__qualname__ = "configs.lm", "TinyLm"
  with pytest.raises(ConfigError, match="registered twice"):
    registry.register(TinyLm)
