"""tools/compare_maxtext.py: the side-by-side numbers and their table, from reports alone (no
compile)."""
import sys

from tools import compare_maxtext

GIB = 2**30


def _report(temp_gib, gathers, gather_gib, xla_tflop, kernel_tflop, step_s, mfu):
  return {"compiled": {"temp_size_in_bytes": temp_gib * GIB,
                       "peak_estimate_bytes": (temp_gib + 0.5) * GIB},
          "collectives": {"all-gather": {"count": gathers, "bytes": gather_gib * GIB}},
          "flops_per_step": {"xla_per_device": (xla_tflop + kernel_tflop) * 1e12,
                             "kernels_per_device": kernel_tflop * 1e12},
          "estimate": {"step_seconds_lower_bound": step_s, "bound": "compute",
                       "mfu_upper_bound": mfu}}


def test_quantities_and_table():
  ours = compare_maxtext.quantities(_report(7.0, 320, 26.0, 400.0, 50.0, 2.5, 0.7))
  assert ours == {"temporaries GiB": 7.0, "peak GiB": 7.5, "all-gather ops": 320,
                  "all-gather GiB": 26.0, "XLA TFLOP (kernels excl.)": 400.0,
                  "kernel TFLOP": 50.0, "step bound s": 2.5, "bound by": "compute",
                  "MFU bound": 0.7}
  theirs = compare_maxtext.quantities(_report(8.0, 321, 26.0, 450.0, 50.0, 2.0, 0.875))
  theirs["all-reduce ops"] = 197  # a kind one side has and the other has not
  text = compare_maxtext.table({"cfg": {"spmdtask": ours, "maxtext": theirs}})
  lines = text.splitlines()
  assert lines[0] == "| per chip per step | cfg spmdtask | cfg MaxText | cfg ratio |"
  assert "| temporaries GiB | 7 | 8 | 0.88 |" in lines
  assert "| all-gather ops | 320 | 321 | 1.00 |" in lines
  assert "| step bound s | 2.5 | 2 | 1.25 |" in lines
  assert "| bound by | compute | compute | - |" in lines
  assert "| all-reduce ops | - | 197 | - |" in lines
  assert len(lines) == 2 + len(theirs)


def test_every_config_names_a_registered_experiment():
  from spmdtask import registry  # pylint: disable=import-outside-toplevel
  for name, cfg in compare_maxtext.CONFIGS.items():
    assert registry.get(cfg.exp), name
  int8 = compare_maxtext.CONFIGS["llama3_8b_int8_v5e256"]
  assert int8.fdl_set == ("task.model.quantization='int8'",)
  assert "quantization=int8" in int8.maxtext_args


def test_maxtext_step_compiles_py312_type_aliases_under_py311(tmp_path, monkeypatch):
  """tools/maxtext_step.py's import hook: MaxText's `type X = ...` lines load as `X = ...`."""
  from tools import maxtext_step  # pylint: disable=import-outside-toplevel
  (tmp_path / "maxtext").mkdir()
  (tmp_path / "maxtext" / "__init__.py").write_text("")
  (tmp_path / "maxtext" / "aliases.py").write_text(
      "from typing import Literal\ntype Impl = Literal['a', 'b']\nN = 3\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(sys, "meta_path", [maxtext_step._Py311Aliases(), *sys.meta_path])
  for m in ("maxtext", "maxtext.aliases"):
    monkeypatch.delitem(sys.modules, m, raising=False)
  import maxtext.aliases  # pylint: disable=import-outside-toplevel,import-error
  assert str(maxtext.aliases.Impl) == "typing.Literal['a', 'b']" and maxtext.aliases.N == 3
