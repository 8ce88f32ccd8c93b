"""`python -m spmdtask.main --mode=lm_eval --tasks=a,b`: its flags, and the job's text side;
`train_hooks`: --mode=train's eval on `task.train.lm_eval_tasks` (`harness.training`).

The binary defines these flags by importing this module (lm-eval itself is imported only
when the mode runs: `harness.tasks`). The job's tokenizer is its decode tokenizer (an
import's: `decode_datasets['prompts'].default.tokenizer` in its model_overrides.txt), its
begin- and end-of-sequence tokens those of the tokenizer_config.json beside it, and its chat
template the one --mode=decode uses (`inputs.own_prompts.job_chat`).
"""
from absl import flags

from spmdtask import fs
from spmdtask.errors import ConfigError

_TASKS = flags.DEFINE_list(
    "tasks", None, "--mode=lm_eval: lm-evaluation-harness tasks, groups or tags to score, "
    "comma-separated (e.g. hellaswag,arc_easy); results go to job_log_dir/lm_eval/.")
_INCLUDE = flags.DEFINE_string(
    "lm_eval_include_path", None, "--mode=lm_eval: a dir of your own lm-eval task YAML files "
    "(e.g. on local JSONL files: dataset_path: json, dataset_kwargs: {data_files: ...}).")
_FEWSHOT = flags.DEFINE_integer("num_fewshot", None, "--mode=lm_eval: few-shot examples per "
                                "prompt; default: each task's own.")
_LIMIT = flags.DEFINE_float("lm_eval_limit", None, "--mode=lm_eval: score only this many "
                            "documents of each task (a fraction when < 1).")
_BATCH = flags.DEFINE_integer("lm_eval_batch_size", 8, "--mode=lm_eval: rows per batch of "
                              "requests (a multiple of the data shards and processes).")
_CHAT = flags.DEFINE_bool("apply_chat_template", False, "--mode=lm_eval: render the prompts "
                          "with the job's chat template (as lm-eval's --apply_chat_template).")

FLAG_NAMES = ("tasks", "lm_eval_include_path", "num_fewshot", "lm_eval_limit",
              "lm_eval_batch_size", "apply_chat_template")


def check_mode(mode: str) -> None:
  """ConfigError where an lm_eval flag is given to another mode."""
  given = [n for n in FLAG_NAMES if flags.FLAGS[n].present]
  if given and mode != "lm_eval":
    raise ConfigError(f"--{', --'.join(given)} only apply to --mode=lm_eval.")


def text_of(run, apply_chat_template: bool, who: str = "--mode=lm_eval"):
  """The job's tokenizer, its special tokens and (`apply_chat_template`) its chat template,
  as a `harness.backend.Text`; errors name `who` asks for it."""
  # pylint: disable=g-import-not-at-top  # lm-eval (the backend's) only in this mode
  from spmdtask.inputs import chat_template, own_prompts, tokenizers
  from spmdtask.harness import backend
  from spmdtask.run import decoding
  tok = decoding.experiment_tokenizer(run, f"{who} needs")
  chat = own_prompts.job_chat(run.datasets, run.decode_datasets) if apply_chat_template else None
  if apply_chat_template and chat is None:
    raise ConfigError("--apply_chat_template renders lm-eval's prompts with the job's chat "
                      "template, and this job has none (no chat data dir, and no "
                      "chat_template.jinja beside its decode tokenizer). Use an import's "
                      "--flagfile, or drop --apply_chat_template.")
  if isinstance(tok, tokenizers.HfTokenizer):  # special tokens: tokenizer_config.json's
    special = chat_template.special_tokens(chat_template.read_config(fs.dirname(tok.model_file)))
    bos, eos = special.get("bos_token"), special.get("eos_token")
    text = backend.Text(tok.model_file, tok.encode, lambda s: tok.encoding(s).ids, tok.decode,
                        eos, tok.eod_id if eos is None else tok.token_id(eos), bos,
                        None if bos is None else tok.token_id(bos), chat)
  else:  # bytes, SentencePiece: no special tokens but the end of a document
    text = backend.Text(type(tok).__name__, tok.encode, tok.encode, tok.decode, None,
                        tok.eod_id, chat=chat)
  if text.eos_id is None:
    raise ConfigError(f"{who} needs the tokenizer's end-of-sequence token (lm-eval's "
                      "prefix for scoring from an empty context, and a stop for generation), "
                      "and the job's decode tokenizer names none: give a Hugging Face "
                      "tokenizer.json with a tokenizer_config.json (eos_token) beside it.")
  return text


def run(run_cfg, job_log_dir: str, restore_step: int | None) -> None:
  """--mode=lm_eval on `job_log_dir`'s checkpoint (`harness.tasks.run_tasks`)."""
  # pylint: disable=g-import-not-at-top
  from spmdtask.harness import tasks
  from spmdtask.run import rollout
  include = fs.absolute(_INCLUDE.value) if _INCLUDE.value else None  # (the tasks run there)
  options = tasks.Options(tuple(_TASKS.value or ()), include, _FEWSHOT.value, _LIMIT.value,
                          _BATCH.value, _CHAT.value)
  tasks.run_tasks(run_cfg, text_of(run_cfg, _CHAT.value), options, job_log_dir, restore_step,
                  rollout.example(run_cfg))


def train_hooks(run_cfg, job_log_dir: str) -> list:
  """--mode=train's hooks for `task.train.lm_eval_*`: `harness.training.PeriodicLmEval`
  where `lm_eval_every_n_steps` > 0, else none (lm-eval is then never imported)."""
  tp = run_cfg.task.train
  if not tp.lm_eval_every_n_steps:
    return []
  # pylint: disable=g-import-not-at-top
  from spmdtask.harness import tasks, training
  include = fs.absolute(tp.lm_eval_include_path) if tp.lm_eval_include_path else None
  options = tasks.Options(tuple(tp.lm_eval_tasks), include, None, tp.lm_eval_limit,
                          tp.lm_eval_batch_size)
  text = text_of(run_cfg, False, "task.train.lm_eval_tasks")
  return [training.PeriodicLmEval(run_cfg, text, options, tp.lm_eval_every_n_steps,
                                  job_log_dir)]
