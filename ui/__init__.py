"""User interfaces (installed as `localmoe.ui`): the Textual TUI and the Gradio web app.

They use only the public streaming API of the engine, never the model or kernels directly.
"""
