"""docs/operations.md's repairs table lists every service of the maintenance room, and nothing that is not one."""
from __future__ import annotations

import re
from pathlib import Path

from aivedio.reconcile import room

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_the_operations_doc_lists_every_repair_with_what_it_never_does():
    text = OPERATIONS.read_text()
    section = text[text.index("## Repairs: the maintenance room"):]
    section = section[:section.index("\n#", 4)]  # up to the next heading
    rows = [line for line in section.splitlines() if re.match(r"^\| `[a-z-]+` \|", line)]
    listed = [re.match(r"^\| `([a-z-]+)` \|", line).group(1) for line in rows]
    assert listed == [s.name for s in room.SERVICES]
    for line, s in zip(rows, room.SERVICES):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells) == 4 and cells[3], f"{s.name}: the row needs what it never does"
