#!/usr/bin/env python3
"""Structure checks that scripts/test.sh runs beside the lints (docs/architecture.md, "Module maps").

1. Leaves stay leaves: in every crate, the imports between the crate's own top-level modules
   (a file or folder directly under src/) form no cycle. An edge a -> b is any `use crate::b...`,
   `crate::b::` path in code, or `super::` path that leaves a folder module for b, written in a
   file of module a. Test code is not counted: `#[cfg(test)]` items and modules, files named
   `*tests.rs` and files under a `tests/` folder. The crate root (lib.rs, main.rs) is the facade,
   not a module: a path to one of its re-exports counts as a path to the module that defines it.
2. docs/architecture.md names only what exists: every backticked `module::item` / `Type::member`
   path (and every path in its code blocks) resolves in the code, every backticked `*.rs` file
   (with its `::test_fn` when given) and `folder/` exists, and every module a module map lists
   (`` `name` — ``) is a module of that map's crate.

Prints each cycle (`crate: a -> b -> a`, then the file:line of each edge) and each stale name, and
exits 1 if there is any. Python 3.11 standard library only.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SKIP_DIRS = {".git", "target", "node_modules", "__pycache__", ".venv", "venv", ".pytest_cache"}

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ---------------------------------------------------------------------------------------------
# Rust source, reduced to what the checks read


def strip_code(src: str) -> str:
    """The source with comments and the insides of string and char literals blanked (same length,
    newlines kept, so offsets and line numbers stay valid)."""
    out = list(src)
    n = len(src)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    def quoted_end(j: int) -> int:
        """j is just past an opening quote; returns the index just past the closing one."""
        while j < n:
            if src[j] == "\\":
                j += 2
            elif src[j] == '"':
                return j + 1
            else:
                j += 1
        return n

    i = 0
    while i < n:
        c = src[i]
        if c == "/" and src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif c == "/" and src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c == '"':
            j = quoted_end(i + 1)
            blank(i + 1, j - 1)
            i = j
        elif c == "'":
            if i + 1 < n and src[i + 1] == "\\":
                j = src.find("'", i + 3)
                j = n if j < 0 else j + 1
                blank(i + 1, j - 1)
                i = j
            elif i + 2 < n and src[i + 2] == "'":
                blank(i + 1, i + 2)
                i += 3
            else:
                i += 1  # a lifetime or a label
        elif c.isalpha() or c == "_":
            m = IDENT.match(src, i)
            word, j = m.group(0), m.end()
            if word in ("r", "br", "cr") and j < n and src[j] in '#"':
                k = j
                while k < n and src[k] == "#":
                    k += 1
                if k < n and src[k] == '"':
                    close = '"' + "#" * (k - j)
                    e = src.find(close, k + 1)
                    e = n if e < 0 else e + len(close)
                    blank(k + 1, e - len(close))
                    i = e
                    continue
                i = k  # a raw identifier, r#name
            elif word in ("b", "c") and j < n and src[j] == '"':
                e = quoted_end(j + 1)
                blank(j + 1, e - 1)
                i = e
            elif word == "b" and j < n and src[j] == "'":
                e = src.find("'", j + 2 if src[j + 1 : j + 2] == "\\" else j + 1)
                e = n if e < 0 else e + 1
                blank(j + 1, e - 1)
                i = e
            else:
                i = j
        else:
            i += 1
    return "".join(out)


OPEN, CLOSE = "([{", ")]}"


def matching(s: str, i: int) -> int:
    """s[i] is an opening bracket; returns the index just past its match (brackets of all kinds
    nest; the text is stripped, so none hides in a literal)."""
    depth = 0
    for j in range(i, len(s)):
        ch = s[j]
        if ch in OPEN:
            depth += 1
        elif ch in CLOSE:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


ATTR = re.compile(r"#\s*(!?)\s*\[")
ITEM_KEYWORDS = {"fn", "impl", "struct", "enum", "trait", "mod", "union", "macro_rules", "async", "unsafe", "extern"}


def test_only_cfg(attr_body: str) -> bool:
    """Whether `cfg(...)`'s predicate holds only under test: `test`, or `all(..., test, ...)`."""
    m = re.fullmatch(r"\s*cfg\s*\((.*)\)\s*", attr_body, re.S)
    if not m:
        return False
    pred = m.group(1).strip()
    if pred == "test":
        return True
    a = re.fullmatch(r"all\s*\((.*)\)", pred, re.S)
    if not a:
        return False
    args, depth, cur = [], 0, ""
    for ch in a.group(1):
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    args.append(cur.strip())
    return "test" in args


