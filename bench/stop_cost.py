"""Per-token cost of the stop rules (engine/stop.py) over a long output: flat, where the checker before
issue #22 grew with the output (it decoded the whole output every token and compared every prefix of
every stop string with the text's end).

A 4,096-token output of the bundled SmolLM2 tokenizer, 8 stop strings of 256 characters that never
complete but keep long partial matches alive (each is 200 characters of the output itself, then 56 that
never occur), fed one token at a time as the engine's step does. Prints the median per-token cost in
each 512-token window, for the current checker and the old one (``whole_output_update``, kept here as
the reference: tests/engine/test_stop.py checks the new one against it).

    python -m bench.stop_cost [--tokens 4096] [--old/--no-old]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from engine.request import Request
from engine.sampling import SamplingParams
from engine.stop import StopChecker

EOS = (2,)
TEXT = ("The lighthouse keeper of Orvik counted the ships that passed each night and wrote their names in a "
        "ledger; in February the ferries stopped, the harbour froze, and he read old almanacs by lamplight. ")


def whole_output_update(tokenizer: Any, eos: tuple[int, ...], req: Request, emitted: list[str]) -> tuple[str, str | None]:
    """The stop rules before issue #22 (``emitted[0]``: the text emitted so far): decode every output
    token again, search the whole text, hold back by comparing each prefix of each stop string."""
    p, ids, reason = req.params, req.output_ids, None
    if (ids[-1] in eos and not p.ignore_eos) or ids[-1] in p.stop_token_ids:
        reason, ids = "stop", ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(i, s) for i, s in ((text.find(s), s) for s in p.stop) if i >= 0]
    if hits:
        text, reason = text[: min(hits)[0]], "stop"
    if reason is None and len(req.output_ids) >= p.max_tokens:
        reason = "length"
    visible = text
    if reason is None:
        visible = visible.rstrip("\ufffd")
        for s in p.stop:
            for k in range(min(len(s) - 1, len(visible)), 0, -1):
                if visible.endswith(s[:k]):
                    visible = visible[:-k]
                    break
    if not visible.startswith(emitted[0]):
        return "", reason
    new, emitted[0] = visible[len(emitted[0]):], visible
    return new, reason


def measure(tokenizer: Any, n_tokens: int, old: bool) -> list[float]:
    """Seconds of each token's stop-rule update."""
    ids = (tokenizer(TEXT * (n_tokens // 20 + 1))["input_ids"])[:n_tokens]
    text = tokenizer.decode(ids)
    stops = tuple(text[i * 97 : i * 97 + 200] + "\x01" * 56 for i in range(8))  # long live partial matches
    req = Request("bench", [1], SamplingParams(max_tokens=n_tokens + 1, stop=stops))
    checker, emitted, times = StopChecker(tokenizer, EOS), [""], []
    for tok in ids:
        req.output_ids.append(tok)
        t0 = time.perf_counter()
        _, reason = whole_output_update(tokenizer, EOS, req, emitted) if old else checker.update(req)
        times.append(time.perf_counter() - t0)
        assert reason is None
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stop_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--old", action=argparse.BooleanOptionalAction, default=True, help="also time the old checker")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.model_loader import hf_model_dir

    tok = AutoTokenizer.from_pretrained(hf_model_dir(""))
    runs = {"linear (now)": measure(tok, a.tokens, old=False)}
    if a.old:
        runs["whole output (before)"] = measure(tok, a.tokens, old=True)
    print(f"per-token cost of the stop rules, median us per 512-token window ({a.tokens} tokens, 8 x 256-char stops)")
    print(f"{'tokens':>12} " + " ".join(f"{name:>22}" for name in runs))
    for lo in range(0, a.tokens, 512):
        cells = [f"{statistics.median(t[lo : lo + 512]) * 1e6:22.1f}" for t in runs.values()]
        print(f"{lo:>5}-{min(lo + 512, a.tokens):<6} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
