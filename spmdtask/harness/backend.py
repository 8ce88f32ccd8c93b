"""spmdtask as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`, registered as
`spmdtask`): its requests become `harness.programs`' batches on the job's mesh.

Text becomes tokens as lm-eval's own `hf` backend makes them, so that scores compare:
  - loglikelihood (context, continuation): lm-eval's `TemplateLM` splits the pair (the
    context's trailing spaces go to the continuation; an empty context is the prefix
    token); the row is (context + continuation)[-(max_length + 1):], scored on the
    continuation's tokens: (sum of log-probs, every token the argmax).
  - loglikelihood_rolling (text): lm-eval's rolling windows of `max_length` tokens after the
    prefix token (`lm_eval.utils.get_rolling_token_windows`), every token scored once; the
    windows' sum.
  - generate_until (context, gen_kwargs): the context left-truncated to max_length -
    max_gen_toks, continued greedily (or at the request's temperature) until a stop id or
    max_gen_toks tokens, decoded without special tokens and cut at the first `until` string
    (the tokenizer's eos text added to them, as lm-eval does).
Encoding adds the tokenizer's special tokens (its post-processor) unless the text starts
with the begin-of-sequence token's text already (a chat template's rendering).
`apply_chat_template` renders lm-eval's chat history with the job's chat template
(`--apply_chat_template`); lm-eval calls it when asked.
"""
import dataclasses
import json
from typing import Any, Callable

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)

from spmdtask.errors import ConfigError
from spmdtask.harness.programs import Generator, Sampling, Scorer

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's


@dataclasses.dataclass(frozen=True)
class Text:
  """The job's tokenizer as lm-eval's requests need it (`harness.command.text_of` makes it)."""
  name: str                                   # the tokenizer's file (lm-eval's cache key)
  encode: Callable[[str], list[int]]          # the tokenizer's special tokens added
  encode_plain: Callable[[str], list[int]]    # none added
  decode: Callable[[list[int]], str]          # special tokens dropped
  eos: str | None                             # the end-of-sequence token's text ...
  eos_id: int                                 # ... and id: a stop, and the prefix without bos
  bos: str | None = None                      # the begin-of-sequence token's text and id
  bos_id: int | None = None
  chat: Any = None  # the job's `inputs.chat.Chat` (--apply_chat_template), or None


@register_model("spmdtask")
class SpmdtaskLm(TemplateLM):
  """lm-eval's model: the restored params of a job on its mesh (module doc)."""

  def __init__(self, scorer: Scorer, generator: Generator, padded_params, text: Text,
               max_length: int, stop_ids: tuple[int, ...] = ()):
    super().__init__()
    self.scorer, self.generator, self.params, self.text = scorer, generator, padded_params, text
    self._max_length = max_length
    self.stop_ids = tuple(dict.fromkeys(
        tuple(stop_ids) + (() if text.eos_id is None else (text.eos_id,))))

  @property
  def eot_token_id(self) -> int:
    return self.text.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.text.eos_id if self.text.bos_id is None else self.text.bos_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def tokenizer_name(self) -> str:
    return self.text.name

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
    del kwargs
    if add_special_tokens is None:
      add_special_tokens = not (self.text.bos and string.startswith(self.text.bos))
    return (self.text.encode if add_special_tokens else self.text.encode_plain)(string)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    del disable_tqdm, kwargs
    rows = [((context + continuation)[-(self.max_length + 1):], len(continuation))
            for _, context, continuation in requests]
    out = self.scorer.score(self.params, rows)
    for (key, _, _), answer in zip(requests, out):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, answer)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for context, continuation in map(lm_utils.make_disjoint_window,
                                       lm_utils.get_rolling_token_windows(
                                           token_list=self.tok_encode(string),
                                           prefix_token=self.prefix_token_id,
                                           max_seq_len=self.max_length, context_len=1)):
        windows.append((None, context, continuation))
        owner.append(i)
    sums = [0.0] * len(requests)
    for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
      sums[i] += logp
    for req, total in zip(requests, sums):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return sums

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    del disable_tqdm
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):  # one batch shape per set of generation kwargs
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    out = [""] * len(requests)
    eos_text = self.text.eos
    for members in groups.values():
      kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), DEFAULT_MAX_GEN_TOKS)
      until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
      how = self._sampling(kwargs)
      room = self.max_length - how.max_new
      prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in members]
      for i, new in zip(members, self.generator.generate(self.params, prompts, how)):
        out[i] = postprocess_generated_text(self.text.decode(new), until, None)
        self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
    return out

  def _sampling(self, kwargs: dict) -> Sampling:
    """The decode settings of one request's normalized generation kwargs."""
    max_new = int(kwargs.pop("max_gen_toks"))
    if not 0 < max_new < self.max_length:
      raise ConfigError(f"A task asks for max_gen_toks={max_new} new tokens; the model holds "
                        f"{self.max_length} tokens (task.model.max_seq_len), prompt included. "
                        "Lower the task's generation_kwargs max_gen_toks below that.")
    sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
    return Sampling(max_new, self.stop_ids,
                    float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                    int(kwargs.get("top_k") or 0) if sampled else 0,
                    float(kwargs.get("top_p") or 1.0) if sampled else 1.0)

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The history rendered with the job's chat template; without a generation prompt the
    last message is left open (transformers' continue_final_message: the text ends with
    its content). Called only where `Text.chat` is set (--apply_chat_template)."""
    text = self.text.chat.template.render(chat_history, add_generation_prompt).text
    if not add_generation_prompt:
      last = chat_history[-1]["content"].strip()
      text = text[:text.rindex(last) + len(last)]
    return text

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    del chat_template
    return None if self.text.chat is None else self.text.chat.template.source
