"""localmoe: giant Mixture-of-Experts language models on one workstation.

Public API::

    import localmoe
    model = localmoe.load()                       # the embedded default model
    for chunk in model.stream("What is the capital of France?"):
        print(chunk.text, end="")
"""

__version__ = "0.1.0"

from localmoe.errors import LocalMoEError


def load(path=None, **engine_options):
    """Load a model (GGUF file, HF directory or localmoe store; None = embedded default)."""
    from localmoe.load import load_model

    return load_model(path, **engine_options)


__all__ = ["LocalMoEError", "__version__", "load"]
