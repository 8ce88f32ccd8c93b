"""The plan's console lines: the array table's largest rows, then how many more."""
from spmdtask.plan import printout


def _row(path: str, mib: int) -> dict:
  return {"path": path, "logical_shape": [mib, 1024, 256], "padded_shape": [mib, 1024, 256],
          "spec": [None, "fsdp", None], "bytes_per_device": mib * 2**20}


def test_array_table_shows_the_largest_rows_then_the_rest_in_one_line():
  rows = [_row(f"params/w{i}", i) for i in range(1, 21)]  # 1..20 MiB, smallest first
  lines = printout.array_table(rows, top=15)
  assert lines[0].split() == ["array", "logical", "padded", "spec", "per", "device"]
  assert [l.split()[0] for l in lines[1:16]] == [f"params/w{i}" for i in range(20, 5, -1)]
  assert lines[1].endswith(" 20.0 MiB") and lines[15].endswith("  6.0 MiB")
  assert lines[16] == ("... and 5 smaller arrays, 15.0 MiB per device in all (plan.json lists "
                       "every array)")
  assert len(printout.array_table(rows[:15], top=15)) == 16  # all shown: no last line


def test_where_names_a_topology_or_the_devices():
  tpu = {"topology": "v5e:2x4", "num_slices": 1, "chips": 8, "device_kind": "TPU v5 lite",
         "platform": "tpu"}
  assert printout.where(tpu, 8) == "v5e:2x4 (8 TPU v5 lite chips)"
  assert printout.where({**tpu, "num_slices": 2, "chips": 16}, 16) == (
      "v5e:2x4 x 2 slices (16 TPU v5 lite chips)")
  assert printout.where({"topology": None, "platform": "cpu"}, 8) == "8 cpu devices"
