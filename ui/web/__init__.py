"""The Gradio web app (`localmoe web`): see app.py for the page, session.py for one tab's chat."""

from localmoe.ui.web.app import WebApp, launch

__all__ = ["WebApp", "launch"]
