"""Stop rules in linear time give the very text, finish reason and finishing token the old whole-output
checker gave, stream nothing it would have held back, decode a bounded window per token, and refuse
stop strings past the engine's bounds."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bench.stop_cost import whole_output_update
from engine.detokenizer import MAX_PENDING
from engine.errors import InvalidRequestError
from engine.request import Request
from engine.sampling import SamplingParams
from engine.stop import StopChecker
from tests.fixtures_engine import make_engine

EOS = (2,)
TEXT = ("The lighthouse at Orvik — built in 1852 — still shines. Привет, мир! 你好，世界。 Llamas 🦙 and rockets 🚀 "
        "naïve café, “quoted” text… x = f(y) + 3; return [1, 2, 3] END stop STOP\n\nNext line.\t😀👍🏽")


def _old(tokenizer: Any, stream: list[int], p: SamplingParams) -> tuple[str, str | None, int]:
    """The checker before this rewrite (bench/stop_cost.py), as the reference: (text, reason, tokens)."""
    req, emitted = Request("r", [1], p), [""]
    for t, tok in enumerate(stream, 1):
        req.output_ids.append(tok)
        _, reason = whole_output_update(tokenizer, EOS, req, emitted)
        if reason is not None:
            return emitted[0], reason, t
    return emitted[0], None, len(stream)


def _new(checker: StopChecker, stream: list[int], p: SamplingParams) -> tuple[list[str], str | None, int]:
    req = Request("r", [1], p)
    for t, tok in enumerate(stream, 1):
        req.output_ids.append(tok)
        new, reason = checker.update(req)
        assert new == (req.text_pieces[-1] if new else "")
        if reason is not None:
            return req.text_pieces, reason, t
    return req.text_pieces, None, len(stream)


def _stream(rng: random.Random, text_ids: list[int]) -> list[int]:
    """Runs of real text, random ids, the odd special token."""
    stream: list[int] = []
    n = rng.randint(1, 160)
    while len(stream) < n:
        r = rng.random()
        if r < 0.6:
            i = rng.randrange(len(text_ids))
            stream += text_ids[i : i + rng.randint(1, 12)]
        elif r < 0.95:
            stream.append(rng.randrange(3, 49152))
        else:
            stream.append(rng.choice([0, 1, 2]))
    return stream


def test_same_text_reason_and_length_as_the_whole_output_checker(tiny) -> None:
    tok = tiny.tokenizer
    text_ids = tok(TEXT)["input_ids"]
    checker = StopChecker(tok, EOS)
    rng = random.Random(0)
    stopped = 0
    for _ in range(400):
        stream = _stream(rng, text_ids)
        full = tok.decode(stream, skip_special_tokens=True)
        stops: list[str] = []
        for _ in range(rng.randint(0, 4)):
            if full and rng.random() < 0.8:
                i = rng.randrange(len(full))
                stops.append(full[i : i + rng.randint(1, 12)])
            else:
                stops.append("".join(rng.choice("abc ✓🦙") for _ in range(rng.randint(1, 5))))
        stops = [s for s in stops if s and "\ufffd" not in s]
        p = SamplingParams(max_tokens=rng.randint(1, len(stream)), stop=tuple(stops), ignore_eos=rng.random() < 0.5,
                           stop_token_ids=tuple(rng.sample(stream, 1)) if rng.random() < 0.2 else ())
        want_text, want_reason, want_t = _old(tok, stream, p)
        pieces, reason, t = _new(checker, stream, p)
        assert ("".join(pieces), reason, t) == (want_text, want_reason, want_t), (stream, p)
        stopped += reason == "stop"
    assert stopped > 100  # the cases did exercise stop strings and stop tokens


def test_half_characters_and_stop_prefixes_are_held_back_until_settled(tiny) -> None:
    tok = tiny.tokenizer
    emoji = tok("🦙", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1  # one character, several byte-level tokens
    checker = StopChecker(tok, EOS)
    req = Request("r", [1], SamplingParams(max_tokens=100, stop=("END",)))
    emitted = []
    for t in tok("llama ", add_special_tokens=False)["input_ids"] + emoji + tok(" EN", add_special_tokens=False)["input_ids"]:
        req.output_ids.append(t)
        emitted.append(checker.update(req))
    assert all(reason is None for _, reason in emitted)
    assert all("\ufffd" not in new for new, _ in emitted)  # no half emoji, ever
    assert req.text == "llama 🦙 "  # "EN" held: it may become "END"
    req.output_ids += tok("D", add_special_tokens=False)["input_ids"]
    new, reason = checker.update(req)
    assert (new, req.text, reason) == ("", "llama 🦙 ", "stop")


class _WindowSpy:
    """The real tokenizer, recording how many ids each decode is given."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.longest = tok, 0

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def test_each_token_decodes_a_bounded_window(tiny) -> None:
    """The old checker decoded the whole output for every token (its window grew to 3,000 here)."""
    tok = tiny.tokenizer
    ids = (tok(TEXT)["input_ids"] * 40)[:3000]
    spy = _WindowSpy(tok)
    stop = tuple("".join(random.Random(i).choice("qzj") for _ in range(256)) for i in range(8))
    pieces, reason, t = _new(StopChecker(spy, EOS), ids, SamplingParams(max_tokens=3000, stop=stop))
    assert (reason, t) == ("length", 3000) and "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert spy.longest <= 2 * MAX_PENDING


@pytest.mark.parametrize("params,msg", [
    (dict(stop=tuple(f"s{i}" for i in range(9))), "at most 8 stop strings"),
    (dict(stop=("x" * 257,)), "at most 256 characters"),
    (dict(stop_token_ids=tuple(range(65))), "at most 64 stop_token_ids"),
])
def test_stop_rules_past_the_bounds_are_refused(tiny, params: dict[str, Any], msg: str) -> None:
    eng = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match=msg):
        eng.add_request([1, 2, 3], SamplingParams(**params))
    assert not eng.has_unfinished()
    eng.add_request([1, 2, 3], SamplingParams(stop=tuple("x" * 256 for _ in range(8)), stop_token_ids=tuple(range(64))))


def test_a_seed_torch_cannot_take_is_refused_before_the_step_thread() -> None:
    """2**70 used to reach torch.Generator.manual_seed on the step thread: RuntimeError, engine loop dead."""
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=2**70)
    SamplingParams(seed=2**64 - 1)
