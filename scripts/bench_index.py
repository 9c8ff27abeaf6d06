"""Regenerate the page list of docs/benchmarks.md from docs/bench/*.md.

Each page's title is its first `# ` line. Run after adding a page under docs/bench/:

    python scripts/bench_index.py          # rewrite the list in place
    python scripts/bench_index.py --check  # exit 1 when the list is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
INDEX = DOCS / "benchmarks.md"
START, END = "<!-- bench pages: python scripts/bench_index.py -->", "<!-- end of bench pages -->"


def page_list() -> str:
    rows = ["| page | what it measures |", "|---|---|"]
    for page in sorted((DOCS / "bench").glob("*.md")):
        title = next((line[2:].strip() for line in page.read_text().splitlines()
                      if line.startswith("# ")), page.stem)
        rows.append(f"| [bench/{page.name}](bench/{page.name}) | {title} |")
    return "\n".join(rows)


def main() -> int:
    text = INDEX.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{page_list()}\n{END}{tail}"
    if "--check" in sys.argv[1:]:
        if new != text:
            print(f"{INDEX} is out of date: run python scripts/bench_index.py", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
