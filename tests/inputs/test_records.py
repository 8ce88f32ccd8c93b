"""inputs/records.py: the same records from JSONL, Parquet and a datasets dir, each with its
place ('FILE:LINE: ', 'FILE:row N: '); every unreadable input a ConfigError naming the place
and the fix."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs import records

ROWS = [
    {"messages": [{"role": "user", "content": "Hé?"}, {"role": "assistant", "content": "Oui."}]},
    {"messages": [{"role": "user", "content": "2+3"}, {"role": "assistant", "content": "5"}]},
]


def test_jsonl_records_by_line_with_bom_crlf_and_blank_lines(tmp_path):
  f = tmp_path / "a.jsonl"
  f.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\r\n\n  \n" +
                json.dumps(ROWS[1], ensure_ascii=False).encode())
  (tmp_path / "b.jsonl").write_text(json.dumps({"x": 1}) + "\n")
  got = list(records.read(str(tmp_path / "*.jsonl")))
  assert got == [(f"{f}:1: ", ROWS[0]), (f"{f}:4: ", ROWS[1]),
                 (f"{tmp_path / 'b.jsonl'}:1: ", {"x": 1})]


def test_parquet_and_datasets_rows_equal_the_jsonl_records(tmp_path):
  import datasets  # pylint: disable=g-import-not-at-top  # heavy: only for this test
  path = tmp_path / "rows.parquet"
  pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=1)  # rows across groups
  assert list(records.read(str(path))) == [(f"{path}:row 0: ", ROWS[0]),
                                           (f"{path}:row 1: ", ROWS[1])]
  saved = tmp_path / "ds"
  datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
  assert list(records.read(str(saved))) == [(f"{saved}:row 0: ", ROWS[0]),
                                            (f"{saved}:row 1: ", ROWS[1])]
  # A DatasetDict: refused naming its splits; a split's own dir reads.
  both = tmp_path / "dd"
  datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS),
                       test=datasets.Dataset.from_list(ROWS[:1])).save_to_disk(str(both))
  with pytest.raises(ConfigError, match=rf"^--input='{both}' is a DatasetDict with the splits "
                     rf"train, test; give the split to read as its own dir, e.g. "
                     rf"--input='{both}/train'\.$"):
    list(records.read(str(both)))
  assert [r for _, r in records.read(str(both / "test"))] == ROWS[:1]


BAD = {  # case: (file bytes, the error's start)
    "latin1": (b'{"a": "ok"}\n{"a": "caf\xe9"}\n', r":2: byte 11 of the line \(0xe9\) is not "
               r"UTF-8 \(invalid continuation byte\), so its text cannot be read without "
               r"guessing the encoding\. Save the file as UTF-8 \(e\.g\. `iconv"),
    "not_json": (b'{"a": 1}\n{"a": 1,}\n', r":2: is not JSON \(Expecting property name "
                 r"enclosed in double quotes at column 9\); write one JSON object a line\.$"),
    "not_object": (b'[1, 2]\n', r":1: is a JSON list, not an object; write one JSON object"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_jsonl_is_a_config_error_naming_file_and_line(case, tmp_path):
  data, match = BAD[case]
  f = tmp_path / "in.jsonl"
  f.write_bytes(data)
  with pytest.raises(ConfigError, match="^" + str(f) + match) as e:
    list(records.read(str(f)))
  assert "\n" not in str(e.value)


def test_sources_that_name_nothing_readable_are_refused(tmp_path):
  with pytest.raises(ConfigError, match=r"^--input='.*/none\*\.jsonl' matches no file; give a "
                     "JSONL file"):
    list(records.read(str(tmp_path / "none*.jsonl")))
  with pytest.raises(ConfigError, match=r"^--input='.*' is a dir but not one written by "
                     "datasets' save_to_disk \\(it has no state.json\\)"):
    list(records.read(str(tmp_path)))
  fake = tmp_path / "fake.parquet"
  fake.write_text(json.dumps(ROWS[0]))
  with pytest.raises(ConfigError, match=rf"^{fake} is not a Parquet file pyarrow can read"):
    list(records.read(str(fake)))
