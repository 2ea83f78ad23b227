"""Asking the Hugging Face hub, decided in seconds: cluster compute nodes are usually offline.

`datasets.load_dataset` on a machine without network retries each request for minutes and then fails
with a long traceback. Before any hub request, `load_from_hub` checks what it can cheaply: offline mode
set (`HF_HUB_OFFLINE` / `HF_DATASETS_OFFLINE`: only the local cache is read, so a miss fails at once) or
the endpoint (`HF_ENDPOINT`, default huggingface.co) not answering a TCP connect within a few seconds.
Either way a failure is one `DataError` line that names the dataset and the ways forward.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

from data.documents import DataError

T = TypeVar("T")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
PROBE_SECONDS = 5.0


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def offline_variable() -> str | None:
    """The offline-mode variable that is set (to 1/true/yes/on), or None."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def hub_unreachable(seconds: float = PROBE_SECONDS) -> str | None:
    """Why the hub endpoint cannot be reached (name not resolved, connection refused, no answer within
    `seconds`), or None when it accepts a TCP connection or a proxy is configured (then only the request
    itself can tell). A thread bounds the name lookup too."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None  # the hub may answer through the proxy where a direct connection cannot: let it try
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or endpoint
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    failure: list[str] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=seconds).close()
        except OSError as error:
            failure.append(_one_line(error) or type(error).__name__)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(2 * seconds)
    if thread.is_alive():
        return f"{host}:{port} did not answer within {2 * seconds:.0f} s"
    return f"{host}:{port}: {failure[0]}" if failure else None


def load_from_hub(load: Callable[[], T], name: str, ways_forward: str) -> T:
    """`load()` (a `datasets.load_dataset` call for the dataset `name`) unless the hub is known to be out
    of reach; a `DataError` line naming `name`, the reason and `ways_forward` otherwise."""
    offline = offline_variable()
    if offline is None:
        reason = hub_unreachable()
        if reason is not None:
            raise DataError(f"{name}: the Hugging Face hub cannot be reached ({reason}); {ways_forward}")
    try:
        return load()
    except ConnectionError as error:  # datasets' "Couldn't reach ... on the Hub", offline or not
        why = f"not in the local cache and {offline}=1 is set" if offline else _one_line(error)
        raise DataError(f"{name}: {why}; {ways_forward}") from None
