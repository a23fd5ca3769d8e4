"""The runtime every front end uses (the HTTP server, the TUI and web app, `run`, `analyze`, the
Python API): the engine worker and its scheduler (continuous batching), chat turns (reasoning,
thinking budgets, tool calls, constrained arguments), and the `Service` that prepares requests.

It raises `LocalMoEError`s (`RequestError`, `NotFoundError`, `CancelledError`), never HTTP errors;
the server maps them to status codes.
"""
