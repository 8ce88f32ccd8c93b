"""--mode=lm_eval against lm-eval's own `hf` backend (tests/run/data/lm_eval: a tiny HF Llama,
local task files, and what lm-eval[hf] gave on them with torch; none of it needs torch here).

One import, one backend on the 8 emulated devices (requests batched over the data axes), the
three tasks and the chat-templated generation scored once for the whole module.
"""
import json
import os

import numpy as np
import pytest

from spmdtask import console
from spmdtask.errors import ConfigError
from spmdtask.hf.jobs import imports
from spmdtask.hf import model_overrides
from spmdtask.harness import command, tasks
from spmdtask.run import rollout
from tests import subproc, util

DATA = os.path.join(subproc.REPO, "tests", "harness", "data", "lm_eval")
TASK_DIR = os.path.join(DATA, "tasks")
NAMES = ("tiny_mc", "tiny_ppl", "tiny_gen")


def import_run(job: str):
  """The import of the fixture model into `job` and its run config (its flagfile's lines)."""
  imports.from_hf(os.path.join(DATA, "model"), job)
  return run_of(job)


def run_of(job: str, *more: str):
  """The run config of the import in `job` (its flagfile's lines, then `more` overrides)."""
  with open(os.path.join(job, model_overrides.OVERRIDES_FILE)) as f:
    lines = [l.strip().split("=", 1)[1] for l in f if l.startswith("--fdl_set=")]
  return util.build_run("llama.LlamaImport", lines + list(more))


def offline(monkeypatch) -> None:
  """No network for datasets: as HF_HUB_OFFLINE=1 does (read when they were imported)."""
  import datasets.config  # pylint: disable=import-outside-toplevel
  import huggingface_hub.constants  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
  """(lm-eval's results of the three tasks, of the generation task with the chat template,
  the job dir, the checkpoint step, the backend, its run config)."""
  job = str(tmp_path_factory.mktemp("lm_eval") / "import")
  run = import_run(job)
  text = command.text_of(run, apply_chat_template=True)
  lm, step = tasks.backend(run, text, 8, job, None, rollout.example(run))
  with pytest.MonkeyPatch.context() as patch:  # the YAMLs' data_files: from TASK_DIR
    offline(patch)
    manager = tasks.find_tasks(NAMES, TASK_DIR)
    plain = tasks.evaluate(lm, tasks.Options(NAMES, TASK_DIR), manager)
    chat = tasks.evaluate(
        lm, tasks.Options(("tiny_gen",), TASK_DIR, apply_chat_template=True), manager)
  return plain, chat, job, step, lm, run


def responses(results: dict, task: str) -> list:
  """Each document's responses as expected.json holds them (JSON: tuples as lists)."""
  docs = sorted(results["samples"][task], key=lambda s: s["doc_id"])
  return json.loads(json.dumps([s["resps"] for s in docs]))


def leaves(tree) -> list:
  return [x for y in tree for x in leaves(y)] if isinstance(tree, list) else [tree]


@pytest.fixture(scope="module")
def want():
  with open(os.path.join(DATA, "expected.json")) as f:
    return json.load(f)


def test_log_likelihoods_metrics_and_greedy_strings_equal_lm_evals_hf_backend(scored, want):
  plain, chat = scored[:2]
  # Per request: log p of the continuation, float32 sums in two frameworks' op orders (measured:
  # 3.8e-6 on the choices, 3.5e-5 on the 2391-nat text of several windows), is_greedy exactly.
  assert sum(x is True for x in leaves(want["tiny_mc"]["responses"])) == 4  # greedy choices
  for task in ("tiny_mc", "tiny_ppl"):
    got, ref = leaves(responses(plain, task)), leaves(want[task]["responses"])
    assert len(got) == len(ref), task
    for g, r in zip(got, ref):
      assert type(g) is type(r) and abs(g - r) <= 1e-4, (task, g, r)  # bools: is_greedy
  for results, ref in ((plain, want["tiny_gen"]), (chat, want["chat"])):
    assert responses(results, "tiny_gen") == ref["responses"]
  # The metrics: acc / exact_match exactly; perplexities are exp of the sums above (relative
  # 1e-6 of a sum of ~200 nats moves them by ~2e-4 relative: 1e-5 of a 5e8 perplexity is
  # loose enough for the float32 noise and far below a changed token).
  for task, results in (("tiny_mc", plain), ("tiny_ppl", plain), ("tiny_gen", plain),
                        ("chat", chat)):
    name = "tiny_gen" if task == "chat" else task
    got, ref = tasks.metrics_of(results)[name], want[task]["metrics"]
    for key, value in ref.items():
      if "," not in key or not isinstance(value, float):
        continue
      metric = key.split(",")[0]
      np.testing.assert_allclose(got[metric], value, rtol=1e-5, err_msg=f"{task} {metric}")


def test_a_vocab_tiled_head_scores_the_same(scored, want):
  """The scorer runs the model's own head (`token_scores`): with the loss over 4 vocab
  tiles the argmax is found per tile, and the choices' numbers stay lm-eval's."""
  job = scored[2]
  run = run_of(job, "task.model.loss_vocab_tiles=4")
  lm, _ = tasks.backend(run, command.text_of(run, False), 8, job, None, rollout.example(run))
  with pytest.MonkeyPatch.context() as patch:
    offline(patch)
    options = tasks.Options(("tiny_mc",), TASK_DIR)
    got = tasks.evaluate(lm, options, tasks.find_tasks(options.tasks, TASK_DIR))
  pairs = list(zip(leaves(responses(got, "tiny_mc")), leaves(want["tiny_mc"]["responses"])))
  assert len(pairs) == 80 and sum(r is True for _, r in pairs) == 4
  for g, r in pairs:
    assert type(g) is type(r) and abs(g - r) <= 1e-4, (g, r)  # bools: is_greedy


