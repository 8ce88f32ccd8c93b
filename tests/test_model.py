"""The model contract is the only seam: framework modules import no model family."""
import ast
import os

from spmdtask import model as model_lib
from spmdtask.layers.transformer import TransformerLm
from spmdtask.layers.vit import VisionTransformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imports(path: str) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return found


def test_framework_modules_import_no_model_family():
  framework = [os.path.join(d, f) for d in ("spmdtask", "spmdtask/inputs", "spmdtask/pipeline")
               for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")]
  for path in framework:
    bad = {m for m in _imports(os.path.join(ROOT, path))
           if m.startswith(("spmdtask.layers", "configs"))}
    assert not bad, (path, bad)


def test_both_families_implement_the_contract():
  lm = TransformerLm(vocab_size=8, d_model=8, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=8, d_ff=8)
  vit = VisionTransformer(image_size=4, channels=1, patch_size=2, num_classes=2, d_model=8,
                          num_layers=1, num_heads=1, head_dim=8, d_ff=8)
  for m in (lm, vit):
    assert isinstance(m, model_lib.Model) and isinstance(m, model_lib.Stacked)
  assert isinstance(lm, model_lib.Decodable) and not isinstance(vit, model_lib.Decodable)
