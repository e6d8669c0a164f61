"""The error types every layer raises and catches by type (never by message text).

They are defined here, in the lowest layer, because offload/ imports nothing above it yet reads model files
and plans memory; `backends.base` re-exports them, and that is where the rest of the app imports them from.
"""

from __future__ import annotations


class BackendError(RuntimeError):
    """A runtime failed in a way the user can act on (bad file, out of memory, context full)."""


class BadModelFile(BackendError):
    """A model file is missing, truncated, or not what its header says; the message names the file."""


class OutOfMemory(BackendError):
    """A runtime could not allocate (host or device memory); raised where the runtime reports it."""
