#!/usr/bin/env bash
# Checks that the book in book/ is a user's guide, not a work log, and that
# it builds cleanly:
#   1. no raw results (.log, .json, timeline .txt/.csv dumps) under book/src:
#      they belong in bench-results/<date>-<device>-<commit>/;
#   2. every ```rust block is an include of compiled code (the line after the
#      fence starts with {{#include or {{#rustdoc_include});
#   3. no dated work-log heading ("## Session 41: …");
#   4. links to headings name headings that exist;
#   5. `mdbook build book` prints no WARN and no ERROR.
# Usage: scripts/book-check.sh   (from anywhere in the repository; needs mdbook
# on PATH or in ~/.cargo/bin)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
src=book/src
fail=0

# 1. Raw results.
raw="$(find "$src" -type f \( -name '*.log' -o -name '*.json' -o -name '*.csv' \
    -o -name 'timeline-*.txt' -o -name '*-stacks-*.txt' \) | sort)"
if [ -n "$raw" ]; then
    echo "book-check: raw results under $src (move them to bench-results/<date>-<device>-<commit>/):" >&2
    echo "$raw" | sed 's/^/  /' >&2
    fail=1
fi

# 2. Rust blocks must be includes.
bad_rust="$(find "$src" -name '*.md' -print0 | sort -z | xargs -0 awk '
    FNR == 1 { want = 0 }
    want {
        line = $0
        sub(/^[ \t]+/, "", line)
        if (line !~ /^\{\{#(rustdoc_)?include/) {
            printf "%s:%d: a ```rust block that is not an include\n", FILENAME, FNR - 1
        }
        want = 0
        next
    }
    {
        line = $0
        sub(/^[ \t]+/, "", line)
        if (line ~ /^```rust/) want = 1
    }
')"
if [ -n "$bad_rust" ]; then
    echo "book-check: Rust code must come from compiled code ({{#include FILE:ANCHOR}}); use a \`\`\`text block for a sketch:" >&2
    echo "$bad_rust" | sed 's/^/  /' >&2
    fail=1
fi

# 2b. Every include names a file that exists and, for `FILE:NAME`, an
# anchor it has (mdbook renders a missing anchor as an empty block, silently).
bad_inc=""
while IFS= read -r hit; do
    md="${hit%%:*}"
    rest="${hit#*:}"
    lineno="${rest%%:*}"
    spec="${rest#*:}"
    spec="${spec#\{\{#include }"
    spec="${spec#\{\{#rustdoc_include }"
    spec="${spec%\}\}}"
    file="${spec%%:*}"
    anchor=""
    [ "$file" != "$spec" ] && anchor="${spec#*:}"
    path="$(dirname "$md")/$file"
    if [ ! -f "$path" ]; then
        bad_inc+="$md:$lineno: $file does not exist"$'\n'
    elif [ -n "$anchor" ] && ! [[ "$anchor" =~ ^[0-9:]*$ ]] \
        && ! grep -qE "ANCHOR:[[:space:]]*${anchor}([[:space:]]|$)" "$path"; then
        bad_inc+="$md:$lineno: $file has no \`// ANCHOR: $anchor\`"$'\n'
    fi
done < <(grep -rnoE '(^|[^\\])\{\{#(rustdoc_)?include [^}]+\}\}' --include='*.md' "$src" \
    | sed -E 's/:([0-9]+):[^{]*\{\{/:\1:{{/')
if [ -n "$bad_inc" ]; then
    echo "book-check: includes that show nothing:" >&2
    printf '%s' "$bad_inc" | sed 's/^/  /' >&2
    fail=1
fi

# 3. Dated work-log headings.
worklog="$(grep -rnE '^#+ .*[Ss]ession [0-9]' --include='*.md' "$src" || true)"
if [ -n "$worklog" ]; then
    echo "book-check: work-log headings (the history belongs in git and bench-results/DECISIONS.md):" >&2
    echo "$worklog" | sed 's/^/  /' >&2
    fail=1
fi

# 3b. Links to headings name headings that exist.
if ! python3 scripts/book-anchors.py "$src"; then
    echo "book-check: links to headings that do not exist (above)" >&2
    fail=1
fi

# 4. mdbook build without warnings.
mdbook="$(command -v mdbook || true)"
if [ -z "$mdbook" ] && [ -x "$HOME/.cargo/bin/mdbook" ]; then
    mdbook="$HOME/.cargo/bin/mdbook"
fi
if [ -z "$mdbook" ]; then
    echo "book-check: mdbook not found (cargo install mdbook)" >&2
    exit 1
fi
out="$("$mdbook" build book 2>&1)" || {
    echo "$out" >&2
    echo "book-check: mdbook build failed" >&2
    exit 1
}
if printf '%s\n' "$out" | grep -E 'WARN|ERROR' >&2; then
    echo "book-check: mdbook build printed warnings or errors (above)" >&2
    fail=1
fi

if [ "$fail" -ne 0 ]; then
    exit 1
fi
echo "book-check: ok"
