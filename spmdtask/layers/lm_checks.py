"""TransformerLm's checks of its config against a mesh, and of a batch against the model:
each mistake a ConfigError naming the field and the fix."""
import numpy as np

from spmdtask.core import checks, sharding
from spmdtask.core.strategy import StackFacts
from spmdtask.errors import ConfigError
from spmdtask.layers import block
from spmdtask.layers.attention import context as context_lib
from spmdtask.layers.attention import fused as fused_attention
from spmdtask.layers import lora as lora_lib
from spmdtask.layers import mtp as mtp_lib
from spmdtask.layers.attention import window as window_lib
from spmdtask.layers.rope import SCALINGS


def _validate_moe(model, mesh_shape) -> None:
  """The MoE fields; an expert split on a dense model; experts over the batch's axes."""
  ws, field = model.weight_split_dims_mapping, "task.model.weight_split_dims_mapping"
  expert_axes = {a for e in (ws.expert_in[0], ws.expert_out[0])
                 for a in sharding.entry_axes(e) if mesh_shape.get(a, 1) > 1}
  if model.moe is None:
    if mesh_shape.get("expert", 1) > 1 or expert_axes:
      raise ConfigError(
          f"An expert split on a dense model: the mesh's `expert` axis has size "
          f"{mesh_shape.get('expert', 1)} and {field}.expert_in / expert_out name "
          f"{sorted(expert_axes) or 'no axis'}, but task.model.moe is None (no experts to "
          "split). Set task.model.moe to a MoeConfig, or give the `expert` axis size 1 "
          "(task.ici_mesh_shape) and name no axis on the expert dims.")
    return
  if sharding.entry_axes(ws.expert_in[0]) != sharding.entry_axes(ws.expert_out[0]):
    raise ConfigError(f"{field}.expert_in[0]={ws.expert_in[0]!r} and expert_out[0]="
                      f"{ws.expert_out[0]!r} must split the expert dim alike.")
  model.moe.validate(model.num_layers, sharding.shards(ws.expert_in[0], mesh_shape))
  batch = sharding.entry_axes(model.activation_split_dims_mapping.embed[0])
  if not expert_axes <= set(batch):
    raise ConfigError(
        f"{field}.expert_in[0]={ws.expert_in[0]!r} splits the experts over "
        f"{sorted(expert_axes - set(batch))}, which do not split the batch "
        f"(task.model.activation_split_dims_mapping.embed[0]={batch}): tokens reach their "
        "experts by all-to-all over the batch's axes. Add those axes to the batch's entry "
        "(embed, heads, ff, logits), as TinyMoe does with ('data', 'expert', 'fsdp').")


def lora_weights(model) -> tuple[str, ...]:
  """The LoRA targets (layers.lora.TARGETS) this model has a weight for."""
  # A gated MLP (SwiGLU, Gemma's GeGLU) has a gate wg; plain GELU none.
  mlp = lora_lib.MLP if model.mlp_activation in block.GATED else ("wi", "wo")
  dense_mlp = model.moe is None or model.moe.first_moe_layer > 0 or model.moe.shared_ff
  mla = model.mla
  attention = (lora_lib.ATTENTION if mla is None else
               ("q_down", "q_up") if mla.q_lora_rank else ("q",)) + (
                   () if mla is None else ("kv_down", "kv_up", "o"))
  return attention + (mlp if dense_mlp else ()) + (("experts",) if model.moe else ())


def _validate_lora(model) -> None:
  """The LoRA fields against the weights this model has (layers.lora), and the rank
  against their dims."""
  if model.lora is None:
    return
  model.lora.validate(lora_weights(model))
  if model.lora.base_quantization is not None and model.quantization is not None:
    raise ConfigError(
        f"{lora_lib.FIELD}.base_quantization={model.lora.base_quantization!r} with "
        f"task.model.quantization={model.quantization!r}: a QLoRA base is dequantized for a "
        "float matmul, not multiplied quantized; set task.model.quantization=None (or "
        f"{lora_lib.FIELD}.base_quantization=None for quantized training matmuls).")
  rank, sizes = model.lora.rank, _lora_sizes(model)
  # The target whose weight is narrowest: its bound holds for every target.
  target, (n_in, n_out) = min(((t, min(sizes[t], key=min)) for t in model.lora.targets),
                              key=lambda x: min(x[1]))
  if rank > min(n_in, n_out):
    raise ConfigError(
        f"{lora_lib.FIELD}.rank={rank}: rank {rank} > {min(n_in, n_out)}, the smaller dim "
        f"of {target} in this model ({n_in} in x {n_out} out): A·B of a larger rank is no "
        f"more than a full-rank update. Give a rank <= {min(n_in, n_out)} (e.g. 8 or 16).")


