"""localmoe: giant Mixture-of-Experts language models on one workstation.

Public API::

    import localmoe
    model = localmoe.load()                       # the embedded default model
    for chunk in model.stream("What is the capital of France?"):
        print(chunk.text, end="")          # chunk.reasoning: a thinking model's reasoning
"""

__version__ = "0.1.0"


def _load_kernels_and_ui_from_this_tree() -> None:
    """In a source checkout, `kernels/` and `ui/` beside this package are localmoe.kernels and
    localmoe.ui (setup.py maps them so when installing). Resolving them from this package's own tree
    keeps a checkout on PYTHONPATH whole, e.g. a snapshot of another commit run for an A/B benchmark:
    without this, an editable install's mapping would load the installed tree's kernels beside the
    snapshot's engine. An installed wheel (no setup.py beside the package) is left alone."""
    import sys
    from importlib.util import spec_from_file_location
    from pathlib import Path

    tree = Path(__file__).parent.parent
    if not (tree / "setup.py").is_file():
        return
    folders = {f"localmoe.{name}": tree / name for name in ("kernels", "ui") if (tree / name / "__init__.py").is_file()}

    class ThisTree:  # a meta path finder for the two mapped packages; their subpackages follow __path__
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            folder = folders.get(fullname)
            if folder is None:
                return None
            return spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, ThisTree)


_load_kernels_and_ui_from_this_tree()

from localmoe.errors import LocalMoEError


def load(path=None, progress: bool = True, **engine_options):
    """Load a model (GGUF file, HF directory or localmoe store; None = embedded default), ready to
    `stream` / `generate` / `complete` through the runtime (localmoe/runtime/local.py)."""
    from localmoe.load import load_model
    from localmoe.runtime.local import LocalModel

    return LocalModel(load_model(path, progress=progress, **engine_options))


__all__ = ["LocalMoEError", "__version__", "load"]
