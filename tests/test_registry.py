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


def test_listing_groups_each_experiment_with_its_purpose_within_100_columns():
  lines = registry.listing()
  assert lines[0].startswith(f"{len(registry.names())} experiments; pass one as --exp=NAME")
  assert max(map(len, lines)) <= 100
  heads = [l.split(":")[0] for l in lines if l and not l.startswith(" ")][1:]
  assert heads[:5] == ["pretrain", "fine-tune", "align", "families", "tiny"]
  rows = {l.split()[0]: l for l in lines if l.startswith("  ") and not l.startswith("   ")}
  # Every registered experiment once, by its shortest --exp spelling under configs/.
  assert set(rows) >= {n.removeprefix("configs.") for n in registry.names()
                       if n.startswith("configs.")}
  assert rows["lm.TinyLm"].split(None, 1)[1] == ("1.05M-param LM on synthetic data; all "
                                                 "devices data parallel.")
  section = lines[lines.index(next(l for l in lines if l.startswith("families:"))):]
  assert section.index(rows["qwen3.Qwen3Import"]) < section.index(rows["lm.TinyLm"])


def test_summary_is_the_first_sentence_outside_brackets_or_a_cut_at_a_clause():
  cls = type("X", (Experiment,), {"__doc__": "Big model (a. b; c) on v5e. More text here."})
  assert registry.summary(cls) == "Big model (a. b; c) on v5e."
  cls.__doc__ = "Summary line.\n\n  Details (long) follow. And more."
  assert registry.summary(cls) == "Summary line."
  cls.__doc__ = "A model on a slice: " + "word " * 40
  assert registry.summary(cls, limit=60) == "A model on a slice"
  cls.__doc__ = "word " * 40
  assert registry.summary(cls, limit=20) == "word word word..."
  assert Experiment.group == "other" and registry.get("lm.TinyLm").group == "tiny"
