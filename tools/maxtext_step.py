"""Compiles MaxText's train step with MaxText's own `train_compile` and writes what XLA:TPU
made of it, for tools/compare_maxtext.py. Runs under MaxText's Python (no spmdtask import):

    cd MAXTEXT && DECOUPLE_GCLOUD=TRUE PYTHONPATH=.:src MAXTEXT_PYTHON \\
        SPMDTASK/tools/maxtext_step.py OUT_DIR [--benchmark=MODULE:NAME] \\
        src/maxtext/configs/base.yml compile_topology=v5e-256 model_name=llama3-8b ...

`--benchmark=maxtext_trillium_model_configs:llama3_1_8b_8192` reads one of MaxText's
published tuning configs from its `benchmarks/` package (a `MaxTextModel`): its
`model_type` becomes `model_name=`, each of its `tuning_params` a `key=value` argument (but
the profiler's and the dataset path's, which a compile does not use), and its `xla_flags`
go before LIBTPU_INIT_ARGS, as MaxText's benchmark runner sets them; `key=value` arguments
given after it override its values. A tuning key this MaxText's base.yml no longer has is
left out and listed in config.json (`deepseek3_671b_v5p_1024`'s tile_batch_seq 512,
tile_embed_dim 1024, tile_mlp_dim 1024 at e591f30cb: renamed wi_tile_* / wo_tile_*, whose
defaults are those same 512 / 1024 / 1024).

How the compiled step is taken out without editing MaxText: this process imports
`maxtext.trainers.pre_train.train_compile`, wraps its module-level `jit_and_compile` (the
function its `main` calls to jit, lower and compile the train step) so that the compiled
object it returns is kept, and then runs that module's `main` with the arguments given.
Everything else (config, mesh, shardings, LIBTPU_INIT_ARGS from the environment) is
MaxText's. OUT_DIR then holds:
  hlo.txt      the optimized per-device HLO (`compiled.as_text()`);
  memory.json  every numeric field of `compiled.memory_analysis()`;
  cost.json    `compiled.cost_analysis()` (XLA's, each loop body counted once);
  config.json  the arguments train_compile got and the LIBTPU_INIT_ARGS it ran under.

MaxText asks for Python >= 3.12, but its train step's import graph uses only one 3.12-only
construct: the `type NAME = ...` alias statement (src/maxtext/kernels/mhc/api.py and
common.py as of e591f30cb). Under Python 3.11 this process loads MaxText's modules through
`_Py311Aliases`, which rewrites each such line into the plain assignment `NAME = ...` (the
same alias for every use there: annotations) before compiling it; MaxText's files on disk are
not touched.
"""
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys

_TYPE_ALIAS = re.compile(rb"^type (\w+) = ", re.MULTILINE)


class _Py311Aliases(importlib.abc.MetaPathFinder):
  """Finds `maxtext.*` modules as the path finder does, compiling `type X = Y` as `X = Y`."""

  class Loader(importlib.machinery.SourceFileLoader):

    def source_to_code(self, data, path, *, _optimize=-1):  # pylint: disable=arguments-differ
      return super().source_to_code(_TYPE_ALIAS.sub(rb"\1 = ", data), path)

  def find_spec(self, fullname, path=None, target=None):
    if fullname.split(".")[0] != "maxtext":
      return None
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
      spec.loader = self.Loader(fullname, spec.origin)
    return spec


def _numbers(obj) -> dict:
  return {k: getattr(obj, k) for k in dir(obj)
          if not k.startswith("_") and isinstance(getattr(obj, k), (int, float))}


DROPPED: list[str] = []  # benchmark tuning keys this MaxText's base.yml no longer has

# Tuning params a compile does not read (the profiler's; a dataset path for synthetic data).
_NOT_FOR_COMPILE = ("profiler", "skip_first_n_steps_for_profiler", "profiler_steps",
                    "dataset_path")


def benchmark_args(spec: str, args: list[str]) -> list[str]:
  """`args` (the config yml first) with MaxText's benchmark config `spec` put before the
  overrides; its XLA flags prepended to LIBTPU_INIT_ARGS. A tuning key the config yml does
  not know (MaxText refuses unknown keys) is left out and named in DROPPED."""
  import importlib  # pylint: disable=import-outside-toplevel
  module, name = spec.split(":")
  model = getattr(importlib.import_module(f"benchmarks.{module}"), name)
  given = {a.split("=", 1)[0] for a in args[1:]}
  with open(args[0]) as f:  # the keys MaxText's config (base.yml) accepts
    known = {m.group(1) for m in re.finditer(r"^(\w+):", f.read(), re.MULTILINE)}
  params = {"model_name": model.model_type, **model.tuning_params}
  DROPPED.extend(k for k in params if k not in known and k not in _NOT_FOR_COMPILE)
  tuned = [f"{k}={v}" for k, v in params.items()
           if k not in _NOT_FOR_COMPILE and k not in given and k not in DROPPED]
  os.environ["LIBTPU_INIT_ARGS"] = (model.xla_flags + " "
                                    + os.environ.get("LIBTPU_INIT_ARGS", "")).strip()
  return args[:1] + tuned + args[1:]


def main() -> None:
  if len(sys.argv) < 2 or sys.argv[1].startswith("-"):  # --help, or no OUT_DIR: never a dir
    print(__doc__.split("\n\n")[1] if len(sys.argv) > 1 else __doc__, file=sys.stderr)
    sys.exit(2)
  out, rest = sys.argv[1], sys.argv[2:]
  if sys.version_info < (3, 12):
    sys.meta_path.insert(0, _Py311Aliases())
  if rest and rest[0].startswith("--benchmark="):
    rest = benchmark_args(rest[0].split("=", 1)[1], rest[1:])
  argv = [sys.argv[0]] + rest
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({"argv": rest, "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
               "dropped_benchmark_keys": DROPPED}, f, indent=1)
  from absl import flags  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel
  flags.FLAGS(argv[:1])  # what absl's app.run would have parsed: no flags of its own
  kept = []
  compile_step = train_compile.jit_and_compile

  def keep(*args, **kwargs):
    kept.append(compile_step(*args, **kwargs))
    return kept[-1]

  train_compile.jit_and_compile = keep
  train_compile.main(argv)
  compiled = kept[-1]
  with open(os.path.join(out, "hlo.txt"), "w") as f:
    f.write(compiled.as_text())
  with open(os.path.join(out, "memory.json"), "w") as f:
    json.dump(_numbers(compiled.memory_analysis()), f, indent=1)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  with open(os.path.join(out, "cost.json"), "w") as f:
    json.dump({k: float(v) for k, v in (cost or {}).items()}, f, indent=1)
  print(f"maxtext_step: wrote {out}/hlo.txt, memory.json, cost.json", flush=True)


if __name__ == "__main__":
  main()