def test_writes_results_samples_summaries_and_a_console_table(scored, capsys, monkeypatch):
  plain, _, job, step = scored[:4]
  monkeypatch.setattr(console, "_echo", True)
  path = tasks.write(job, step, plain, 1.0)
  assert path == os.path.join(job, "lm_eval", f"results_step{step}.json")
  with open(path) as f:
    written = json.load(f)
  assert written["results"]["tiny_mc"]["acc,none"] == plain["results"]["tiny_mc"]["acc,none"]
  assert "samples" not in written and set(written["configs"]) == set(NAMES)
  for task in NAMES:
    with open(os.path.join(job, "lm_eval", f"samples_{task}_step{step}.jsonl")) as f:
      assert len(f.readlines()) == len(plain["samples"][task])
  scalars = subproc.scalars(os.path.join(job, "summaries", "lm_eval"))
  acc = plain["results"]["tiny_mc"]["acc,none"]
  assert scalars["tiny_mc/acc"] == {step: pytest.approx(acc)}
  assert set(scalars) >= {"tiny_ppl/word_perplexity", "tiny_ppl/bits_per_byte",
                          "tiny_gen/exact_match"}
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f"lm_eval step {step}: 3 tasks in 1.0 s"
  assert out[1] == "  tiny_mc: acc 0.0000 ± 0.0000  acc_norm 0.0000 ± 0.0000"
  assert out[2].startswith("  tiny_ppl: word_perplexity 5377919") and "bits_per_byte 6.93" in out[2]
  assert out[-1] == f"lm_eval: wrote {path} (and the samples beside it)"
  # A second run on the same step keeps the first's files and writes beside them.
  chat = scored[1]
  again = tasks.write(job, step, chat, 1.0)
  assert again == os.path.join(job, "lm_eval", f"results_step{step}_run2.json")
  with open(path) as f:
    assert json.load(f) == written
  with open(again) as f:
    assert set(json.load(f)["configs"]) == {"tiny_gen"}
  assert os.path.exists(os.path.join(job, "lm_eval", f"samples_tiny_gen_step{step}_run2.jsonl"))
  assert tasks.free_suffix(os.path.join(job, "lm_eval"), step) == "_run3"


def test_bad_tasks_exit_2_naming_the_fix(scored, tmp_path, monkeypatch):
  with pytest.raises(ConfigError, match=r"--lm_eval_include_path=.* is not a directory"):
    tasks.find_tasks(("tiny_mc",), str(tmp_path / "nowhere"))
  with pytest.raises(ConfigError, match="needs --tasks"):
    tasks.find_tasks((), TASK_DIR)
  known = tasks.find_tasks(NAMES, TASK_DIR).all_tasks  # the local tasks alone
  with pytest.raises(ConfigError, match=r"named 'tiny_mcq' \(close: tiny_mc, .*include_path=DIR"):
    tasks.check_known(("tiny_mc", "tiny_mcq"), known)
  # A task whose dataset is on the Hub, offline: how to point it at local files.
  (tmp_path / "remote.yaml").write_text(
      "task: remote_qa\ndataset_path: nobody/no_such_dataset\ntest_split: test\n"
      "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
      "metric_list:\n  - metric: exact_match\n")
  offline(monkeypatch)
  manager = tasks.find_tasks(("remote_qa",), str(tmp_path))
  with pytest.raises(ConfigError, match=r"dataset_path: json.*data_files.*include_path"):
    tasks.evaluate(scored[4], tasks.Options(("remote_qa",), str(tmp_path)), manager)


def test_the_binary_refuses_lm_eval_flags_elsewhere_and_a_job_without_a_tokenizer(tmp_path):
  """Run as the binary (forked from one import: subproc.run_mains): exit 2, one paragraph."""
  cases = [(["--mode=decode", "--tasks=tiny_mc"], "--tasks only apply to --mode=lm_eval"),
           (["--mode=lm_eval", "--tasks=tiny_mc"], "--mode=lm_eval needs the experiment's "
            "tokenizer")]
  outs = subproc.run_mains([subproc.main_cmd("lm.TinyLm", str(tmp_path / str(i)), flags=f)
                            for i, (f, _) in enumerate(cases)])
  for (flags, needle), out in zip(cases, outs):
    assert out.returncode == 2 and "Traceback" not in out.stderr, (flags, out.stderr[-2000:])
    (line,) = [l for l in out.stderr.splitlines() if l.startswith("spmdtask: config error:")]
    assert needle in line, (flags, line)


def test_a_batch_of_requests_must_split_over_the_data_shards(scored):
  run, job = scored[5], scored[2]
  text = command.text_of(run, apply_chat_template=False)
  with pytest.raises(ConfigError, match=r"--lm_eval_batch_size=12: .*multiple of 8"):
    tasks.backend(run, text, 12, job, None, rollout.example(run))
