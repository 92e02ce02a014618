#!/usr/bin/env python3
"""The import graph of src/: circles between sibling modules, arrows against the layer order, and file sizes.

Every path a file names (`crate::a::b`, `super::x`, `self::y`, and `mod` children), outside comments, is
an arrow from the file's module to the module it names. Two checks follow the layout docs/ARCHITECTURE.md
describes:

- no circle among the children of one module (a parent and its own children may name each other: a
  `mod.rs` re-exports, a child uses its parent's items), at every depth;
- the top-level modules in data-flow order (LAYERS): a module may name only modules of lower layers or
  its own; the front ends `bench` and `serve` never name each other, and `cli` (the dispatcher) sits
  above both.

and no file over 600 lines outside src/kernels, none over 1,200 inside.

Usage: scripts/module-graph.py          print the top-level graph
       scripts/module-graph.py --check  exit 1, saying what breaks a rule
       (--src DIR: another source tree, as tests/layout.rs uses)
"""
import os, re, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else os.path.join(ROOT, "src")
# Lowest first. A module of a layer may name modules of lower layers; the names in one layer may not name
# each other where the layer is a tuple of front ends.
LAYERS = [
    ["kernels"],
    ["tokenizer"],
    ["facts"],
    ["model"],
    ["decode"],
    ["session"],
    ["conversation"],
    ["flags"],
    ("bench", "serve"),
    ["cli"],
]
MAX_LINES, MAX_KERNEL_LINES = 600, 1200
PATH = re.compile(r"\b(crate|super|self)((?:::[a-z_][a-z0-9_]*)+)")
USE_GROUP = re.compile(r"\b(crate|super|self)((?:::[a-z_][a-z0-9_]*)*)::\{([^}]*)\}", re.S)


def module_of(path):
    """src/a/b.rs or src/a/b/mod.rs -> ("a", "b"); src/lib.rs -> ()."""
    rel = os.path.relpath(path, SRC)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def strip_tests(text):
    """The text without its `#[cfg(test)]` modules: tests may name what they test from anywhere."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))?\s+)?mod\s+[a-z_0-9]+\s*\{", text)
        if not m:
            return text
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        text = text[:m.start()] + text[i:]


def test_only_modules(paths):
    """Modules declared `#[cfg(test)] mod x;`: test helpers, left out of the graph."""
    out = set()
    for p in paths:
        mod = module_of(p)
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_0-9]+)\s*;", open(p).read()):
            out.add(mod + (m.group(1),))
    return out


def files():
    for d, _, names in os.walk(SRC):
        for n in sorted(names):
            if n.endswith(".rs"):
                yield os.path.join(d, n)


def named_paths(mod, text, modules):
    """The modules a file's text names, resolved to the longest known module."""
    out = set()
    refs = [(m.group(1), m.group(2)) for m in PATH.finditer(text)]
    for m in USE_GROUP.finditer(text):
        for item in m.group(3).split(","):
            item = item.strip().split(" ")[0]
            if re.match(r"^[a-z_][a-z0-9_]*(::[a-z_][a-z0-9_]*)*$", item):
                refs.append((m.group(1), m.group(2) + "::" + item))
    for root, rest in refs:
        parts = rest.strip(":").split("::")
        if root == "crate":
            base = ()
        elif root == "super":
            base = mod[:-1]
            while parts and parts[0] == "super":
                base, parts = base[:-1], parts[1:]
        else:
            base = mod
        target = base + tuple(parts)
        while target and target not in modules:
            target = target[:-1]
        if target and target != mod:
            out.add(target)
    return out


def graph():
    paths = list(files())
    tests = test_only_modules(paths)
    paths = [p for p in paths if module_of(p) not in tests]
    modules = {module_of(p) for p in paths}
    edges = {}
    for p in paths:
        mod = module_of(p)
        text = strip_tests(strip_comments(open(p).read()))
        edges.setdefault(mod, set()).update(named_paths(mod, text, modules))
    return paths, modules, edges


def sibling_circles(modules, edges):
    """Circles among the children of each module: arrows lifted to the child of that module they lie in."""
    problems = []
    parents = {m[:-1] for m in modules if m}
    for parent in sorted(parents):
        depth = len(parent)
        lifted = {}
        for a, targets in edges.items():
            if len(a) <= depth or a[:depth] != parent:
                continue
            for b in targets:
                if len(b) > depth and b[:depth] == parent and a[depth] != b[depth]:
                    lifted.setdefault(a[depth], set()).add(b[depth])
        for cycle in cycles(lifted):
            where = "::".join(parent) or "crate"
            problems.append(f"circle among the children of {where}: {' -> '.join(cycle + [cycle[0]])}")
    return problems


def cycles(g):
    """One representative per strongly connected component of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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
                out.append(sorted(comp))
    for v in sorted(set(g) | {w for ws in g.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def layer_arrows(edges):
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    front = {name for layer in LAYERS if isinstance(layer, tuple) for name in layer}
    problems = []
    for a, targets in sorted(edges.items()):
        if not a:
            continue
        for b in sorted(targets):
            if not b or a[0] == b[0]:
                continue
            ra, rb = rank.get(a[0]), rank.get(b[0])
            if ra is None or rb is None:
                problems.append(f"{'::'.join(a)} -> {'::'.join(b)}: {a[0] if ra is None else b[0]} has no layer")
            elif rb > ra:
                problems.append(f"arrow back up: {'::'.join(a)} -> {'::'.join(b)}")
            elif rb == ra and a[0] in front:
                problems.append(f"front end naming another: {'::'.join(a)} -> {'::'.join(b)}")
    return problems


def sizes(paths):
    problems = []
    for p in paths:
        rel = os.path.relpath(p, SRC)
        n = sum(1 for _ in open(p))
        limit = MAX_KERNEL_LINES if rel.startswith("kernels" + os.sep) else MAX_LINES
        if n > limit:
            problems.append(f"src/{rel}: {n} lines (at most {limit})")
    return problems


def main():
    paths, modules, edges = graph()
    if "--check" in sys.argv[1:]:
        problems = sibling_circles(modules, edges) + layer_arrows(edges) + sizes(paths)
        for p in problems:
            print(p, file=sys.stderr)
        sys.exit(1 if problems else 0)
    top = {}
    for a, targets in edges.items():
        for b in targets:
            if a and b and a[0] != b[0]:
                top.setdefault(a[0], set()).add(b[0])
    for a in sorted(top):
        print(f"{a} -> {', '.join(sorted(top[a]))}")


if __name__ == "__main__":
    main()
