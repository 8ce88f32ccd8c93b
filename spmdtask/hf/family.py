"""The seam between spmdtask's generic Hugging Face code and one model family.

A family module (llama, qwen3, moe, gemma3, deepseek) declares a `Family`: the config.json
`model_type`s it reads, the configs/ experiments its imports run (`experiment`, and with
LoRA adapters `lora_experiment`), its TransformerLm fields (`model_fields`), where each HF
tensor goes (`stacked`: our param path, HF names per layer, layout kind) and its LoRA
modules (`lora_targets`: spmdtask's LoRA target -> PEFT's `target_modules` name, for the
targets a PEFT adapter can carry). The generic modules (convert, model_overrides, peft,
merge) read only this contract, so a family is added in one module. Pure.
"""
from spmdtask.errors import ConfigError

# Our stacked param path -> (HF tensor name, layout kind): one layer's tensors.
LayerTensors = dict[str, tuple[str, str]]
# (our path, [per layer: HF name, or [per expert: HF name]], layout kind) of a stacked param.
Stacked = tuple[str, list, str]


class Family:
  """A Hugging Face model family. Subclasses set the class attributes and `model_fields`,
  and either `layer_tensors` (+ `expert_tensors`) or `stacked`; the rest have defaults
  that a family without a multimodal wrapper or extra layers keeps."""
  model_types: tuple[str, ...] = ()
  experiment: str = ""  # configs/ experiment whose model the override lines set
  lora_experiment: str | None = None  # the same model with LoRA adapters; None: no LoRA
  # spmdtask's LoRA target (layers.lora) -> the HF Linear module it adapts, PEFT's
  # target_modules name (peft.py finds the modules in `stacked`); only those PEFT adapts.
  lora_targets: dict[str, str] = {}

  def model_fields(self, cfg: dict) -> dict:
    """TransformerLm fields of a config (a MoE's as a `moe` dict of MoeConfig fields, MLA's
    as `mla`); ConfigError naming a key spmdtask cannot express exactly."""
    raise NotImplementedError

  def layer_tensors(self, cfg: dict, i: int) -> LayerTensors:
    """Layer i's tensors, routed experts aside."""
    raise NotImplementedError

  def expert_tensors(self, cfg: dict, i: int, j: int) -> LayerTensors:
    """Expert j of layer i's tensors (our paths stacked [layers, experts, ...]); none for
    a dense family."""
    del cfg, i, j
    return {}

  def stacked(self, cfg: dict, m: dict) -> list[Stacked]:
    """Every stacked param, from `layer_tensors` and `expert_tensors` (`m`: the fields)."""
    layers = range(m["num_layers"])
    experts = range(m["moe"]["num_experts"] if "moe" in m else 0)
    out = [(path, [self.layer_tensors(cfg, i)[path][0] for i in layers], kind)
           for path, (_, kind) in self.layer_tensors(cfg, 0).items()]
    out += [(path, [[self.expert_tensors(cfg, i, j)[path][0] for j in experts]
                    for i in layers], kind)
            for path, (_, kind) in self.expert_tensors(cfg, 0, 0).items()]
    return out

  def layouts(self, m: dict) -> tuple[dict, dict]:
    """Layout kinds of this family's own (HF -> ours, ours -> HF) beside convert.py's."""
    del m
    return {}, {}

  def text(self, cfg: dict, tensors: dict) -> tuple[dict, dict]:
    """(config, tensors) of the language model a checkpoint holds (a multimodal one's text
    half); the checkpoint itself for a text-only family."""
    return cfg, tensors

  def text_config(self, cfg: dict) -> dict:
    """The config of the language model (see `text`)."""
    return cfg

  def held(self, cfg: dict, tensors: dict, skip_mtp: bool = False
           ) -> tuple[dict, dict, str | None]:
    """(config, tensors, a note or None) with the optional layers the checkpoint does not
    hold left out (DeepSeek-V3's MTP layers); `tensors` is any mapping by HF name."""
    del skip_mtp
    return cfg, tensors, None

  def copies(self, cfg: dict) -> dict[str, str]:
    """HF name of each tensor that must equal another (a shared weight's copy) -> that
    other's name; written back as copies."""
    del cfg
    return {}


def check_fields(cfg: dict, kind: str, required, unsupported: dict) -> None:
  """ConfigError for a `required` key the config lacks or an `unsupported` key (key ->
  the one value, or a tuple of the values, spmdtask can express) set otherwise."""
  for key in required:
    if key not in cfg:
      raise ConfigError(f"config.json has no {key!r}, which a {kind} config needs.")
  for key, ok in unsupported.items():
    allowed = ok if isinstance(ok, tuple) else (ok,)
    if key in cfg and cfg[key] not in allowed:
      raise ConfigError(f"config.json: {key}={cfg[key]!r} is not supported (only "
                        f"{' or '.join(repr(a) for a in allowed)}); spmdtask's TransformerLm "
                        "cannot express it, so the conversion would not be exact.")