def _lora_sizes(model) -> dict[str, list[tuple[int, int]]]:
  """LoRA target -> (in, out) sizes of each weight it adapts (dims flattened)."""
  d, h, kv, hd, moe, mla = (model.d_model, model.num_heads, model.num_kv_heads,
                            model.head_dim, model.moe, model.mla)
  ffs = [model.d_ff] if moe is None or moe.first_moe_layer > 0 else []
  ffs += [moe.shared_ff] if moe is not None and moe.shared_ff else []
  out = {"q": [(d, h * hd)], "k": [(d, kv * hd)], "v": [(d, kv * hd)], "o": [(h * hd, d)],
         "wi": [(d, f) for f in ffs], "wg": [(d, f) for f in ffs], "wo": [(f, d) for f in ffs],
         "experts": [] if moe is None else [(d, moe.d_ff), (moe.d_ff, d)]}
  if mla is not None:
    q = mla.q_lora_rank
    out.update(q=[(d, h * mla.qk_head_dim)], o=[(h * mla.v_head_dim, d)],
               kv_down=[(d, mla.kv_lora_rank + mla.qk_rope_head_dim)],
               kv_up=[(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim))],
               q_down=[(d, q or 1)], q_up=[(q or 1, h * mla.qk_head_dim)])
  return out


def _validate_mla(model, mesh_shape) -> None:
  """The MLA fields (layers.attention.mla), and what MLA does not combine with."""
  if model.mla is None:
    return
  model.mla.validate(model.weight_split_dims_mapping, mesh_shape)
  if model.qk_norm or model.rope_scaling is not None:
    raise ConfigError("task.model.mla has its own latent norms and RoPE scaling "
                      "(task.model.mla.rope_scaling): set task.model.qk_norm=False and "
                      "task.model.rope_scaling=None.")
  if model.quantization is not None:
    raise ConfigError(f"task.model.quantization={model.quantization!r} with task.model.mla: "
                      "multi-head latent attention's projections are not quantized yet; set "
                      "task.model.quantization=None for an MLA model.")
  heads = model.activation_split_dims_mapping.heads
  if context_lib.seq_axes(heads, mesh_shape, ()):
    raise ConfigError(f"task.model.activation_split_dims_mapping.heads={heads!r} splits the "
                      "sequence, but task.model.mla (multi-head latent attention) has no "
                      "context-parallel kernel: keep the seq dim (dim 1) whole.")


def split_dims_fields(model) -> dict:
  """TransformerLm.split_dims_fields: config field -> (split-dims mapping, the shape of the
  tensor it maps); MLA's weights in place of q and kv with `mla`."""
  d, v, h, kv, hd, ff = (model.d_model, model.vocab_size, model.num_heads, model.num_kv_heads,
                         model.head_dim, model.d_ff)
  shapes = dict(embedding=(v, d), unembed=(d, v), q=(d, h, hd), kv=(d, kv, hd), o=(h, hd, d),
                mlp_in=(d, ff), mlp_out=(ff, d), norm=(d,))
  shapes.update(model.moe.weight_shapes(d) if model.moe else {})
  shapes.update(dict(mtp_proj=(2 * d, d)) if model.mtp_depth else {})
  if model.mla:
    for k in ("q", "kv"):
      shapes.pop(k)
    shapes.update(model.mla.weight_shapes(d, h))
  acts = dict(embed=("b", "t", d), heads=("b", "t", h, hd), ff=("b", "t", ff),
              logits=("b", "t", v))
  out = {f"task.model.weight_split_dims_mapping.{k}":
         (getattr(model.weight_split_dims_mapping, k), s) for k, s in shapes.items()}
  out.update({f"task.model.activation_split_dims_mapping.{k}":
              (getattr(model.activation_split_dims_mapping, k), s) for k, s in acts.items()})
  return out


