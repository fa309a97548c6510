"""What a blend request carries: the prompt as segments, which of them are documents, a ratio.

The prompt is the concatenation of the segments in order. Document segments are cached as
position-independent chunks and blended; the leading non-document segment (BOS + system
prompt) is a true prefix, so its cached KV is exact and it is never recomputed after layer 1;
every other non-document segment (the question, separators) is always recomputed.

``build_chat_blend_request`` is what the server calls for chat requests with
``extra_body={"documents": [...]}`` (``build_blend_request`` for plain text pieces);
``split_by_separator`` turns a plain prompt with a separator string into the same pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from connector.blend.errors import InvalidBlendRequestError

SELECT_MODES = ("k", "v", "random")


@dataclass(frozen=True)
class Segment:
    ids: tuple[int, ...]
    document: bool


@dataclass(frozen=True)
class BlendSpec:
    segments: tuple[Segment, ...]
    ratio: float | None = None  # None: BlendConfig.ratio via RecomputeRatio decides
    select: str | None = None  # "k" | "v" | "random"; None: the hook's default ("k")

    def __post_init__(self) -> None:
        if not self.segments:
            raise InvalidBlendRequestError("blend spec has no segments", "documents")
        if self.ratio is not None and not 0.0 <= float(self.ratio) <= 1.0:
            raise InvalidBlendRequestError(f"blend ratio must be in [0, 1], got {self.ratio}", "blend_ratio")
        if self.select is not None and self.select not in SELECT_MODES:
            raise InvalidBlendRequestError(f"blend select must be one of {SELECT_MODES}", "blend_select")

    @property
    def prompt_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    @property
    def num_document_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.document)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_blend_request(tokenizer: Any, system: str, documents: Sequence[str], question: str,
                        ratio: float | None = None, doc_separator: str = "\n\n",
                        bos: bool = True) -> tuple[list[int], BlendSpec]:
    """Tokenize system / each document / question on their own; return (prompt_ids, spec).

    ``system`` and ``question`` are used verbatim, so a chat server passes the templated text
    around the documents (e.g. system = "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n",
    question = "...<|im_end|>\\n<|im_start|>assistant\\n"). Each document is tokenized as
    ``document + doc_separator``. With ``bos`` the tokenizer's BOS token leads the prompt (the
    chunks are precomputed after a BOS too, so the model sees the same attention sink).
    """
    if not documents:
        raise InvalidBlendRequestError("a blend request needs at least one document", "documents")
    head = _encode(tokenizer, system) if system else []
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None and head[:1] != [bos_id]:  # a chat template may already start with it
        head.insert(0, int(bos_id))
    segs: list[Segment] = []
    if head:
        segs.append(Segment(tuple(head), False))
    for d in documents:
        ids = _encode(tokenizer, d + doc_separator)
        if ids:
            segs.append(Segment(tuple(ids), True))
    q = _encode(tokenizer, question)
    if not q:
        raise InvalidBlendRequestError("the question is empty", "messages")
    segs.append(Segment(tuple(q), False))
    spec = BlendSpec(tuple(segs), ratio)
    return spec.prompt_ids, spec


_DOCS_MARK = "\u2063tierkv-documents\u2063"


def build_chat_blend_request(tokenizer: Any, messages: Sequence[Mapping[str, str]], documents: Sequence[str],
                             ratio: float | None = None, doc_separator: str = "\n\n"
                             ) -> tuple[list[int], BlendSpec]:
    """For /v1/chat/completions with ``extra_body={"documents": [...]}``: the documents go at the
    start of the last user message, everything the chat template renders before them is the
    prefix and everything after (the user's text, the assistant header) the always-recomputed
    question."""
    msgs = [dict(m) for m in messages]
    last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
    if last is None:
        raise InvalidBlendRequestError("a blend chat request needs a user message", "messages")
    msgs[last]["content"] = _DOCS_MARK + str(msgs[last].get("content") or "")
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    before, _, after = text.partition(_DOCS_MARK)
    return build_blend_request(tokenizer, before, documents, after, ratio, doc_separator)


def split_by_separator(prompt: str, sep: str) -> tuple[str, list[str], str]:
    """'system SEP doc1 SEP doc2 SEP question' -> (system, [doc1, doc2], question).

    Needs at least two separators (system and question may be empty strings). Feed the result
    to ``build_blend_request``."""
    if not sep:
        raise InvalidBlendRequestError("the blend separator is empty", "blend_separator")
    parts = prompt.split(sep)
    if len(parts) < 3:
        raise InvalidBlendRequestError(f"prompt must look like 'system{sep}doc{sep}...{sep}question'", "prompt")
    return parts[0], parts[1:-1], parts[-1]
