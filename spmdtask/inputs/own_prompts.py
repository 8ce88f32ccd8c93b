"""The chat template of a job, for the prompts a person gives `--mode=decode` (`--prompt`,
`--prompts_file`, `--chat`): a text becomes one user message rendered with the template and
its generation prompt, and the reply stops at the template's end-of-turn token.

A job has a chat template where it trains on prepared conversations (a dataset whose data
dir tools/prepare_chat_data.py wrote: its chat_template.jinja and tokenizer), else where its
decode tokenizer is a Hugging Face tokenizer.json whose dir holds one (an import's:
chat_template.jinja, or `chat_template` in tokenizer_config.json).
"""
from spmdtask import fs
from spmdtask.core.host_input import PromptInput
from spmdtask.inputs import chat, chat_template, tokenizers
from spmdtask.inputs.text import PackedLmInput


def job_chat(datasets: dict, decode_datasets: dict) -> chat.Chat | None:
  """The `chat.Chat` of a built run's datasets (by name) and decode datasets, or None."""
  for name, inputs in sorted(datasets.items()):
    if isinstance(inputs, PackedLmInput) and "chat" in inputs.meta:
      return chat.Chat.from_data_dir(inputs.data_dir, inputs.meta,
                                     f"datasets[{name!r}].data_dir")
  for _, inputs in sorted(decode_datasets.items()):
    tok = inputs.tokenizer if isinstance(inputs, PromptInput) else None
    if isinstance(tok, tokenizers.HfTokenizer) and chat_template.present(
        fs.dirname(tok.model_file)):
      return chat.Chat(chat_template.load(fs.dirname(tok.model_file)), tok)
  return None
