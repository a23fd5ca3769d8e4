"""A source tree on PYTHONPATH loads its own kernels/ and ui/ as localmoe.kernels / localmoe.ui,
whatever tree the environment's install maps them to (how a snapshot of another commit is benchmarked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tree_with_own_kernels(where: Path) -> Path:
    """A checkout-shaped tree: this repository's engine and UI, but a kernels/ package of its own."""
    tree = where / "snapshot"
    (tree / "kernels" / "probe").mkdir(parents=True)
    (tree / "setup.py").write_text("")
    (tree / "localmoe").symlink_to(ROOT / "localmoe")
    (tree / "ui").symlink_to(ROOT / "ui")
    (tree / "kernels" / "__init__.py").write_text("TREE = 'snapshot'\n")
    (tree / "kernels" / "probe" / "__init__.py").write_text("")
    return tree


def imported(tree: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tree.parent, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_tree_on_pythonpath_loads_its_own_kernels(tmp_path):
    tree = tree_with_own_kernels(tmp_path)
    out = imported(tree, "import localmoe.kernels as k, localmoe.kernels.probe as p, localmoe.ui as u;"
                         "print(k.TREE, p.__file__, u.__file__, sep='|')")
    marker, probe, ui = out.split("|")
    assert marker == "snapshot"
    assert Path(probe) == tree / "kernels" / "probe" / "__init__.py"  # subpackages follow the tree's folder
    assert Path(ui) == tree / "ui" / "__init__.py"


def test_the_tree_itself_maps_to_its_folders():
    out = imported(ROOT, "import localmoe.kernels as k, localmoe.ui as u; print(k.__file__, u.__file__, sep='|')")
    assert [Path(p) for p in out.split("|")] == [ROOT / "kernels" / "__init__.py", ROOT / "ui" / "__init__.py"]


def test_the_wheel_carries_every_kernel_source(tmp_path):
    """The CPU kernels compile at first use from the installed package: a wheel built from this tree holds every
    .cpp and .h under kernels/ (an fp8_cache source or a gqa_decode header left out broke an installed build)."""
    import zipfile

    import shutil

    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, timeout=60,
                             check=False)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    tree = tmp_path / "tree"  # the tracked files only: a build left in the checkout may list what a clone lacks
    for name in filter(None, tracked.stdout.split("\0")):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(tree)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p for p in (ROOT / "kernels").rglob("*") if p.suffix in (".cpp", ".h"))
    assert sources
    missing = [str(p.relative_to(ROOT)) for p in sources
               if f"localmoe/kernels/{p.relative_to(ROOT / 'kernels').as_posix()}" not in held]
    assert not missing, f"not in the wheel: {missing}"
