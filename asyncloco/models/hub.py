"""Fail fast, in one line, when a config needs the Hugging Face hub and the hub cannot be reached.

``transformers`` and ``datasets`` retry an unreachable hub for about a minute and end in a traceback. Before
either is asked for a hub resource (a tokenizer not in the local cache, a streamed hub dataset), the loaders
in :mod:`asyncloco.models.tokenizer` and :mod:`asyncloco.models.data` call :func:`require_hub`: one TCP connect
to the hub's endpoint (``HF_ENDPOINT``, default https://huggingface.co) with a short deadline. If it fails, a
:class:`HubUnreachable` (a ``ValueError``: the CLI prints it as one line and exits 2) names the resource and
the two ways on: the embedded data for a local run, or a pre-fetched hub cache with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

__all__ = ["HubUnreachable", "hub_endpoint", "hub_offline", "require_hub", "CONNECT_TIMEOUT_S"]

CONNECT_TIMEOUT_S = 5.0
_TRUE = ("1", "true", "yes", "on")


class HubUnreachable(ValueError):
    """The hub resource a config names cannot be fetched from here."""


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set: the libraries load from the local cache only, and never dial the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _fixes(kind: str) -> str:
    local = ("for a local run use the embedded data and tokenizer "
             "(--set task.source=embedded --set task.path=null --set task.name=null --set task.tokenizer=null, "
             "or a shipped embedded config such as demo or lm-tiny)")
    if kind == "dataset":
        real = ("for a real run make the hub reachable from this machine, or download the dataset's files "
                "(huggingface-cli download --repo-type dataset ...) and point task.source=json/parquet, task.path at them")
    else:
        real = ("for a real run make the hub reachable from this machine, or pre-fetch it into the hub cache "
                "(huggingface-cli download <name>) and run with HF_HUB_OFFLINE=1")
    return f"{local}; {real}"


def require_hub(resource: str, kind: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`HubUnreachable` unless the hub's endpoint accepts a TCP connection within ``timeout``.

    ``kind`` is "tokenizer", "model" or "dataset" (it picks the fix to suggest). With ``HF_HUB_OFFLINE`` set the
    hub is never dialled: a tokenizer must then be in the cache, and a streamed dataset cannot be read at all."""
    endpoint = hub_endpoint()
    if hub_offline():
        if kind == "dataset":
            raise HubUnreachable(f"the hub {kind} {resource!r} is streamed from {endpoint}, which HF_HUB_OFFLINE=1 "
                                 f"forbids; {_fixes(kind)}")
        raise HubUnreachable(f"the hub {kind} {resource!r} is not in the local hub cache and HF_HUB_OFFLINE=1 "
                             f"forbids downloading it; {_fixes(kind)}")
    url = urlparse(endpoint)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as error:
        reason = "timed out" if isinstance(error, socket.timeout) else (error.strerror or type(error).__name__)
        raise HubUnreachable(
            f"cannot reach the Hugging Face hub at {endpoint} ({reason}) for the {kind} {resource!r}; {_fixes(kind)}"
        ) from None
