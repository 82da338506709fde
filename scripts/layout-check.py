#!/usr/bin/env python3
"""Layout check for the rdt workspace (LAYOUT.md, "Floors and who may import whom").

What it checks, over the three crate source dirs (framework/src, transports/src,
macros/src):

  1. Import circles between files: every file (module) is a node; an arrow
     a -> b exists when a names a path that lands in b (`use crate::...`,
     `use super::...`, `use self::...`, grouped/nested use trees, and path
     expressions in code such as `crate::x::f(..)` or `super::y::Z`; also a
     path through a module name brought into scope by `mod m;` or
     `use crate::m;`, and `#[serde(with = "crate::m")]`-style attribute
     strings).  A path lands in the longest prefix of it that is a known
     module; paths landing in lib.rs (the facade) draw no arrow.  Every
     strongly connected component of more than one file fails.
  2. The same at folder level (files collapsed to their top-level module
     under the crate root: worker/host.rs -> worker).
  3. Forbidden directions (FORBIDDEN_IMPORTS / FORBIDDEN_IDENTS /
     EXCLUSIVE_GROUPS below): e.g. no `crate::worker` under driver/, no
     `Sender` under owner/, no transport module naming another.  A rule about
     a module that does not exist passes trivially.  "under owner/" means the
     module `owner`, whether it is owner.rs or owner/.
  4. Root re-export imports (warning; failure with --strict): inside
     rdt-transport, a path such as `crate::Tensor` that reaches an item only
     through lib.rs's `pub use` instead of its module path.
  5. File size: any non-test .rs file over MAX_LINES lines fails (tests.rs,
     *_tests.rs, files under tests/ and cfg(test)-declared files are exempt).

Comments (line, block - nested -, doc comments, so doc links too) and string,
raw-string and char literals are blanked before parsing; anything inside a
`#[cfg(test)]`-gated item (mod tests { .. }, test-only fns and uses) or a
`mod tests { .. }` block is ignored, as are files named tests.rs or under a
tests/ folder.  A bare identifier (`Runtime`, `Output`) never draws an arrow.

Run from anywhere (it finds the workspace root from its own location):

    python3 scripts/layout-check.py            # full report, exit 1 on failure
    python3 scripts/layout-check.py --quiet    # only failures
    python3 scripts/layout-check.py --strict   # root re-export imports fail too
    python3 scripts/layout-check.py --graph    # also print the file graph (a -> b)
    python3 scripts/layout-check.py --root DIR # check another checkout
    python3 scripts/layout-check.py --self-test  # test the parser itself

Standard library only (Python 3.11).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

# --------------------------------------------------------------------------
# Configuration (the rules, as data)
# --------------------------------------------------------------------------

# crate key -> source dir, relative to the workspace root.
CRATES = {
    "framework": "framework/src",
    "transports": "transports/src",
    "macros": "macros/src",
}

MAX_LINES = 1000

# (crate, modules the rule applies under, module that must not be named)
FORBIDDEN_IMPORTS = [
    ("framework", ["driver", "owner", "refs", "transfer", "protocol", "process"], "worker"),
    ("framework", ["worker", "owner", "refs", "transfer", "protocol", "process"], "driver"),
    ("framework", ["worker", "refs", "transfer", "protocol"], "owner"),
]

# (crate, modules the rule applies under, identifier that must not appear).
# An identifier qualified by a foreign path (`oneshot::Sender`) or imported
# from another crate does not count.
FORBIDDEN_IDENTS = [
    ("framework", ["owner"], "Sender"),
]

# (crate, modules of which none may name another)
EXCLUSIVE_GROUPS = [
    ("transports", ["object_store", "tcp", "shm", "cuda_ipc", "nccl", "nixl"]),
]

# crates whose modules must import by module path, not through root re-exports
NO_ROOT_REEXPORT_IMPORTS = ["transports"]

# --------------------------------------------------------------------------
# Lexing: blank comments and literals, keeping offsets and newlines
# --------------------------------------------------------------------------

_LEX = re.compile(
    r"""
      (?P<lc>//[^\n]*)
    | (?P<bc>/\*)
    | (?P<raw>(?:br|cr|r)(?P<hashes>\#*)")
    | (?P<str>[bc]?")
    | (?P<chr>b?'(?:[^'\\\n]|\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F_]*\}|[^\n]))')
    | (?P<ident>r\#[A-Za-z_]\w*|[A-Za-z_]\w*)
    | (?P<life>'[A-Za-z_]\w*)
    """,
    re.X,
)
_STR_BODY = re.compile(r'(?:[^"\\]|\\.)*"', re.S)
_BC_TOKEN = re.compile(r"/\*|\*/")


def _blank(s: str) -> str:
    return re.sub(r"[^\n]", " ", s)


@dataclass
class Lit:
    start: int  # offset of the literal's first char (prefix/quote)
    end: int
    value: str  # content between the quotes (escapes left as written)


def strip_rust(text: str) -> tuple[str, list[Lit]]:
    """Returns text with comments and literals blanked (same length, same
    newlines), and the string literals found."""
    out: list[str] = []
    lits: list[Lit] = []
    pos = 0
    n = len(text)
    last = 0
    while pos < n:
        m = _LEX.search(text, pos)
        if not m:
            break
        kind = m.lastgroup if m.lastgroup != "hashes" else "raw"
        if m.group("raw") is not None:
            kind = "raw"
        s = m.start()
        if kind in ("ident", "life"):
            pos = m.end()
            continue
        if kind == "lc" or kind == "chr":
            e = m.end()
        elif kind == "bc":
            depth, p = 1, m.end()
            while depth and p < n:
                t = _BC_TOKEN.search(text, p)
                if not t:
                    p = n
                    break
                depth += 1 if t.group() == "/*" else -1
                p = t.end()
            e = p
        elif kind == "raw":
            closing = '"' + m.group("hashes")
            k = text.find(closing, m.end())
            e = n if k < 0 else k + len(closing)
            lits.append(Lit(s, e, text[m.end():max(m.end(), e - len(closing))]))
        else:  # str
            b = _STR_BODY.match(text, m.end())
            e = n if not b else b.end()
            lits.append(Lit(s, e, text[m.end():max(m.end(), e - 1)]))
        out.append(text[last:s])
        out.append(_blank(text[s:e]))
        last = pos = e
    out.append(text[last:])
    return "".join(out), lits


# --------------------------------------------------------------------------
# Structure helpers on stripped text
# --------------------------------------------------------------------------

_PAIRS = {"{": "}", "(": ")", "[": "]"}


def match_close(s: str, i: int) -> int:
    """s[i] is an opening bracket; returns the index just past its match."""
    op, cl = s[i], _PAIRS[s[i]]
    depth = 0
    for j in range(i, len(s)):
        c = s[j]
        if c == op:
            depth += 1
        elif c == cl:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def item_end(s: str, i: int) -> int:
    """From i (after an item's attributes), returns the end of the item: the
    first `;` outside brackets, or the end of the first `{...}` block."""
    depth = 0  # () and []
    angle = 0  # <> of generics (`->` and `=>` are not brackets)
    j = i
    n = len(s)
    while j < n:
        c = s[j]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "<":
            angle += 1
        elif c == ">" and s[j - 1:j] not in ("-", "="):
            angle = max(0, angle - 1)
        elif depth <= 0 and c == ";":
            return j + 1
        elif depth <= 0 and c == "{":
            return match_close(s, j)
        elif depth <= 0 and c == "}":
            return j  # the enclosing block ends: a gated field or arm
        elif depth <= 0 and angle == 0 and c == ",":
            return j + 1  # a gated field, variant or argument
        j += 1
    return n


_ATTR_START = re.compile(r"#\s*!?\s*\[")
_CFG_TEST = re.compile(
    r"#\s*\[\s*cfg\s*\(\s*(?:test|all\s*\([^()]*\btest\b[^()]*\))\s*\)\s*\]"
)
_INNER_CFG_TEST = re.compile(r"#\s*!\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")
_MOD_TESTS = re.compile(r"\bmod\s+tests\s*\{")
_MOD_DECL = re.compile(r"\bmod\s+(?:r#)?([A-Za-z_]\w*)\s*([;{])")
_USE = re.compile(r"\buse\b")
# a top-level item (at column 0, as rustfmt puts them): its kind and name
_DEF = re.compile(
    r"^(?:pub(?:\s*\([^()]*\))?\s+)?(?:(?:unsafe|async|extern\s*\"[^\"]*\")\s+)*"
    r"(struct|enum|fn|trait|type|const|static|union)\s+(?:r#)?([A-Za-z_]\w*)",
    re.M,
)
_PATHLIKE = re.compile(r"(?:r#)?[A-Za-z_]\w*(?:\s*::\s*(?:r#)?[A-Za-z_]\w*)+")
_STR_PATH = re.compile(r"(?:crate|self|super)(?:::[A-Za-z_]\w*)+")


def skip_attrs(s: str, i: int) -> int:
    """Skips whitespace and outer attributes from i."""
    n = len(s)
    while True:
        while i < n and s[i].isspace():
            i += 1
        m = _ATTR_START.match(s, i)
        if not m:
            return i
        i = match_close(s, m.end() - 1)


def attrs_before(s: str, i: int) -> list[tuple[int, int]]:
    """Spans of the outer attributes right before position i (skipping a
    visibility such as `pub(crate)`)."""
    j = i
    # skip visibility backwards
    head = s[max(0, i - 40):i]
    m = re.search(r"pub\s*(?:\([^()]*\))?\s*$", head)
    if m:
        j = i - (len(head) - m.start())
    spans = []
    while True:
        k = j - 1
        while k >= 0 and s[k].isspace():
            k -= 1
        if k < 0 or s[k] != "]":
            return spans
        depth = 0
        while k >= 0:
            if s[k] == "]":
                depth += 1
            elif s[k] == "[":
                depth -= 1
                if depth == 0:
                    break
            k -= 1
        h = k - 1
        while h >= 0 and s[h].isspace():
            h -= 1
        if h < 0 or s[h] != "#":
            return spans
        end = match_close(s, k)
        spans.append((h, end))
        j = h


def in_spans(spans: list[tuple[int, int]], i: int) -> bool:
    return any(a <= i < b for a, b in spans)


# --------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------


@dataclass
class Ref:
    """A path named in a file."""

    src: str  # file (relative to the workspace root)
    line: int
    text: str  # the path as written
    scope: tuple  # module path where it is written
    segs: list  # path segments
    in_use: bool
    bind: str | None = None  # name a `use` binds (alias or last segment)
    is_pub: bool = False  # `pub use`
    # filled by resolution
    target: tuple | None = None  # absolute path (None: another crate)
    file: str | None = None  # file it lands in
    via_root: str | None = None  # file of the item behind a root re-export


@dataclass
class ModFile:
    path: str  # relative to the workspace root
    modpath: tuple
    crate: str
    test: bool = False
    orphan: bool = False
    lines: int = 0
    text: str = ""
    stripped: str = ""
    lits: list = field(default_factory=list)
    test_spans: list = field(default_factory=list)
    inline: list = field(default_factory=list)  # (start, end, modpath)
    refs: list = field(default_factory=list)
    ident_hits: list = field(default_factory=list)
    use_spans: list = field(default_factory=list)
    defs: set = field(default_factory=set)  # top-level item names defined here
    idents: set = field(default_factory=set)  # identifiers its own code names

    def scope_at(self, i: int) -> tuple:
        best = self.modpath
        best_len = -1
        for a, b, mp in self.inline:
            if a <= i < b and len(mp) > best_len:
                best, best_len = mp, len(mp)
        return best

    def line_of(self, i: int) -> int:
        return self.text.count("\n", 0, i) + 1


def is_test_name(rel: str) -> bool:
    parts = rel.replace(os.sep, "/").split("/")
    name = parts[-1]
    return name == "tests.rs" or name.endswith("_tests.rs") or "tests" in parts[:-1]


def count_lines(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


# --------------------------------------------------------------------------
# Per-file parsing
# --------------------------------------------------------------------------


def prepare(mf: ModFile) -> None:
    s = mf.stripped
    spans = []
    if _INNER_CFG_TEST.search(s[:2000]):
        mf.test = True
    for m in _CFG_TEST.finditer(s):
        start = m.start()
        i = skip_attrs(s, m.end())
        spans.append((start, item_end(s, i)))
    for m in _MOD_TESTS.finditer(s):
        spans.append((m.start(), match_close(s, m.end() - 1)))
    mf.test_spans = spans
    # inline modules (their scope); nesting resolved by position
    found = []
    for m in _MOD_DECL.finditer(s):
        if m.group(2) != "{" or in_spans(spans, m.start()):
            continue
        found.append((m.start(), match_close(s, m.end() - 1), m.group(1)))
    found.sort()
    mf.inline = []
    for a, b, name in found:
        parent = mf.scope_at(a)
        mf.inline.append((a, b, parent + (name,)))


def mod_decls(mf: ModFile):
    """Yields (name, path_attr or None, cfg_test, inline_chain) for `mod x;`."""
    s = mf.stripped
    for m in _MOD_DECL.finditer(s):
        if m.group(2) != ";" or in_spans(mf.test_spans, m.start()):
            continue
        path_attr = None
        cfg_test = False
        for a, b in attrs_before(s, m.start()):
            attr = s[a:b]
            if _CFG_TEST.fullmatch(attr.strip()):
                cfg_test = True
            if re.match(r"#\s*\[\s*path\s*=", attr):
                for lit in mf.lits:
                    if a <= lit.start < b:
                        path_attr = lit.value
                        break
        scope = mf.scope_at(m.start())
        chain = scope[len(mf.modpath):]
        yield m.group(1), path_attr, cfg_test, chain


def tokenize_use(s: str, i: int):
    """Tokens of a use tree from i up to its `;`. Returns (tokens, end) with
    tokens as (kind, text, offset); None if it does not look like a use tree."""
    toks = []
    n = len(s)
    tok_re = re.compile(r"\s*(::|[{},*;]|(?:r#)?[A-Za-z_]\w*)")
    while i < n:
        m = tok_re.match(s, i)
        if not m:
            return None, i
        t = m.group(1)
        off = m.start(1)
        i = m.end()
        if t == ";":
            return toks, i
        toks.append((t, off))
    return None, i


def parse_use_tree(toks):
    """Expands a use tree into leaves (segments, bind, offset)."""
    leaves = []
    pos = 0

    def tree(prefix):
        nonlocal pos
        path = list(prefix)
        if pos < len(toks) and toks[pos][0] == "::":
            path.append("::")
            pos += 1
        while pos < len(toks):
            t, off = toks[pos]
            if t == "{":
                pos += 1
                while pos < len(toks) and toks[pos][0] != "}":
                    tree(path)
                    if pos < len(toks) and toks[pos][0] == ",":
                        pos += 1
                pos += 1  # '}'
                return
            if t == "*":
                pos += 1
                leaves.append((path + ["*"], None, off))
                return
            if t in (",", "}"):
                return
            if t == "::":
                pos += 1
                continue
            # identifier
            name = t[2:] if t.startswith("r#") else t
            pos += 1
            if pos < len(toks) and toks[pos][0] == "::":
                path.append(name)
                pos += 1
                continue
            bind = name
            if pos + 1 < len(toks) and toks[pos][0] == "as":
                bind = toks[pos + 1][0]
                pos += 2
            if name == "self":
                bind = bind if bind != "self" else (path[-1] if path else None)
                leaves.append((path or ["self"], bind, off))
            else:
                leaves.append((path + [name], bind, off))
            return

    while pos < len(toks):
        before = pos
        tree([])
        if pos < len(toks) and toks[pos][0] == ",":
            pos += 1
        if pos == before:
            pos += 1
    return leaves


def collect_refs(mf: ModFile) -> None:
    s = mf.stripped
    use_spans = []
    for m in _USE.finditer(s):
        if in_spans(mf.test_spans, m.start()):
            continue
        toks, end = tokenize_use(s, m.end())
        if toks is None or not toks:
            continue
        head = s[max(0, m.start() - 40):m.start()]
        is_pub = bool(re.search(r"\bpub\s*(?:\([^()]*\))?\s*$", head))
        use_spans.append((m.start(), end))
        scope = mf.scope_at(m.start())
        for segs, bind, off in parse_use_tree(toks):
            mf.refs.append(
                Ref(mf.path, mf.line_of(off), "::".join(segs), scope, segs, True, bind, is_pub)
            )
    mf.use_spans = use_spans
    for m in _DEF.finditer(s):
        if not in_spans(mf.test_spans, m.start()) and mf.scope_at(m.start()) == mf.modpath:
            mf.defs.add(m.group(2))
    code = list(s)
    for a, b in mf.test_spans + use_spans:
        code[a:b] = " " * (b - a)
    # Names its code uses: not a path's tail (`x::name`), not a field or
    # method (`.name`); a path's head is resolved as a path above.
    mf.idents = set(re.findall(r"(?<![\w:.])(?:r#)?([A-Za-z_]\w*)(?!\s*::)", "".join(code)))
    attr_spans = []
    for m in _ATTR_START.finditer(s):
        attr_spans.append((m.start(), match_close(s, m.end() - 1)))
    skip = mf.test_spans + use_spans
    for m in _PATHLIKE.finditer(s):
        a = m.start()
        if in_spans(skip, a):
            continue
        k = a - 1
        while k >= 0 and s[k] in " \t":
            k -= 1
        if k >= 0 and (s[k] == "$" or s[k:k + 1] == ":" and s[k - 1:k] == ":"):
            continue  # `$crate::..` or the tail of a longer path
        if re.search(r"\bpub\s*\(\s*in\s+$", s[max(0, a - 20):a]):
            continue  # pub(in crate::x)
        segs = [x.strip().removeprefix("r#") for x in m.group().split("::")]
        mf.refs.append(
            Ref(mf.path, mf.line_of(a), "::".join(segs), mf.scope_at(a), segs, False)
        )
    for lit in mf.lits:
        if in_spans(mf.test_spans, lit.start) or not in_spans(attr_spans, lit.start):
            continue
        if _STR_PATH.fullmatch(lit.value):
            segs = lit.value.split("::")
            mf.refs.append(
                Ref(mf.path, mf.line_of(lit.start), f'"{lit.value}"', mf.scope_at(lit.start),
                    segs, False)
            )


# --------------------------------------------------------------------------
# Crate model: module tree, resolution
# --------------------------------------------------------------------------


class Crate:
    def __init__(self, root: str, key: str, src: str):
        self.root = root
        self.key = key
        self.src = src
        self.files: dict[str, ModFile] = {}  # rel path -> ModFile
        self.modules: dict[tuple, str] = {}  # module path -> file (inline too)
        self.children: dict[tuple, dict[str, tuple]] = {}  # scope -> name -> module
        self.aliases: dict[tuple, dict[str, tuple]] = {}
        self.reexports: dict[str, tuple[tuple, str]] = {}  # root name -> (target, file)
        self.warnings: list[str] = []
        self._ns: dict[tuple, dict[str, str]] = {}
        self._load()

    def rel(self, p: str) -> str:
        return os.path.relpath(p, self.root).replace(os.sep, "/")

    def _read(self, absp: str, modpath: tuple, test: bool) -> ModFile:
        with open(absp, encoding="utf-8") as f:
            text = f.read()
        mf = ModFile(self.rel(absp), modpath, self.key, test=test)
        mf.text = text
        mf.lines = count_lines(text)
        mf.stripped, mf.lits = strip_rust(text)
        prepare(mf)
        return mf

    def _load(self) -> None:
        srcdir = os.path.join(self.root, self.src)
        lib = os.path.join(srcdir, "lib.rs")
        if not os.path.isfile(lib):
            lib = os.path.join(srcdir, "main.rs")
        queue = []
        if os.path.isfile(lib):
            queue.append((lib, (), True, False))
        seen = set()
        while queue:
            absp, modpath, mod_rs, test = queue.pop(0)
            absp = os.path.normpath(absp)
            if absp in seen:
                continue
            seen.add(absp)
            mf = self._read(absp, modpath, test or is_test_name(self.rel(absp)))
            self.files[mf.path] = mf
            self.modules[modpath] = mf.path
            for a, b, mp in mf.inline:
                self.modules.setdefault(mp, mf.path)
                self.children.setdefault(mp[:-1], {})[mp[-1]] = mp
            fdir = os.path.dirname(absp)
            own_dir = fdir if mod_rs else os.path.join(fdir, os.path.splitext(os.path.basename(absp))[0])
            for name, path_attr, cfg_test, chain in mod_decls(mf):
                child_mp = modpath + tuple(chain) + (name,)
                self.children.setdefault(child_mp[:-1], {})[name] = child_mp
                if path_attr is not None:
                    base = fdir if not chain else os.path.join(own_dir, *chain)
                    cand = [os.path.join(base, path_attr)]
                    child_mod_rs = True
                else:
                    base = os.path.join(own_dir, *chain)
                    cand = [os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")]
                    child_mod_rs = None
                hit = next((c for c in cand if os.path.isfile(c)), None)
                if hit is None:
                    self.warnings.append(f"{mf.path}: `mod {name};` has no file (tried {', '.join(self.rel(c) for c in cand)})")
                    continue
                if child_mod_rs is None:
                    child_mod_rs = os.path.basename(hit) == "mod.rs"
                queue.append((hit, child_mp, child_mod_rs, mf.test or cfg_test))
        # files no `mod` reaches: map by convention
        for dirpath, dirnames, filenames in os.walk(srcdir):
            dirnames.sort()
            for fn in sorted(filenames):
                if not fn.endswith(".rs"):
                    continue
                absp = os.path.normpath(os.path.join(dirpath, fn))
                if absp in seen:
                    continue
                relsrc = os.path.relpath(absp, srcdir).replace(os.sep, "/")
                parts = relsrc[:-3].split("/")
                if parts[-1] == "mod":
                    parts = parts[:-1]
                mp = tuple(parts)
                mf = self._read(absp, mp, is_test_name(self.rel(absp)))
                mf.orphan = True
                self.files[mf.path] = mf
                self.modules.setdefault(mp, mf.path)
                for a, b, imp in mf.inline:
                    self.modules.setdefault(imp, mf.path)
                    self.children.setdefault(imp[:-1], {})[imp[-1]] = imp
                if not mf.test:
                    self.warnings.append(f"{mf.path}: no `mod` declares it (mapped as {'::'.join(mp)})")
        for mf in self.files.values():
            if not mf.test:
                collect_refs(mf)
        self._resolve()

    # -- resolution -------------------------------------------------------

    def start_of(self, segs: list, scope: tuple):
        """Absolute module path a path starts from, and the rest of it; None
        for a path into another crate."""
        i = 0
        first = segs[0]
        if first == "crate":
            base = ()
            i = 1
        elif first in ("self", "super"):
            base = scope
            while i < len(segs) and segs[i] in ("self", "super"):
                if segs[i] == "super":
                    if not base:
                        return None
                    base = base[:-1]
                i += 1
        else:
            # a name in scope: a child module, or a module a `use` brought in
            s = scope
            hit = self.children.get(s, {}).get(first) or self.aliases.get(s, {}).get(first)
            if hit is None:
                return None
            base = hit
            i = 1
        return base, segs[i:]

    def land(self, absolute: tuple) -> tuple[tuple, str]:
        for k in range(len(absolute), -1, -1):
            f = self.modules.get(absolute[:k])
            if f is not None:
                return absolute[:k], f
        return (), self.modules.get((), "")

    def _resolve_ref(self, r: Ref) -> None:
        segs = [x for x in r.segs if x != "*"]
        if not segs or segs[0] == "::":
            return
        st = self.start_of(segs, r.scope)
        if st is None:
            return
        base, rest = st
        r.target = base + tuple(rest)
        _, r.file = self.land(r.target)

    def _resolve(self) -> None:
        refs = [r for mf in self.files.values() for r in mf.refs]
        # module aliases from `use` (iterate: `use crate::a; use a::b;`)
        for _ in range(5):
            changed = False
            for r in refs:
                if not r.in_use or not r.bind or r.bind == "_":
                    continue
                self._resolve_ref(r)
                if r.target is not None and r.target in self.modules:
                    tab = self.aliases.setdefault(r.scope, {})
                    if tab.get(r.bind) != r.target:
                        tab[r.bind] = r.target
                        changed = True
            if not changed:
                break
        for r in refs:
            self._resolve_ref(r)
        # root re-exports: `pub use` at the crate root
        for r in refs:
            if r.in_use and r.is_pub and r.scope == () and r.target is not None and r.bind:
                self.reexports[r.bind] = (r.target, r.file)
        for r in refs:
            if r.target is not None and r.file and self.land(r.target)[0] == () and r.target:
                name = r.target[0]
                if name in self.reexports and self.modules.get(()) != self.reexports[name][1]:
                    r.via_root = self.reexports[name][1]

    # -- views ------------------------------------------------------------

    def live_files(self):
        return [mf for mf in self.files.values() if not mf.test]

    def lib(self) -> str:
        return self.modules.get((), "")

    def namespace(self, mp: tuple, _seen=None) -> dict[str, str]:
        """What `use <mp>::*` brings in: name -> the file that defines it
        (the module's own items, its `use` bindings, and its globs, followed
        through re-exports). The crate root is the facade: nothing is looked
        up through it."""
        if mp in self._ns:
            return self._ns[mp]
        seen = _seen or set()
        if mp in seen:
            return {}
        seen.add(mp)
        path = self.modules.get(mp)
        ns: dict[str, str] = {}
        mf = self.files.get(path) if path else None
        if mf is None or mf.modpath != mp:
            return ns
        for r in mf.refs:
            if not r.in_use or r.scope != mp or r.target is None:
                continue
            if r.segs and r.segs[-1] == "*":
                if r.target and self.land(r.target)[0] != ():
                    for k, v in self.namespace(r.target, seen).items():
                        ns.setdefault(k, v)
        for r in mf.refs:
            if r.in_use and r.scope == mp and r.bind and r.target is not None:
                f = self.item_file(r.target, seen)
                if f:
                    ns[r.bind] = f
        for name in mf.defs:
            ns[name] = mf.path
        if _seen is None:
            self._ns[mp] = ns
        return ns

    def item_file(self, absolute: tuple, seen=None) -> str:
        """The file an absolute path's item lives in, through the re-exports
        of the module it lands in (not the root's)."""
        mp, f = self.land(absolute)
        if mp != () and len(absolute) == len(mp) + 1:
            hit = self.namespace(mp, seen).get(absolute[-1])
            if hit:
                return hit
        return f

    def edges(self, through_root: bool = False) -> dict[tuple[str, str], Ref]:
        """File arrows. A glob import draws an arrow to each file whose item
        the importing file's code names; a `pub use` (a re-export: the
        facade) draws one only when the file's own code names it."""
        out: dict[tuple[str, str], Ref] = {}
        lib = self.lib()
        for mf in self.live_files():
            for r in mf.refs:
                if r.target is None:
                    continue
                if r.in_use and r.segs and r.segs[-1] == "*":
                    if self.land(r.target)[0] == () and r.target == ():
                        continue
                    ns = self.namespace(r.target) if self.land(r.target)[0] != () else {}
                    named: dict[str, list] = {}
                    for n in sorted(mf.idents):
                        if n in ns and n not in mf.defs:
                            named.setdefault(ns[n], []).append(n)
                    if not ns:
                        named = {r.file: []}
                    for dst, names in named.items():
                        if dst and dst != mf.path and dst != lib and not (
                            self.files.get(dst) is not None and self.files[dst].test
                        ):
                            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                            via = Ref(r.src, r.line, f"{r.text} ({shown})" if names else r.text,
                                      r.scope, r.segs, r.in_use, r.bind, r.is_pub, r.target, dst)
                            out.setdefault((mf.path, dst), via)
                    continue
                elif r.in_use and r.is_pub and not (r.bind and r.bind in mf.idents):
                    continue
                else:
                    dst = self.item_file(r.target) if r.target else r.file
                    if dst == lib and through_root and r.via_root:
                        dst = r.via_root
                    dsts = {dst}
                for dst in dsts:
                    if not dst or dst == mf.path or dst == lib:
                        continue
                    if self.files.get(dst) is not None and self.files[dst].test:
                        continue
                    out.setdefault((mf.path, dst), r)
        return out

    def top(self, path: str) -> str:
        mp = self.files[path].modpath
        return mp[0] if mp else "(root)"

    def short(self, path: str) -> str:
        return os.path.relpath(os.path.join(self.root, path), os.path.join(self.root, self.src)).replace(os.sep, "/")


# --------------------------------------------------------------------------
# Graph: strongly connected components
# --------------------------------------------------------------------------


def sccs(nodes, adj):
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(adj.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------


def fmt_ref(r: Ref) -> str:
    return f"{r.src}:{r.line}: {r.text}"


def under(mp: tuple, mods: list) -> str | None:
    return mp[0] if mp and mp[0] in mods else None


def named_module(c: Crate, r: Ref) -> tuple[tuple | None, bool]:
    """The absolute path a ref names, and whether through a root re-export."""
    if r.target is None:
        return None, False
    if r.via_root:
        mf = c.files.get(r.via_root)
        return (mf.modpath if mf else None), True
    return r.target, False


def find_ident_hits(c: Crate, mf: ModFile, ident: str) -> list[tuple[int, str]]:
    s = mf.stripped
    foreign = set()  # the ident imported from another crate in this file
    for r in mf.refs:
        if r.in_use and r.bind == ident and r.target is None:
            foreign.add(r.scope)
    hits = []
    for m in re.finditer(r"(?<![\w$])" + re.escape(ident) + r"\b", s):
        a = m.start()
        if in_spans(mf.test_spans, a):
            continue
        # the path it ends: walk back over `seg ::`
        k = a
        pre = s[max(0, a - 200):a]
        pm = re.search(r"((?:(?:r#)?[A-Za-z_]\w*\s*::\s*)+)$", pre)
        qual = pm.group(1) if pm else ""
        text = (qual.replace(" ", "") + ident)
        if qual:
            segs = [x.strip() for x in qual.split("::") if x.strip()] + [ident]
            st = c.start_of(segs, mf.scope_at(a))
            if st is None:
                continue  # e.g. oneshot::Sender, tokio::sync::mpsc::Sender
        else:
            # a bare name; inside a use tree it may be a leaf of a grouped path
            u = next((r for r in mf.refs if r.in_use and r.line == mf.line_of(a)
                      and r.segs and r.segs[-1] == ident), None)
            if u is not None:
                if u.target is None:
                    continue
                text = u.text
            elif mf.scope_at(a) in foreign:
                continue
        hits.append((mf.line_of(a), text))
        del k
    return hits


def run_checks(crates: dict[str, Crate], through_root: bool = False):
    """Returns a dict of check name -> list of (crate, failed?, lines)."""
    res = {}

    # 1 + 2: circles
    circ_files, circ_folders = [], []
    for key, c in crates.items():
        edges = c.edges(through_root)
        adj: dict[str, set] = {}
        for a, b in edges:
            adj.setdefault(a, set()).add(b)
        nodes = [mf.path for mf in c.live_files()]
        comps = sccs(nodes, adj)
        lines = []
        for n, comp in enumerate(comps, 1):
            inner = sorted((a, b) for (a, b) in edges if a in comp and b in comp)
            lines.append(f"circle {n}: {len(comp)} files, {len(inner)} arrows")
            lines.append("  files: " + ", ".join(c.short(p) for p in comp))
            for a, b in inner:
                lines.append(f"  {c.short(a)} -> {c.short(b)}    {fmt_ref(edges[(a, b)])}")
        circ_files.append((key, bool(comps), lines, len(comps)))

        fedges: dict[tuple[str, str], Ref] = {}
        fcount: dict[tuple[str, str], int] = {}
        for (a, b), r in sorted(edges.items()):
            ta, tb = c.top(a), c.top(b)
            if ta != tb:
                fedges.setdefault((ta, tb), r)
                fcount[(ta, tb)] = fcount.get((ta, tb), 0) + 1
        fadj: dict[str, set] = {}
        for a, b in fedges:
            fadj.setdefault(a, set()).add(b)
        fnodes = {c.top(p) for p in nodes}
        fcomps = sccs(fnodes, fadj)
        lines = []
        for n, comp in enumerate(fcomps, 1):
            inner = sorted((a, b) for (a, b) in fedges if a in comp and b in comp)
            lines.append(f"circle {n}: {len(comp)} folders/modules, {len(inner)} arrows")
            lines.append("  modules: " + ", ".join(comp))
            for a, b in inner:
                lines.append(f"  {a} -> {b} ({fcount[(a, b)]} file arrows)    {fmt_ref(fedges[(a, b)])}")
        circ_folders.append((key, bool(fcomps), lines, len(fcomps)))
    res["circles-files"] = circ_files
    res["circles-folders"] = circ_folders

    # 3: forbidden directions
    forb = []
    for key, c in crates.items():
        lines = []
        rules = []
        for ck, mods, target in FORBIDDEN_IMPORTS:
            if ck == key:
                rules.append((mods, [target], f"no crate::{target} under {', '.join(m + '/' for m in mods)}"))
        for ck, group in EXCLUSIVE_GROUPS:
            if ck == key:
                for g in group:
                    others = [o for o in group if o != g]
                    rules.append(([g], others, f"transport {g} names no other transport"))
        existing = {mp[0] for mp in c.modules if mp}
        absent = sorted({m for mods, targets, _ in rules for m in mods + targets if m not in existing}
                        | {m for ck, mods, _ in FORBIDDEN_IDENTS if ck == key for m in mods
                           if m not in existing})
        for mods, targets, desc in rules:
            hits = []
            live_mods = [m for m in mods if m in existing]
            live_targets = [t for t in targets if t in existing]
            if not live_mods or not live_targets:
                continue
            for mf in c.live_files():
                if not under(mf.modpath, live_mods):
                    continue
                for r in mf.refs:
                    t, via = named_module(c, r)
                    if t and t[0] in live_targets and under(r.scope, live_mods):
                        hits.append(fmt_ref(r) + (f"  (through the root re-export of {r.via_root})" if via else ""))
            if hits:
                lines.append(f"{desc}: {len(hits)} hits")
                lines.extend("  " + h for h in sorted(set(hits), key=hits.index))
        for ck, mods, ident in FORBIDDEN_IDENTS:
            if ck != key:
                continue
            hits = []
            for mf in c.live_files():
                if under(mf.modpath, mods):
                    hits += [f"{mf.path}:{ln}: {t}" for ln, t in find_ident_hits(c, mf, ident)]
            if hits:
                lines.append(f"no {ident} under {', '.join(m + '/' for m in mods)}: {len(hits)} hits")
                lines.extend("  " + h for h in hits)
        nhits = sum(1 for l in lines if l.startswith("  "))
        if absent:
            lines.append("(rules about modules not in this tree pass trivially: " + ", ".join(absent) + ")")
        forb.append((key, nhits > 0, lines, nhits))
    res["forbidden"] = forb

    # 4: root re-export imports
    rootw = []
    for key, c in crates.items():
        if key not in NO_ROOT_REEXPORT_IMPORTS:
            continue
        lines = []
        count = 0
        for mf in c.live_files():
            if mf.path == c.lib():
                continue
            by_line: dict[int, list[str]] = {}
            for r in mf.refs:
                if r.via_root:
                    count += 1
                    mod = "::".join(c.files[r.via_root].modpath)
                    item = f"{r.target[0]} ({mod})"
                    if item not in by_line.setdefault(r.line, []):
                        by_line[r.line].append(item)
            for ln, items in sorted(by_line.items()):
                lines.append(f"{mf.path}:{ln}: crate::" + ", crate::".join(items))
        rootw.append((key, bool(lines), lines, count))
    res["root-reexport"] = rootw

    # 5: file size
    size = []
    for key, c in crates.items():
        lines = []
        for mf in sorted(c.files.values(), key=lambda m: -m.lines):
            if mf.test or is_test_name(mf.path):
                continue
            if mf.lines > MAX_LINES:
                lines.append(f"{mf.path}: {mf.lines} lines")
        size.append((key, bool(lines), lines, len(lines)))
    res["size"] = size
    return res


TITLES = {
    "circles-files": "1. Import circles, file level",
    "circles-folders": "2. Import circles, folder level (top-level module under the crate root)",
    "forbidden": "3. Forbidden directions",
    "root-reexport": "4. Root re-export imports: `crate::Item (the module to name instead)`",
    "size": f"5. File size (over {MAX_LINES} lines)",
}


SHORT = {
    "circles-files": "file circles",
    "circles-folders": "folder circles",
    "forbidden": "forbidden directions",
    "root-reexport": "root re-export imports",
    "size": "oversize files",
}


def report(root, crates, res, strict, quiet, graph, through_root) -> int:
    failed = 0
    out = []
    nfiles = sum(len(c.live_files()) for c in crates.values())
    if not quiet:
        out.append(f"layout-check: {root} ({len(crates)} crates, {nfiles} non-test files)")
        for c in crates.values():
            for w in c.warnings:
                out.append(f"  note: {w}")
    summary = []
    for name, rows in res.items():
        warn_only = name == "root-reexport" and not strict
        sect = []
        total = 0
        for key, bad, lines, count in rows:
            total += count if bad else 0
            if bad:
                tag = "WARN" if warn_only else "FAIL"
                sect.append(f"{tag} {key} ({CRATES.get(key, key)}): {count}")
                sect.extend("    " + l for l in lines)
            elif not quiet:
                sect.append(f"ok   {key}")
                sect.extend("    " + l for l in lines)
        sect_failed = any(r[1] for r in rows) and not warn_only
        failed |= sect_failed
        state = "FAIL" if sect_failed else ("warn" if any(r[1] for r in rows) else "ok")
        summary.append(f"{SHORT[name]} {state} ({total})")
        if quiet and not sect_failed:
            continue
        out.append("")
        out.append(f"== {TITLES[name]}")
        out.extend(sect)
    if graph:
        for key, c in crates.items():
            out.append("")
            out.append(f"== file graph: {key}{' (through root re-exports)' if through_root else ''}")
            for (a, b), r in sorted(c.edges(through_root).items()):
                out.append(f"{a} -> {b}    {fmt_ref(r)}")
    out.append("")
    out.append("== Summary: " + ("FAIL" if failed else "OK") + " - " + "; ".join(summary))
    print("\n".join(out))
    return 1 if failed else 0


def load(root: str, crates_cfg: dict[str, str]) -> dict[str, Crate]:
    out = {}
    for key, src in crates_cfg.items():
        if os.path.isdir(os.path.join(root, src)):
            out[key] = Crate(root, key, src)
    return out


# --------------------------------------------------------------------------
# Self-test
# --------------------------------------------------------------------------


def self_test() -> int:
    failures = []

    def check(name, got, want):
        if got != want:
            failures.append(f"{name}: got {got!r}, want {want!r}")
        else:
            print(f"ok   {name}")

    def uses(src: str):
        stripped, _ = strip_rust(src)
        toks, _ = tokenize_use(stripped, _USE.search(stripped).end())
        return sorted(("::".join(s), b) for s, b, _ in parse_use_tree(toks))

    check("grouped use", uses("use crate::{a::B, c::{d, e}};"),
          sorted([("crate::a::B", "B"), ("crate::c::d", "d"), ("crate::c::e", "e")]))
    check("nested multi-line use with self, alias, glob",
          uses("pub(crate) use super::{\n  x::{self, Y as Z},\n  w::{q::{r, s::*}},\n};"),
          sorted([("super::x", "x"), ("super::x::Y", "Z"), ("super::w::q::r", "r"),
                  ("super::w::q::s::*", None)]))

    src = (
        '// crate::lc::x\n'
        '/// [`A`](crate::doclink::A)\n'
        '/* crate::bc /* nested crate::nest */ crate::after */\n'
        'const S: &str = "crate::string::x \\" crate::esc";\n'
        'const R: &str = r#"crate::raw "quoted" x"#;\n'
        "const C: char = '{'; fn f<'a>(x: &'a u8) {}\n"
        'fn g() { crate::real::f(); let _ = $crate::mac::x; }\n'
    )
    stripped, lits = strip_rust(src)
    check("strip keeps length and lines", (len(stripped), stripped.count("\n")),
          (len(src), src.count("\n")))
    found = re.findall(r"crate::\w+", stripped)
    check("comments, doc links, strings, raw strings stripped", found, ["crate::real", "crate::mac"])
    check("string literals recorded", [l.value for l in lits][:1], ['crate::string::x \\" crate::esc'])
    check("braces balanced after stripping char literal",
          stripped.count("{") - stripped.count("}"), 0)

    with tempfile.TemporaryDirectory() as tmp:
        src_dir = os.path.join(tmp, "c", "src")
        os.makedirs(os.path.join(src_dir, "w"))
        os.makedirs(os.path.join(src_dir, "tests"))
        files = {
            "lib.rs": "mod a;\nmod b;\nmod w;\n#[path = \"odd_name.rs\"]\nmod p;\n"
                      "pub use a::Thing;\n",
            "a.rs": "use crate::{b::X, w};\n/// [y](crate::p::Y)\npub struct Thing;\n"
                    "fn f() { w::inner::go(); }\n"
                    "#[cfg(test)]\nmod tests {\n    use crate::p::Q; fn t() { crate::p::q(); }\n}\n",
            "b.rs": "pub struct X;\nfn g() { super::a::f(); let _ = crate::Thing; }\n"
                    "#[cfg(test)]\nfn only_test() { crate::p::z(); }\n"
                    "struct T { #[cfg(test)] t: crate::p::T, u: crate::w::U }\n"
                    "pub(in crate::p) fn vis() {}\n",
            "w/mod.rs": "mod inner;\npub(crate) mod env {\n    pub fn e() { super::inner::go(); }\n}\n",
            "w/inner.rs": "pub fn go() { let _ = \"crate::a::x\"; }\n"
                          "#[derive(Serialize)] struct S { #[serde(with = \"crate::p\")] x: u8 }\n",
            "odd_name.rs": "pub struct Y;\nfn h() { let s = \"}\"; }\nmod tests { use crate::a::Q; }\n",
            "tests/t.rs": "use crate::a::Z;\n",
        }
        for rel, body in files.items():
            with open(os.path.join(src_dir, rel), "w") as f:
                f.write(body)
        crates = load(tmp, {"t": "c/src"})
        c = crates["t"]
        check("#[path] module mapped", c.modules.get(("p",)), "c/src/odd_name.rs")
        check("tests/ folder file is a test file", c.files["c/src/tests/t.rs"].test, True)
        edges = sorted((c.short(a), c.short(b)) for a, b in c.edges())
        check("edges (test code ignored, facade ignored, aliases and attribute strings followed)",
              edges, [("a.rs", "b.rs"), ("a.rs", "w/inner.rs"), ("a.rs", "w/mod.rs"),
                      ("b.rs", "a.rs"), ("b.rs", "w/mod.rs"), ("w/inner.rs", "odd_name.rs"),
                      ("w/mod.rs", "w/inner.rs")])
        via = sorted(c.short(r.via_root) for mf in c.live_files() for r in mf.refs if r.via_root)
        check("root re-export seen", via, ["a.rs"])
        res = run_checks(crates)
        (_, bad, lines, n), = res["circles-files"]
        check("two-file cycle detected", (bad, n, lines[1] if lines else None),
              (True, 1, "  files: a.rs, b.rs"))
        (_, fbad, _, fn_), = res["circles-folders"]
        check("folder-level cycle detected", (fbad, fn_), (True, 1))

    with tempfile.TemporaryDirectory() as tmp:
        src_dir = os.path.join(tmp, "c", "src")
        os.makedirs(os.path.join(src_dir, "f"))
        files = {
            "lib.rs": "mod f;\n",
            # a facade: re-exports its children, names none of them itself
            "f/mod.rs": "mod core;\nmod low;\nmod high;\nmod loopy;\npub use core::*;\n"
                        "pub(crate) use low::{Low, low_fn};\npub use high::*;\npub use loopy::*;\n"
                        "pub struct Shared;\n",
            "f/core.rs": "pub struct Core;\n",
            "f/low.rs": "use super::*;\npub struct Low(Core);\npub fn low_fn() { let _ = Shared; }\n"
                        "fn g(x: u8) { x.High(); let _ = y::High; }\n",
            "f/high.rs": "use super::*;\npub struct High(Low);\npub fn uses_loop() { Loopy; }\n",
            "f/loopy.rs": "use super::*;\npub struct Loopy;\nfn back() { let _ = High; }\n",
        }
        for rel, body in files.items():
            with open(os.path.join(src_dir, rel), "w") as f:
                f.write(body)
        crates = load(tmp, {"t": "c/src"})
        c = crates["t"]
        edges = sorted((c.short(a), c.short(b)) for a, b in c.edges())
        check("a glob names the files of the items used; a facade's re-exports draw none",
              edges, [("f/high.rs", "f/loopy.rs"), ("f/high.rs", "f/low.rs"),
                      ("f/loopy.rs", "f/high.rs"), ("f/low.rs", "f/core.rs"),
                      ("f/low.rs", "f/mod.rs")])
        res = run_checks(crates)
        (_, bad, lines, n), = res["circles-files"]
        check("a sibling circle through a glob is found", (bad, n, lines[1] if lines else None),
              (True, 1, "  files: f/high.rs, f/loopy.rs"))

    if failures:
        print("\n".join("FAIL " + f for f in failures))
        return 1
    print("self-test: all passed")
    return 0


# --------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strict", action="store_true", help="root re-export imports fail too")
    ap.add_argument("--graph", action="store_true", help="print the file graph as `a -> b` lines")
    ap.add_argument("--quiet", action="store_true", help="print only failures")
    ap.add_argument("--through-root", action="store_true",
                    help="route paths through root re-exports (crate::Error) to the file behind them")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="workspace root (default: the script's parent directory)")
    ap.add_argument("--self-test", action="store_true", help="run the parser's built-in tests")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    crates = load(args.root, CRATES)
    if not crates:
        print(f"layout-check: no crate source dirs under {args.root}", file=sys.stderr)
        return 2
    res = run_checks(crates, args.through_root)
    return report(args.root, crates, res, args.strict, args.quiet, args.graph, args.through_root)


if __name__ == "__main__":
    sys.exit(main())
