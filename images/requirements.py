"""Print the project's requirements for the given extras (pyproject.toml's core dependencies plus each extra's),
one a line. The images install these, pinned by the lock, before the source is copied in, so that layer is
rebuilt only when pyproject.toml or the lock changes, not on every code edit.

    python images/requirements.py pipelines features > /tmp/requirements.txt
"""

import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
unknown = [e for e in sys.argv[1:] if e not in extras]
if unknown:
    sys.exit(f"images/requirements.py: no extra {unknown} in pyproject.toml (extras: {sorted(extras)})")
reqs = project["dependencies"] + [r for e in sys.argv[1:] for r in extras[e]]
print("\n".join(dict.fromkeys(reqs)))  # once each, in order
