"""The Textual terminal chat (`localmoe chat`): `ChatApp` over a Service, `load_service` to
load a model behind a progress screen."""

from localmoe.ui.tui.app import ChatApp, load_service

__all__ = ["ChatApp", "load_service"]
