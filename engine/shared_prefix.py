"""Operator-declared shared prefixes: the pages of a prompt every tenant may reuse.

Tenants never share KV (each ``cache_salt`` has its own keys and its own radix subtree), which
would store a system prompt common to every tenant once per tenant. The operator may declare such
prompts shared (``EngineConfig.shared_prefix_file``): a page of a request's prompt is *shared* when
the prompt's tokens up to the end of that page equal the start of a declared prefix, token for
token. Shared pages go into a shared radix subtree and the shared key namespace (kvstore/keys.py);
the first page that is not all declared tokens, and every page after it, stays the tenant's.

Whether a page is shared depends only on the tokens up to its end, so every process, the radix
tree and the connector's keys agree, and shared pages always form a leading run. Only the
operator's tokens are ever shared: a request cannot add anything to the shared namespace by
itself, since a page it could make shared holds nothing but the operator's declared tokens. A
trailing part of a declared prefix that does not fill a page stays private (its page also holds
the request's own tokens).

The file (YAML, or JSON) is a list; each entry is ``{text: "..."}`` (a system prompt: the tokens
of that system message under the chat template, and of the raw text as a completion prompt) or
``{ids: [1, 2, ...]}`` (token ids exactly).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

Tokens = tuple[int, ...]


class SharedPrefixes:
    """The declared prefixes of one engine (their whole pages), and the rule above."""

    def __init__(self, prefixes: Iterable[Sequence[int]], page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        kept: set[Tokens] = set()
        for p in prefixes:
            full = len(p) - len(p) % page_size
            if full:
                kept.add(tuple(int(t) for t in p[:full]))
        self.prefixes: tuple[Tokens, ...] = tuple(sorted(kept, key=len, reverse=True))

    def __bool__(self) -> bool:
        return bool(self.prefixes)

    def shared_pages(self, tokens: Sequence[int]) -> int:
        """How many leading full pages of ``tokens`` lie inside a declared prefix."""
        if not self.prefixes:
            return 0
        ps, best = self.page_size, 0
        for p in self.prefixes:
            n = min(len(p), len(tokens)) // ps * ps
            if n <= best * ps:
                continue
            head = tuple(tokens[:n])
            if head == p[:n]:
                best = n // ps
                continue
            k = 0
            while head[k : k + ps] == p[k : k + ps]:  # stops inside [0, n): the heads differ
                k += ps
            best = max(best, k // ps)
        return best

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Any, page_size: int) -> SharedPrefixes:
        """Read a declaration file (module notes); ConfigError names the file and the entry."""
        prefixes: list[Sequence[int]] = []
        for kind, value in read_entries(path):
            prefixes += [value] if kind == "ids" else text_prefixes(tokenizer, value)
        shared = cls(prefixes, page_size)
        if not shared:
            raise ConfigError(f"shared prefix file {path}: no declared prefix fills one page of {page_size} tokens")
        return shared


def read_entries(path: str | Path) -> list[tuple[str, Any]]:
    """The file's entries as ("text", str) or ("ids", [int, ...]), checked (no tokenizer needed:
    ``kvengine --check-config`` runs this)."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"shared prefix file {path}: {' '.join(str(e).split())}") from None
    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"shared prefix file {path}: must be a non-empty list of {{text: ...}} or {{ids: [...]}}")
    out: list[tuple[str, Any]] = []
    for i, entry in enumerate(doc):
        where = f"shared prefix file {path}, entry {i}"
        if not isinstance(entry, dict) or len(entry) != 1 or not {"text", "ids"} >= set(entry):
            raise ConfigError(f"{where}: must be {{text: ...}} or {{ids: [...]}}, got {entry!r}")
        kind, value = next(iter(entry.items()))
        if kind == "ids" and not (isinstance(value, list) and value and
                                  all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
            raise ConfigError(f"{where}: ids must be a non-empty list of token ids")
        if kind == "text" and not (isinstance(value, str) and value):
            raise ConfigError(f"{where}: text must be a non-empty string")
        out.append((kind, value))
    return out


def text_prefixes(tokenizer: Any, text: str) -> list[list[int]]:
    """The token ids a system prompt starts a request with: as the system message of a chat (what
    /v1/chat/completions renders) and as the raw text of a completion prompt."""
    out = [tokenizer(text)["input_ids"]]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False)
        out.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return out
