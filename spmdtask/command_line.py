"""The command line's text: the rerun and restore commands a message gives, the paragraph
for a flag absl cannot parse, and --prompt / --chat turned into the decode's prompts."""
import re
import shlex

from spmdtask.errors import ConfigError


def restore_command(argv: list[str], step: int) -> str:
  """This run's command line with --restore_step=`step` in place of any given."""
  return f"{rerun_command(argv)} --restore_step={step}"


def rerun_command(argv: list[str]) -> str:
  """This run's command line without any --restore_step (a rerun resumes the newest)."""
  args, skip = [], False
  for a in argv[1:]:
    if skip or a.startswith("--restore_step="):
      skip = False
      continue
    if a == "--restore_step":  # absl also takes `--flag value`
      skip = True
      continue
    args.append(a)
  return shlex.join(["python", "-m", "spmdtask.main", *args])


def flag_error(error: Exception) -> str:
  """The paragraph for a flag absl cannot parse (a value not among an enum's names, a
  malformed number, an unknown flag)."""
  enum = re.match(r"flag --(\w+)=(.*): value should be one of <(.*)>$", str(error))
  if enum:
    name, value, choices = enum.group(1), enum.group(2), enum.group(3).split("|")
    return (f"--{name}={value!r} is not one of its values: {', '.join(choices)}. Pass one of "
            f"them, e.g. --{name}={choices[0]} (--helpshort describes each).")
  text = str(error).strip().replace(" ?", "?")
  return (f"{text}{'' if text.endswith(('.', '?')) else '.'} Fix or remove that flag; python -m "
          "spmdtask.main --helpshort lists every flag with its values.")


def own_prompts(run_cfg, texts: list[str], chat_question: str | None, raw: bool, exp: str):
  """`run_cfg` decoding the texts of --prompt / --prompts_file and `chat_question` (--chat),
  rendered with the job's chat template where it has one (unless `raw`: --raw_prompt)."""
  # pylint: disable-next=g-import-not-at-top
  from spmdtask.inputs import own_prompts as own, prompts
  from spmdtask.run import decoding  # pylint: disable=g-import-not-at-top
  if chat_question is not None and raw:
    raise ConfigError("--chat renders its question with the job's chat template and "
                      "--raw_prompt asks for no template: give --prompt=TEXT --raw_prompt for "
                      "a plain continuation, or drop --raw_prompt.")
  chat = None if raw else own.job_chat(run_cfg.datasets, run_cfg.decode_datasets)
  if chat_question is not None:
    if chat is None:
      raise ConfigError(
          f"--chat={chat_question!r} is rendered with the job's chat template, and --exp="
          f"{exp} has none: no dataset reads prepared conversations and its decode "
          "tokenizer's dir holds no chat template. Add --data_dir=DIR (a dir "
          "tools/prepare_chat_data.py wrote) or the import's --flagfile, or continue plain "
          "text with --prompt=TEXT --raw_prompt.")
    if not chat_question.strip():
      raise ConfigError("--chat is empty; give the question to ask, e.g. --chat='What is 1 + 2?'.")
    texts = texts + [chat_question]
  return decoding.with_own_prompts(run_cfg, texts, prompts.TokenizedPrompts, chat)