def item_end(s: str, i: int) -> int:
    """The end of the item, field, variant, match arm or statement starting at i."""
    m = re.compile(r"\s*(?:pub\s*(?:\([^)]*\))?\s*)?(\w+)\s*(\w*)").match(s, i)
    kw, nxt = (m.group(1), m.group(2)) if m else ("", "")
    to_semicolon = kw in ("use", "let", "static", "type") or (kw == "const" and nxt != "fn")
    item = kw in ITEM_KEYWORDS or kw == "const"
    depth, j = 0, i
    while j < len(s):
        ch = s[j]
        if ch == "{" and depth == 0 and not to_semicolon:
            return matching(s, j)
        if ch in OPEN:
            depth += 1
        elif ch in CLOSE:
            if depth == 0:
                return j  # the enclosing block closes
            depth -= 1
        elif depth == 0 and (ch == ";" or (ch == "," and not item and not to_semicolon)):
            return j + 1
        j += 1
    return j


def blank_test_code(code: str) -> str:
    """Blanks every `#[cfg(test)]` item (module, function, use, field, variant, arm) in stripped
    code; a file opening with `#![cfg(test)]` is blanked whole."""
    out = list(code)
    pos = 0
    while True:
        m = ATTR.search(code, pos)
        if not m:
            break
        end = matching(code, m.end() - 1)
        body = code[m.end() : end - 1]
        if not test_only_cfg(body):
            pos = end
            continue
        if m.group(1):  # inner attribute: the whole enclosing file
            return re.sub(r"[^\n]", " ", code)
        j = end
        while True:  # further attributes of the same item
            a = ATTR.match(code, j + len(code[j:]) - len(code[j:].lstrip()))
            if not a or a.group(1):
                break
            j = matching(code, a.end() - 1)
        stop = item_end(code, j)
        for k in range(m.start(), stop):
            if out[k] != "\n":
                out[k] = " "
        pos = stop
    return "".join(out)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# ---------------------------------------------------------------------------------------------
# Use trees and paths

USE = re.compile(r"\buse\s+(?=[\w$:{])")
USE_TOKEN = re.compile(r"\s*(::|\$?[A-Za-z_]\w*|[{},*;])")


@dataclass
class UsePath:
    segs: list[str]
    alias: str | None
    pos: int


def parse_use(code: str, start: int) -> tuple[list[UsePath], int]:
    """The paths of the use tree starting at `start` (just past `use`), and the offset past `;`."""
    toks: list[tuple[str, int]] = []
    j = start
    while True:
        m = USE_TOKEN.match(code, j)
        if not m:
            return [], j + 1
        toks.append((m.group(1), m.start(1)))
        j = m.end()
        if m.group(1) == ";":
            break
    paths: list[UsePath] = []

    def tree(k: int, prefix: list[str]) -> int:
        segs = list(prefix)
        if toks[k][0] == "::":
            k += 1
        while True:
            tok, p = toks[k]
            if tok == "{":
                k += 1
                while toks[k][0] != "}":
                    k = tree(k, segs)
                    if toks[k][0] == ",":
                        k += 1
                return k + 1
            if tok == "*":
                paths.append(UsePath(segs + ["*"], None, p))
                return k + 1
            segs.append(tok)
            k += 1
            if toks[k][0] == "::":
                k += 1
                continue
            alias = None
            if toks[k][0] == "as":
                alias = toks[k + 1][0]
                k += 2
            paths.append(UsePath(segs, alias, p))
            return k

    try:
        tree(0, [])
    except IndexError:
        pass
    return paths, j


CODE_PATH = re.compile(r"(?<![\w$])(\$?crate|super|self)((?:\s*::\s*[A-Za-z_]\w*)+)")


# ---------------------------------------------------------------------------------------------
# Crates and their module trees


@dataclass
class SourceFile:
    path: Path
    modpath: tuple[str, ...]  # () for the crate root
    test_only: bool
    raw: str
    code: str  # comments and literals blanked
    live: str = ""  # `code` with test code blanked too

    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


