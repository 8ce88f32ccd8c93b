"""tools/prepare_pref_data.py and tools/precompute_ref_logps.py on the chat fixtures: TRL's
three preference formats read back as pairs whose targets are each completion and its end of
turn; the precomputed reference log-probs equal the in-step ones; a pair whose chosen and
rejected are identical exits 2 with one paragraph, nothing written."""
import json
import os

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

from spmdtask import main
from spmdtask.inputs.preferences import PreferenceInput
from spmdtask.objectives import dpo
from tools import precompute_ref_logps, prepare_pref_data

CHATML = "tests/inputs/data/chat/chatml"
PREFS = "tests/tools/data/dpo/prefs.jsonl"
SEQ = 95


def _run(capsys, *argv):
  try:
    prepare_pref_data.main(list(argv))
    code = 0
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("prefs") / "data")
  meta = prepare_pref_data.prepare(PREFS, CHATML, out, max_len=SEQ + 1, eval_fraction=0.3)
  return out, meta


def test_pairs_read_back_with_each_completion_and_its_end_of_turn_as_targets(prepared):
  out, meta = prepared
  assert meta["preferences"] and meta["splits"]["train"]["num_pairs"] == 3
  assert meta["splits"]["eval"]["num_pairs"] == 2 and meta["dropped"] == 0
  tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  got = set()
  for split in ("train", "eval"):
    inp = PreferenceInput(data_dir=out, split=split, batch_size=4, seq_len=SEQ,
                          process_index=0, process_count=1)
    b = inp.batch_at(0)
    assert b["inputs"].shape == (4, 2, SEQ)  # pairs wrap around the split
    for p in range(inp.num_pairs):
      texts = tuple(tok.decode(b["targets"][p, i][b["weights"][p, i] > 0].tolist(),
                               skip_special_tokens=False) for i in (0, 1))
      prompt_c, prompt_r = (b["inputs"][p, i][b["weights"][p, i] == 0] for i in (0, 1))
      got.add(texts)
      # Chosen and rejected share the prompt: the tokens before the first target.
      first = [int(np.argmax(b["weights"][p, i] > 0)) for i in (0, 1)]
      assert first[0] == first[1]
      assert (b["inputs"][p, 0, :first[0] + 1] == b["inputs"][p, 1, :first[1] + 1]).all()
  assert got == {("Paris.<|im_end|>", "Rome, I think.<|im_end|>"),
                 ("Blue.<|im_end|>", "A number: 7.<|im_end|>"),  # after a system prompt
                 ("4.<|im_end|>", "5, or so.<|im_end|>"),  # implicit prompt
                 ("blue.<|im_end|>", "made of cheese.<|im_end|>"),  # plain text, eos
                 ("Hello!<|im_end|>", "No.<|im_end|>")}


def test_precomputed_reference_logps_equal_the_in_step_ones(prepared):
  out, meta = prepared
  sets = [f"task.model.vocab_size={meta['vocab_size']}"] + [
      f"datasets['{s}'].prepared.seq_len={SEQ}" for s in ("train", "eval")]
  got = precompute_ref_logps.precompute("TinyLmDpo", out, sets)
  assert {k: v.shape for k, v in got.items()} == {"train": (3, 2), "eval": (2, 2)}
  # What the step would compute: under the fresh init (the reference without a checkpoint).
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from spmdtask.core import train_state  # pylint: disable=g-import-not-at-top
  run = fdl.build(main.resolved_config(
      "TinyLmDpo", sets + ["task.objective.reference='precomputed'"], out))
  batch = run.datasets["train"].batch_at(0)  # reads train_ref_logps.npy
  np.testing.assert_array_equal(batch["ref_logps"], got["train"][[0, 1, 2, 0, 1, 2, 0, 1]])
  model, rows = run.task.model, run.task.objective.model_batch(batch)
  params = nn.unbox(train_state.init_params(model, jax.random.key(run.task.train.seed), rows))
  want = jax.jit(lambda p, r: dpo.sequence_logps(model, p, r).reshape(-1, 2))(params, rows)
  np.testing.assert_allclose(got["train"][[0, 1, 2, 0, 1, 2, 0, 1]], want, rtol=1e-5)


def test_identical_chosen_and_rejected_exit_2_naming_the_line(tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  lines = open(PREFS).read().splitlines()
  same = json.loads(lines[0])
  same["rejected"] = same["chosen"]
  bad.write_text("\n".join([lines[1], json.dumps(same)]) + "\n")
  out = tmp_path / "data"
  code, _, err = _run(capsys, f"--input={bad}", f"--tokenizer={CHATML}", f"--output_dir={out}",
                      "--max_len=96")
  assert code == 2 and not out.exists()
  msg = err.strip().split("config error: ", 1)[1]
  assert "\n" not in msg and f"{bad}:2: " in msg and "identical" in msg, msg


def _tree(d):
  return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
          for r, _, fs in os.walk(d) for f in fs}


def test_the_hint_continues_the_model_and_a_bad_byte_leaves_the_dir_as_it_was(tmp_path, capsys):
  out = tmp_path / "data"
  args = [f"--tokenizer={CHATML}", f"--output_dir={out}", "--max_len=96"]
  code, stdout, err = _run(capsys, f"--input={PREFS}", *args)
  assert code == 0, err
  assert f"{out}: 5 pairs read; vocab_size=300; train: 4 pairs" in stdout
  assert stdout.splitlines()[-3:] == [
      "Align your fine-tuned model on it (DPO; its reference is the start):",
      f"  python -m spmdtask.main --exp=stages.Dpo --job_log_dir={out}_dpo "
      f"--init_from=IMPORT_DIR --data_dir={out}",
      f"  (IMPORT_DIR: your model's job dir, from python tools/convert_hf.py "
      f"--from_hf={os.path.abspath(CHATML)} --job_log_dir=IMPORT_DIR, or the job dir of the "
      "stage before)"]
  before = _tree(out)
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(open(PREFS, "rb").read().replace(b"Paris", b"Par\xeds"))
  code, stdout, err = _run(capsys, f"--input={bad}", *args, "--overwrite")
  assert code == 2 and not stdout
  msg = err.strip().split("config error: ", 1)[1]
  assert "\n" not in msg and msg.startswith(f"{bad}:1: byte ") and "is not UTF-8" in msg, msg
  assert _tree(out) == before
