"""Every document the code and the docs refer to is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MENTION = re.compile(r"(?<![\w/.:-])([A-Za-z][\w./-]*\.md)\b")
WRITTEN = {"report.md"}  # what ``tangram evaluate`` writes, not a document of the repository


def test_every_document_mentioned_exists():
    missing = []
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    for f in files:
        for name in MENTION.findall(f.read_text()):
            if name in WRITTEN:
                continue
            if not any((base / name).exists() for base in (ROOT, ROOT / "docs", f.parent)):
                missing.append(f"{f.relative_to(ROOT)}: {name}")
    assert missing == []
