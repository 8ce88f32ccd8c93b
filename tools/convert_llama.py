"""The documented Llama command, kept: `python tools/convert_llama.py --from_hf=... ` runs
tools/convert_hf.py (Llama, Mixtral and Qwen3-MoE checkpoints), whose names it re-exports."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position,unused-import
from tools.convert_hf import (EXP, OVERRIDES_FILE, SOURCE_FILE, TOKENIZER_FILES, experiment,
                              from_hf, from_params, main, overrides, published_experiment,
                              read_checkpoint, read_hf, to_hf, to_params, write_checkpoint)

if __name__ == "__main__":
  main()