@dataclass
class Crate:
    dir: Path
    name: str  # the folder name under crates/ (engine, kernels, ...)
    package: str  # the package name, as an identifier (specula_engine)
    roots: list[Path] = field(default_factory=list)
    files: list[SourceFile] = field(default_factory=list)


MOD_DECL = re.compile(
    r"((?:#\s*\[(?:[^\[\]]|\[[^\]]*\])*\]\s*)*)(?:pub\s*(?:\([^)]*\))?\s*)?\bmod\s+([A-Za-z_]\w*)\s*;"
)


def is_test_file(path: Path) -> bool:
    return path.name.endswith("tests.rs") or "tests" in path.parts[:-1]


def walk_modules(crate: Crate, path: Path, modpath: tuple[str, ...], owns_dir: Path, test_only: bool, seen: set) -> None:
    if path in seen or not path.is_file():
        return
    seen.add(path)
    raw = path.read_text(encoding="utf-8")
    code = strip_code(raw)
    in_src = path.relative_to(crate.dir / "src")
    test_only = test_only or is_test_file(in_src)
    f = SourceFile(path, modpath, test_only, raw, code)
    f.live = blank_test_code(code)
    crate.files.append(f)
    for m in MOD_DECL.finditer(code):
        if code[: m.start()].count("{") != code[: m.start()].count("}"):
            continue  # inside an inline module: not followed
        attrs_raw = raw[m.start(1) : m.end(1)]
        child_test = test_only or any(
            test_only_cfg(code[a.end() : matching(code, a.end() - 1) - 1])
            for a in ATTR.finditer(code, m.start(1), m.end(1))
        )
        name = m.group(2)
        given = re.search(r'\bpath\s*=\s*"([^"]*)"', attrs_raw)
        if given:
            child = path.parent / given.group(1)
            child_dir = child.parent if child.name == "mod.rs" else child.parent / child.stem
        else:
            child = owns_dir / f"{name}.rs"
            if not child.is_file():
                child = owns_dir / name / "mod.rs"
            child_dir = owns_dir / name
        walk_modules(crate, child, modpath + (name,), child_dir, child_test, seen)


def load_crates() -> list[Crate]:
    crates = []
    for d in sorted((ROOT / "crates").iterdir()):
        manifest = d / "Cargo.toml"
        if not manifest.is_file():
            continue
        package = tomllib.loads(manifest.read_text())["package"]["name"].replace("-", "_")
        crate = Crate(d, d.name, package)
        seen: set = set()
        for root in ("lib.rs", "main.rs"):
            p = d / "src" / root
            if p.is_file():
                crate.roots.append(p)
                walk_modules(crate, p, (), p.parent, False, seen)
        crates.append(crate)
    return crates


def external_crates() -> set[str]:
    """Names a path may start with that are not ours: the dependencies and the standard ones."""
    names = {"std", "core", "alloc", "proc_macro", "test"}
    for manifest in [ROOT / "Cargo.toml", *sorted((ROOT / "crates").glob("*/Cargo.toml"))]:
        data = tomllib.loads(manifest.read_text())
        tables = [data.get("workspace", {}).get("dependencies", {})]
        for key in ("dependencies", "dev-dependencies", "build-dependencies"):
            tables.append(data.get(key, {}))
        for target in data.get("target", {}).values():
            for key in ("dependencies", "dev-dependencies"):
                tables.append(target.get(key, {}))
        for t in tables:
            names.update(k.replace("-", "_") for k in t)
    return names


# ---------------------------------------------------------------------------------------------
# Check 1: module cycles


def inline_mods(code: str) -> list[tuple[int, int, str]]:
    return [(m.start(), matching(code, m.end() - 1), m.group(1)) for m in re.finditer(r"\bmod\s+(\w+)\s*\{", code)]


def modpath_at(f: SourceFile, inl: list[tuple[int, int, str]], offset: int) -> tuple[str, ...]:
    return f.modpath + tuple(name for a, b, name in inl if a <= offset < b)


def root_reexports(crate: Crate, tops: set[str]) -> dict[str, str]:
    """Names the crate root re-exports -> the top-level module that defines them."""
    out = {}
    for f in crate.files:
        if f.modpath:
            continue
        for m in USE.finditer(f.live):
            for u in parse_use(f.live, m.end())[0]:
                segs = u.segs[1:] if u.segs[0] in ("crate", "self") else u.segs
                if segs and segs[0] in tops and segs[-1] != "*":
                    out[u.alias or segs[-1]] = segs[0]
    return out


