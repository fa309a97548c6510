"""Keep credentials out of logs, errors and reprs: ``redact_url`` masks the password of a URL.

Why one helper: a Redis URL carries its password (``redis://:secret@host:6379``) and travels
through config reprs, error messages and log lines; every place that shows a URL shows
``redact_url(url)`` instead.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_QUERY_SECRET = re.compile(r"(?i)((?:^|&)(?:password|secret)[^=&]*=)[^&]*")


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``; also ``?password=``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable url>"
    query = _QUERY_SECRET.sub(r"\1***", parts.query)
    if password is None and query == parts.query:
        return url
    if password is not None:
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}")
    return urlunsplit(parts._replace(query=query))
