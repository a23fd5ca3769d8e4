"""The layering of docs/architecture.md, checked on the source: no module imports a room above
its own, and the rooms (packages and top-level modules) import each other without a cycle.

Every `import` counts, also the lazy ones inside functions. A room is a subpackage or top-level
module of localmoe (`kernels/` installs as localmoe.kernels, `ui/` as localmoe.ui); a module may
import its own room and any room on a lower tier, never one on its own tier or above.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"localmoe": "localmoe", "kernels": "localmoe.kernels", "ui": "localmoe.ui"}

# Lowest first. `localmoe` is the package itself (its facade `localmoe.load()`, `__version__`);
# `__main__` modules are entry points and sit on the top tier whatever their folder.
TIERS = [
    {"errors"},
    {"config", "quant", "paths", "pathguard"},
    {"kernels", "store", "chat", "vision"},
    {"tokenizer"},
    {"engine"},
    {"models", "paging", "default_model"},
    {"checkpoint", "weights"},
    {"load", "describe", "convert"},
    {"runtime"},
    {"testing", "documents", "localmoe"},
    {"server"},
    {"ui"},
    {"commands"},
    {"cli"},
    {"__main__"},
]

# (importing module, imported room) arrows that break the layering today; each one is removed
# from this list when its import is fixed (the test fails on a stale entry as on a new arrow).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> tuple[str, bool]:
    """The dotted name `path` installs as, and whether it is a package's __init__."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = SOURCES[rel.parts[0]].split(".") + list(rel.parts[1:])
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def room(module: str, known: set[str]) -> str | None:
    """The room of a localmoe module (None outside localmoe)."""
    parts = module.split(".")
    if parts[0] != "localmoe":
        return None
    if parts[-1] == "__main__":
        return "__main__"
    if len(parts) == 1 or parts[1] not in known:
        return "localmoe"  # the package itself, e.g. `from localmoe import __version__`
    return parts[1]


def imported_modules(path: Path) -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import in the file, lazy ones too."""
    name, package = module_name(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module is not None and target != "localmoe":  # `from localmoe import x`: only x counts
                out.append((name, target, node.lineno))
            out += [(name, f"{target}.{alias.name}", node.lineno) for alias in node.names]  # x may be a module
    return out


def arrows() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> ['module:line', ...] for every import between rooms."""
    files = [p for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))]
    here = ROOT / "localmoe"
    rooms = {p.stem for p in here.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    rooms |= {"kernels", "ui"}
    found = defaultdict(list)
    for path in files:
        for src, dst, line in imported_modules(path):
            a, b = room(src, rooms), room(dst, rooms)
            if b is not None and a != b:
                found[(src, a, b)].append(f"{path.relative_to(ROOT)}:{line}")
    return found


def tier_of() -> dict[str, int]:
    return {r: i for i, tier in enumerate(TIERS) for r in tier}


def test_every_room_has_a_tier():
    tiers = tier_of()
    missing = {r for (_, a, b) in arrows() for r in (a, b)} - set(tiers)
    assert not missing, f"rooms missing from TIERS in {__file__}: {sorted(missing)}"


def test_no_module_imports_a_room_above_it():
    tiers = tier_of()
    upward = {(src, b): where for (src, a, b), where in arrows().items() if tiers[b] >= tiers[a]}
    new = {k: v for k, v in upward.items() if k not in KNOWN_VIOLATIONS}
    assert not new, "imports of a room on the same tier or above (docs/architecture.md):\n" + "\n".join(
        f"  {src} -> {b}  ({', '.join(where)})" for (src, b), where in sorted(new.items()))
    stale = KNOWN_VIOLATIONS - set(upward)
    assert not stale, f"fixed, now drop them from KNOWN_VIOLATIONS: {sorted(stale)}"


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [node, nxt])
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_walk_sees_lazy_imports():
    """The walk itself: the import inside localmoe.load() is found, and kernels/ maps to localmoe.kernels."""
    found = {(src, dst) for src, dst, _ in imported_modules(ROOT / "localmoe" / "__init__.py")}
    assert ("localmoe", "localmoe.load") in found
    assert module_name(ROOT / "kernels" / "mxfp4_moe" / "__init__.py") == ("localmoe.kernels.mxfp4_moe", True)


def test_no_import_cycle_between_rooms():
    graph = defaultdict(set)
    for src, a, b in arrows():
        if (src, b) not in KNOWN_VIOLATIONS:
            graph[a].add(b)
    assert_acyclic(graph)


def test_no_import_cycle_between_modules():
    """Within a room too (e.g. engine.linear <-> engine.quantized); importing a parent package is not a cycle."""
    files = [p for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))]
    names = {module_name(p)[0] for p in files}
    graph = defaultdict(set)
    for path in files:
        for src, dst, _ in imported_modules(path):
            while dst not in names and "." in dst:  # `from pkg.mod import name` -> pkg.mod
                dst = dst.rsplit(".", 1)[0]
            if dst in names and dst != src and not src.startswith(dst + "."):
                graph[src].add(dst)
    assert_acyclic(graph)


# Families that take shapes or spec parsing from another family: none. Shared shapes live with their
# layer kind (engine/layers/<kind>.py), shared config reading in models/moe_config.py and models/gguf_experts.py; keep it empty.
KNOWN_FAMILY_IMPORTS: set[tuple[str, str]] = set()


def test_no_family_imports_another_family():
    models = ROOT / "localmoe" / "models"
    shared = {"__init__", "base", "moe_config", "gguf_experts"}  # gguf_experts: llama.cpp layout helpers
    families = {p.stem for p in models.glob("*.py")} - shared
    from localmoe.models import BUILTIN

    assert families == set(BUILTIN), f"models/ files that are families but not in models.BUILTIN (or gone): " \
                                     f"{sorted(families ^ set(BUILTIN))}"
    found = set()
    for family in families:
        for _, dst, _ in imported_modules(models / f"{family}.py"):
            other = dst.removeprefix("localmoe.models.")
            if dst.startswith("localmoe.models.") and other.split(".")[0] in families - {family}:
                found.add((family, other.split(".")[0]))
    assert found <= KNOWN_FAMILY_IMPORTS, f"a family imports another family: {sorted(found - KNOWN_FAMILY_IMPORTS)}"
    assert found >= KNOWN_FAMILY_IMPORTS, f"fixed, drop from KNOWN_FAMILY_IMPORTS: {sorted(KNOWN_FAMILY_IMPORTS - found)}"
