"""analysis/output.py: the result printed as JSON, and the same text written to --out (its folder made)."""

import json

from analysis.output import print_json


def test_print_json_prints_and_writes_the_same_text(tmp_path, capsys):
    out = tmp_path / "new" / "res.json"
    print_json({"lists": 3, "identical": 3}, str(out))
    printed = capsys.readouterr().out
    assert json.loads(printed) == json.loads(out.read_text()) == {"lists": 3, "identical": 3}
    print_json([1], None)  # no --out: printed only
    assert json.loads(capsys.readouterr().out) == [1]
