"""Every document the code and the docs refer to is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MENTION = re.compile(r"(?<![\w/.:-])([A-Za-z][\w./-]*\.md)\b")
# files the code writes, not documents of the repository: ``tangram evaluate``'s report, and the
# README of the task projects ``bench/taskimages.py`` builds
WRITTEN = {"report.md", "repo/README.md"}


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
