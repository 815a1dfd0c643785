"""How an analysis script hands back its result: the JSON on stdout, and the same text in --out when given."""

import json
from pathlib import Path
from typing import Any


def print_json(result: Any, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)
