"""The model contract: both model families implement it (that framework modules import no model
family is `tests/test_layout.py`'s)."""
from spmdtask.core import model as model_lib
from spmdtask.layers.transformer import TransformerLm
from spmdtask.layers.vit import VisionTransformer


def test_both_families_implement_the_contract():
  lm = TransformerLm(vocab_size=8, d_model=8, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=8, d_ff=8)
  vit = VisionTransformer(image_size=4, channels=1, patch_size=2, num_classes=2, d_model=8,
                          num_layers=1, num_heads=1, head_dim=8, d_ff=8)
  for m in (lm, vit):
    assert isinstance(m, model_lib.Model) and isinstance(m, model_lib.Stacked)
  assert isinstance(lm, model_lib.Decodable) and not isinstance(vit, model_lib.Decodable)