def target_module(segs: list[str], at: tuple[str, ...], tops: set[str], reexports: dict[str, str]) -> str | None:
    if segs[0] in ("crate", "$crate"):
        rest = segs[1:]
    elif segs[0] == "super":
        k = 0
        while k < len(segs) and segs[k] == "super":
            k += 1
        if k > len(at):
            return None
        rest = list(at[: len(at) - k]) + segs[k:]
    elif segs[0] == "self":
        rest = list(at) + segs[1:]
    else:
        return None
    if not rest or rest[0] in ("*", "self"):
        return None
    return rest[0] if rest[0] in tops else reexports.get(rest[0])


def module_edges(crate: Crate) -> dict[tuple[str, str], list[str]]:
    tops = {f.modpath[0] for f in crate.files if f.modpath and not f.test_only}
    reexports = root_reexports(crate, tops)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for f in crate.files:
        if not f.modpath or f.test_only:
            continue
        code = f.live
        inl = inline_mods(code)
        src = f.modpath[0]
        found: list[tuple[list[str], int]] = []
        rest = list(code)
        for m in USE.finditer(code):
            paths, end = parse_use(code, m.end())
            found += [(u.segs, u.pos) for u in paths]
            for k in range(m.start(), end):
                if rest[k] != "\n":
                    rest[k] = " "
        rest_code = "".join(rest)
        for m in CODE_PATH.finditer(rest_code):
            segs = [m.group(1)] + [s.strip() for s in m.group(2).split("::") if s.strip()]
            found.append((segs, m.start()))
        for segs, pos in sorted(found, key=lambda x: x[1]):
            dst = target_module(segs, modpath_at(f, inl, pos), tops, reexports)
            where = f"{f.rel()}:{line_of(code, pos)}"
            if dst and dst != src and where not in edges[(src, dst)]:
                edges[(src, dst)].append(where)
    return edges


