#!/usr/bin/env python3
"""Import cycles between the top-level modules of each crate.

A file belongs to the top-level module it is under (`src/outbound/pool.rs` to
`outbound`; `lib.rs`/`main.rs` to the crate root). `use crate::x` and
`crate::x::…` are edges to module `x`, or to the root when `x` is an item
defined there; `super::` from a top-level module is an edge to the root; the root's
`x::…` is an edge to module `x`.
Prints each cycle (a strongly connected component of more than one module)
and the count; exits 1 when there is any. Usage: scripts/module-cycles.py [-v] [crate-dir …]
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
flags = [a for a in sys.argv[1:] if a.startswith("-")]
crates = [pathlib.Path(a) for a in sys.argv[1:] if not a.startswith("-")] or sorted(
    p.parent for p in ROOT.glob("*/Cargo.toml") if (p.parent / "src").is_dir()
)


def module_of(src, path):
    rel = path.relative_to(src).parts
    if len(rel) == 1:
        stem = path.stem
        return "<root>" if stem in ("lib", "main") else stem
    return "<bin>" if rel[0] == "bin" else rel[0]


def strip_comments(text):
    return "\n".join(line.split("//")[0] for line in text.splitlines())


total = 0
for crate in crates:
    src = crate / "src"
    files = [p for p in src.rglob("*.rs") if "bin" not in p.relative_to(src).parts[:1]]
    if (src / "lib.rs").exists():
        # main.rs is then another crate (the binary), using the library's paths.
        files = [p for p in files if p != src / "main.rs"]
    modules = {module_of(src, p) for p in files}
    edges = {m: set() for m in modules}
    # Items the root re-exports belong to the module they come from.
    reexported = {}
    for root_file in (src / "lib.rs", src / "main.rs"):
        if root_file in files:
            text = strip_comments(root_file.read_text())
            for m, group in re.findall(r"\bpub use (\w+)::\{([^}]*)\}", text, re.S):
                for name in re.findall(r"\w+", group):
                    reexported[name] = m
            for m, name in re.findall(r"\bpub use (\w+)::(\w+)\s*;", text):
                reexported[name] = m
    for path in files:
        here = module_of(src, path)
        text = strip_comments(path.read_text())
        names = set(re.findall(r"\bcrate::(\w+)", text))
        # `use crate::{a, b::c}`
        for group in re.findall(r"\bcrate::\{([^}]*)\}", text, re.S):
            names |= set(re.findall(r"(?:^|,)\s*(\w+)", group))
        if here == "<root>":
            # The root names its modules without `crate::` (re-exports aside).
            body = re.sub(r"\bpub use [^;]*;", "", text)
            names |= {m for m in re.findall(r"(?<![:\w])(\w+)::", body) if m in modules}
        for name in names:
            target = name if name in modules else reexported.get(name, "<root>")
            target = target if target in modules else "<root>"
            if target != here:
                edges[here].add(target)
        top_level = len(path.relative_to(src).parts) == 1 or path.name == "mod.rs" and len(path.relative_to(src).parts) == 2
        # Indented `super::` is a nested module (tests) naming its parent.
        if top_level and here != "<root>" and re.search(r"(?m)^\S.*\bsuper::", text):
            edges[here].add("<root>")
    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    for comp in sccs:
        print(f"{crate.name}: {' <-> '.join(comp)}")
        if "-v" in flags:
            for m in comp:
                print(f"    {m} -> {', '.join(sorted(edges[m] & set(comp)))}")
    total += len(sccs)
print(f"{total} import cycles")
sys.exit(1 if total else 0)
