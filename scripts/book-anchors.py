#!/usr/bin/env python3
"""Checks that every link to a heading in the book (`page.md#slug` or
`#slug`) names a heading that page has: mdbook builds a dead anchor
without a word, and a renamed file renames the headings that cite it.

Usage: scripts/book-anchors.py [book/src]   (exit 1 and a list if any is dead)
"""
import glob
import os
import re
import sys


def slug(heading: str) -> str:
    """mdbook's id for a heading: lower case, punctuation dropped, spaces
    as dashes."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def main() -> int:
    src = sys.argv[1] if len(sys.argv) > 1 else "book/src"
    pages = glob.glob(os.path.join(src, "**", "*.md"), recursive=True)
    heads = {}
    for page in pages:
        text = open(page, encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        heads[os.path.normpath(page)] = {
            slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)
        }
    dead = []
    for page in pages:
        text = open(page, encoding="utf-8").read()
        for m in re.finditer(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            target = m.group(1)
            path = (
                os.path.normpath(os.path.join(os.path.dirname(page), target))
                if target
                else os.path.normpath(page)
            )
            if path in heads and m.group(2) not in heads[path]:
                line = text.count("\n", 0, m.start()) + 1
                dead.append(f"{page}:{line}: no heading #{m.group(2)} in {path}")
    for d in dead:
        print(d, file=sys.stderr)
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