def validate(model, mesh, global_batch_size: int, stack_layers: int) -> None:
  """TransformerLm.validate: dims, dtypes, remat, attention, every split-dims field, the
  MoE fields, and the pipeline over the `stack_layers` layers the strategy runs."""
  checks.positive("task.model", vocab_size=model.vocab_size, d_model=model.d_model,
                  num_layers=model.num_layers, num_heads=model.num_heads,
                  num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, d_ff=model.d_ff,
                  max_seq_len=model.max_seq_len, loss_vocab_tiles=model.loss_vocab_tiles)
  if model.num_heads % model.num_kv_heads:
    raise ConfigError(
        f"task.model.num_heads={model.num_heads} is not a multiple of task.model.num_kv_heads="
        f"{model.num_kv_heads} (grouped-query attention shares each KV head among a whole "
        "group of query heads): make num_kv_heads a divisor of num_heads.")
  if model.head_dim % 2:
    raise ConfigError(f"task.model.head_dim={model.head_dim} must be even: rotary positions "
                      "rotate pairs of dims. Use an even head_dim.")
  if model.mlp_activation not in block.MLP_ACTIVATIONS:
    raise ConfigError(f"task.model.mlp_activation={model.mlp_activation!r}: use one of "
                      f"{', '.join(block.MLP_ACTIVATIONS)}.")
  _validate_window(model)
  _validate_lora(model)
  if model.rope_scaling is not None:
    if not isinstance(model.rope_scaling, SCALINGS):
      raise ConfigError(f"task.model.rope_scaling={model.rope_scaling!r} is not a "
                        "Llama3Scaling or LinearScaling: set it to fdl.Config(Llama3Scaling, "
                        "...), fdl.Config(LinearScaling, factor=...) or None.")
    model.rope_scaling.validate("task.model.rope_scaling")
  checks.in_range("task.model.dropout_rate", model.dropout_rate, 0.0, 0.99)
  checks.dtype("task.model.fprop_dtype", model.fprop_dtype)
  checks.remat_policy("task.model.remat_policy", model.remat_policy)
  fused_attention.check(model.attention_impl, mesh.devices.flat[0].platform, model.head_dim,
                        model.fprop_dtype)
  mesh_shape = dict(mesh.shape)
  context_lib.check(model.context_attention, model.attention_impl,
                    model.activation_split_dims_mapping.heads, mesh_shape)
  for where, (split, shape) in model.split_dims_fields().items():
    sharding.validate(split, shape, mesh_shape, where)
  block.check_gather_at_once("task.model.weight_split_dims_mapping.gather_at_once",
                             model.weight_split_dims_mapping.gather_at_once)
  _validate_moe(model, mesh_shape)
  _validate_mla(model, mesh_shape)
  mtp_lib.validate(model, mesh_shape)
  if model.moe is not None and model.quantization_scaling == "delayed":
    raise ConfigError("task.model.quantization_scaling='delayed' with task.model.moe: the "
                      "routed experts' grouped matmuls keep no amax history (delayed "
                      "scaling is built for the projections only); set "
                      "task.model.quantization_scaling='current'.")
  if model.execution is not None:
    model.execution.validate(StackFacts(stack_layers, global_batch_size, mesh))


def check_batch(model, batch) -> None:
  """TransformerLm.check_batch: row length against max_seq_len, ids against vocab_size."""
  seq_len = np.shape(batch["inputs"])[-1]
  if seq_len > model.max_seq_len:
    raise ConfigError(
        f"The data's rows hold {seq_len} tokens (the datasets' seq_len), more than "
        f"task.model.max_seq_len={model.max_seq_len}, the longest sequence this model is "
        f"made for. Set datasets[...].seq_len to at most {model.max_seq_len} (e.g. "
        f"--fdl_set=\"datasets['train'].seq_len={model.max_seq_len}\"), or raise "
        f"task.model.max_seq_len to {seq_len} if the model should take longer sequences.")
  for key in ("inputs", "targets"):
    x = np.asarray(batch[key])
    if x.size and (x.min() < 0 or x.max() >= model.vocab_size):
      raise ConfigError(
          f"The data's {key!r} hold token ids in [{x.min()}, {x.max()}], outside "
          f"task.model.vocab_size={model.vocab_size}. Set vocab_size to the tokenizer's "
          "vocabulary size (or more), or fix the dataset's vocab_size / tokenizer.")


def _validate_window(model) -> None:
  """The local/global pattern and the window fit the model (layers.attention.window)."""
  window_lib.check(model.attention_pattern, model.sliding_window, model.num_layers)
  if model.moe is not None and len(set(model.attention_pattern)) > 1:
    raise ConfigError("task.model.attention_pattern mixes local and global layers, which a "
                      "Mixture-of-Experts model (task.model.moe) does not support yet: use a "
                      "uniform pattern or a dense model.")
  if model.attention_scale is not None and not model.attention_scale > 0:
    raise ConfigError(f"task.model.attention_scale={model.attention_scale!r} must be > 0 "
                      "(Gemma 3: query_pre_attn_scalar ** -0.5), or None for head_dim ** -0.5.")
