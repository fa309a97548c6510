"""Keep credentials out of logs, errors and reprs: ``redact_url`` masks the password of a URL.

Why one helper: a Redis URL carries its password (``redis://:secret@host:6379``) and travels
through config reprs, error messages and log lines; every place that shows a URL shows
``redact_url(url)`` instead. A Redis Cluster's url may list several startup nodes,
comma-separated (``redis://:pw@a:6379/0,redis://:pw2@b:6379/0``): each url of the list is masked
(urlsplit alone would read the later ones as the first one's path, shown as is). The list is
split only before a ``scheme://``, so a comma inside a password never splits it.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_QUERY_SECRET = re.compile(r"(?i)((?:^|&)(?:password|secret)[^=&]*=)[^&]*")
_NEXT_URL = re.compile(r",(?=[A-Za-z][A-Za-z0-9+.-]*://)")  # a comma that starts the next url of a list


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``; also ``?password=``,
    and every url of a comma-separated list."""
    return ",".join(_redact_one(u) for u in _NEXT_URL.split(url))


def _redact_one(url: str) -> str:
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
