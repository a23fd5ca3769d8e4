"""Errors the pager raises; all are LocalMoEErrors, so the CLI shows them as one line."""

from __future__ import annotations

from localmoe.errors import CheckpointError, LocalMoEError


class PagingError(LocalMoEError):
    """A bad paging setting or an expert that cannot be brought into memory."""


class CorruptExpertError(CheckpointError):
    """An expert extent read from the store does not match its checksum."""


class StoreChangedError(CheckpointError):
    """A store file was deleted or replaced while the model was running."""


class ReadTimeoutError(PagingError):
    """A read did not complete within the I/O timeout (a hung disk or network file system)."""