def strongly_connected(nodes: set[str], succ: dict[str, list[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


def cycles_of(comp: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """For every edge inside the component, the shortest cycle through it (deduplicated)."""
    inside = set(comp)
    found: dict[tuple[str, ...], list[str]] = {}
    for u in comp:
        for v in succ.get(u, []):
            if v not in inside:
                continue
            prev = {v: None}
            queue = deque([v])
            while queue and u not in prev:
                x = queue.popleft()
                for y in succ.get(x, []):
                    if y in inside and y not in prev:
                        prev[y] = x
                        queue.append(y)
            path, x = [], u
            while x is not None:
                path.append(x)
                x = prev[x]
            cycle = [u] + path[::-1][:-1]  # u -> v -> ... (back to u)
            k = cycle.index(min(cycle))
            cycle = cycle[k:] + cycle[:k]
            found[tuple(cycle)] = cycle
    return sorted(found.values(), key=lambda c: (len(c), c))


def check_cycles(crates: list[Crate]) -> int:
    problems = 0
    for crate in crates:
        edges = module_edges(crate)
        succ: dict[str, list[str]] = defaultdict(list)
        for a, b in sorted(edges):
            succ[a].append(b)
        nodes = {a for a, _ in edges} | {b for _, b in edges}
        for comp in strongly_connected(nodes, succ):
            if len(comp) < 2:
                continue
            for cycle in cycles_of(comp, succ):
                problems += 1
                print(f"{crate.name}: {' -> '.join(cycle + [cycle[0]])}")
                for a, b in zip(cycle, cycle[1:] + cycle[:1]):
                    where = edges[(a, b)]
                    more = f" (+{len(where) - 3} more)" if len(where) > 3 else ""
                    print(f"    {a} -> {b}: {', '.join(where[:3])}{more}")
    return problems


# ---------------------------------------------------------------------------------------------
# Check 2: names in docs/architecture.md


DEF = re.compile(r"\b(fn|struct|enum|trait|type|mod|const|static|union)\s+([A-Za-z_]\w*)|\bmacro_rules!\s*([A-Za-z_]\w*)")
IMPL = re.compile(r"\bimpl\b")


def impl_self_type(header: str) -> str | None:
    """`impl<T> Trait<X> for path::Type<T> where ...` -> `Type` (the header up to its `{`)."""
    h = header.strip()
    if h.startswith("<"):
        h = h[_angle_end(h, 0) :]
    h = re.split(r"\bwhere\b", h)[0]
    parts = re.split(r"\bfor\b", h)
    ty = parts[-1].strip()
    ty = ty.lstrip("&!").strip()
    ty = re.sub(r"^(dyn|mut)\s+", "", ty)
    m = re.match(r"((?:[A-Za-z_]\w*\s*::\s*)*)([A-Za-z_]\w*)", ty)
    return m.group(2) if m else None


def _angle_end(s: str, i: int) -> int:
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "<":
            depth += 1
        elif s[j] == ">" and s[j - 1] != "-":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def top_level_names(body: str) -> list[str]:
    """Identifiers at the top level of a `{ ... }` body's inside (an enum's variants and more)."""
    names, depth, i = [], 0, 0
    while i < len(body):
        ch = body[i]
        if ch in OPEN:
            depth += 1
        elif ch in CLOSE:
            depth -= 1
        elif depth == 0 and (ch.isalpha() or ch == "_"):
            m = IDENT.match(body, i)
            names.append(m.group(0))
            i = m.end()
            continue
        i += 1
    return names


@dataclass
class Index:
    files: set[str]  # every file in the repository, relative, posix
    dirs: set[str]
    modules: dict[tuple[str, tuple[str, ...]], list[SourceFile]]  # (package, modpath) -> files
    by_name: dict[str, list[tuple[str, tuple[str, ...]]]]  # a module's last name -> its keys
    packages: dict[str, str]  # package identifier -> crate folder name
    defs: dict[str, set[str]]  # file -> names it defines or imports
    members: dict[str, set[str]]  # type or trait name -> its fields, variants, methods, consts
    rust: dict[str, str]  # every Rust file -> its stripped code
    externals: set[str]


def build_index(crates: list[Crate]) -> Index:
    files, dirs = set(), set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        rel = Path(dirpath).relative_to(ROOT).as_posix()
        if rel != ".":
            dirs.add(rel)
        for name in filenames:
            files.add(name if rel == "." else f"{rel}/{name}")
    rust = {}
    for rel in sorted(files):
        if rel.endswith(".rs"):
            rust[rel] = strip_code((ROOT / rel).read_text(encoding="utf-8"))
    modules: dict = defaultdict(list)
    by_name: dict = defaultdict(list)
    packages = {}
    for crate in crates:
        packages[crate.package] = crate.name
        for f in crate.files:
            key = (crate.package, f.modpath)
            if key not in modules and f.modpath:
                by_name[f.modpath[-1]].append(key)
            modules[key].append(f)
    defs: dict[str, set[str]] = {}
    members: dict[str, set[str]] = defaultdict(set)
    for rel, code in rust.items():
        names = set()
        for m in DEF.finditer(code):
            names.add(m.group(2) or m.group(3))
        for m in USE.finditer(code):
            for u in parse_use(code, m.end())[0]:
                names.add(u.alias or u.segs[-1])
        defs[rel] = names
        for m in re.finditer(r"\b(struct|enum|trait|union)\s+([A-Za-z_]\w*)", code):
            brace = _body_start(code, m.end())
            if brace is None:
                continue
            body = code[brace + 1 : matching(code, brace) - 1]
            kind, name = m.group(1), m.group(2)
            if kind == "enum":
                members[name].update(top_level_names(body))
            elif kind in ("struct", "union"):
                members[name].update(re.findall(r"(?<![:\w])([A-Za-z_]\w*)\s*:(?!:)", body))
            else:
                members[name].update(n for _, n in re.findall(r"\b(fn|const|type)\s+([A-Za-z_]\w*)", body))
        for m in IMPL.finditer(code):
            brace = _body_start(code, m.end())
            if brace is None:
                continue
            ty = impl_self_type(code[m.end() : brace])
            if ty:
                body = code[brace + 1 : matching(code, brace) - 1]
                members[ty].update(n for _, n in re.findall(r"\b(fn|const|type)\s+([A-Za-z_]\w*)", body))
    return Index(files, dirs, dict(modules), dict(by_name), packages, defs, dict(members), rust, external_crates())


def _body_start(code: str, i: int) -> int | None:
    """The `{` that opens the body of the item whose header starts at i (None for `;` items)."""
    depth = 0
    for j in range(i, len(code)):
        ch = code[j]
        if ch == "{" and depth == 0:
            return j
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == ";" and depth == 0:
            return None
    return None


def module_names(idx: Index, key: tuple[str, tuple[str, ...]]) -> set[str]:
    names = set()
    for f in idx.modules.get(key, []):
        names |= idx.defs.get(f.rel(), set())
    return names


def resolves(idx: Index, segs: list[str]) -> bool:
    head = segs[0]
    if len(segs) == 2 and segs[1] in idx.members.get(head, ()):
        return True  # Type::member
    starts = list(idx.by_name.get(head, []))
    if head in idx.packages:
        starts.append((head, ()))
    for package, modpath in starts:
        key, inline = (package, modpath), False
        ok = True
        for i, seg in enumerate(segs[1:], start=1):
            last = i == len(segs) - 1
            child = (package, key[1] + (seg,))
            names = module_names(idx, key)
            if child in idx.modules and not inline:
                key = child
                continue
            if last:
                ok = seg in names
            elif any(re.search(rf"\bmod\s+{seg}\s*\{{", idx.rust.get(f.rel(), "")) for f in idx.modules.get(key, [])):
                inline = True  # an inline module (`mod tests { .. }`): its items are in the same files
                continue
            elif i == len(segs) - 2 and seg in names:
                ok = segs[-1] in idx.members.get(seg, ())  # module::Type::member
                break
            else:
                ok = False
            break
        if ok:
            return True
    return False


DOC_PATH = re.compile(r"(?<![\w:$./-])([A-Za-z_]\w*(?:::[A-Za-z_]\w*)+)")
DOC_FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.rs)(?:::([A-Za-z_]\w*))?")
DOC_DIR = re.compile(r"^((?:[\w.-]+/)+)$")
MAP_ENTRY = re.compile(r"`([A-Za-z_]\w*)/?` —")


def file_matches(idx: Index, path: str) -> list[str]:
    return [f for f in idx.files if f == path or f.endswith("/" + path)]


def check_doc(idx: Index, crates: list[Crate]) -> int:
    text = DOC.read_text(encoding="utf-8")
    stale: list[str] = []
    section_crate: Crate | None = None
    in_maps = False
    fenced = False
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if line.startswith("## "):
            in_maps = line.strip() == "## Module maps"
            section_crate = None
        elif line.startswith("### ") and in_maps:
            m = re.search(r"\(`crates/([\w-]+)", line)
            section_crate = next((c for c in crates if m and c.name == m.group(1)), None)
        spans = [line] if fenced else re.findall(r"`([^`]+)`", line)
        for span in spans:
            if "*" in span or "..." in span:
                continue
            for m in DOC_FILE.finditer(span):
                path, fn = m.group(1), m.group(2)
                hits = file_matches(idx, path)
                if not hits:
                    stale.append(f"{lineno}: `{span}`: no file {path}")
                elif fn and not any(fn in idx.defs.get(h, ()) for h in hits):
                    stale.append(f"{lineno}: `{span}`: {path} defines no {fn}")
            for m in DOC_PATH.finditer(span):
                segs = m.group(1).split("::")
                if segs[0] in idx.externals and segs[0] not in idx.packages:
                    continue
                if not resolves(idx, segs):
                    stale.append(f"{lineno}: `{m.group(1)}` names nothing in the code")
            d = DOC_DIR.match(span)
            if d and not any(x == d.group(1).rstrip("/") or x.endswith("/" + d.group(1).rstrip("/")) for x in idx.dirs):
                stale.append(f"{lineno}: `{span}`: no folder {span}")
        if in_maps and section_crate and not fenced:
            for m in MAP_ENTRY.finditer(line):
                name = m.group(1)
                if not any(name in f.modpath for f in section_crate.files):
                    stale.append(f"{lineno}: module map of {section_crate.name}: no module `{name}`")
    for s in stale:
        print(f"{DOC.relative_to(ROOT)}:{s}")
    return len(stale)


def main() -> int:
    crates = load_crates()
    cycles = check_cycles(crates)
    stale = check_doc(build_index(crates), crates)
    if cycles or stale:
        print(
            f"check_structure: {cycles} module cycle(s), {stale} stale name(s) in docs/architecture.md; "
            "break a cycle by moving what both sides need into a leaf (docs/architecture.md, \"Module maps\"), "
            "and name in the doc only what the code has"
        )
        return 1
    print("check_structure: no module cycles; docs/architecture.md names only what exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
