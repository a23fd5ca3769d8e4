"""localmoe: giant Mixture-of-Experts language models on one workstation.

Public API::

    import localmoe
    model = localmoe.load()                       # the embedded default model
    for chunk in model.stream("What is the capital of France?"):
        print(chunk.text, end="")          # chunk.reasoning: a thinking model's reasoning
"""

__version__ = "0.1.0"

from localmoe.errors import LocalMoEError


def load(path=None, progress: bool = True, **engine_options):
    """Load a model (GGUF file, HF directory or localmoe store; None = embedded default), ready to
    `stream` / `generate` / `complete` through the runtime (localmoe/runtime/local.py)."""
    from localmoe.load import load_model
    from localmoe.runtime.local import LocalModel

    return LocalModel(load_model(path, progress=progress, **engine_options))


__all__ = ["LocalMoEError", "__version__", "load"]
