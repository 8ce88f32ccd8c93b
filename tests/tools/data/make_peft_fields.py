"""PEFT's LoraConfig fields and their defaults (peft_lora_fields.json), for the test that
every field has a verdict in spmdtask's PEFT reader. Run with the torch venv:
  python make_peft_fields.py tests/tools/data
"""
import dataclasses, json, os, sys
import peft
fields = {}
for f in dataclasses.fields(peft.LoraConfig):
  default = (f.default if f.default is not dataclasses.MISSING
             else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
  try:
    json.dumps(default)
  except TypeError:
    default = repr(default)
  fields[f.name] = default
with open(os.path.join(sys.argv[1], "peft_lora_fields.json"), "w") as out:
  json.dump({"peft_version": peft.__version__, "fields": fields}, out, indent=1, sort_keys=True)
