"""The documented Llama command, kept: `python tools/convert_llama.py --from_hf=... ` runs
tools/convert_hf.py (every family it reads)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # C++ libraries print as they load: keep them off the console
  from spmdtask import console  # pylint: disable=wrong-import-position
  console.start_tool()

# pylint: disable=wrong-import-position
from tools.convert_hf import main

if __name__ == "__main__":
  main()
