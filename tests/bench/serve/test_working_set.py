"""The working set is measured from what the users' conversations hold (not derived from the pool),
users take turns only when idle, and a user restarts after max_turns (the set stays near its ratio)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.serve import run
from bench.serve.workload import QASpec, QAWorkload, chat_tokens, planned_qa_working_set
from engine.model_loader import hf_model_dir


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_model_dir(""))


SPEC = QASpec(users=3, system_tokens=32, context_tokens=64, question_tokens=8, answer_tokens=4, max_turns=2)


def test_held_tokens_are_the_conversations_as_they_are(tok) -> None:
    wl = QAWorkload(SPEC, tok)
    shared = chat_tokens(tok, wl.history[0][:1], generation_prompt=False)
    assert wl.held_tokens() == shared  # nobody has asked yet: the system prompt only
    wl.next_turn(0)
    wl.answered(0, "a short answer")
    one = wl.held_tokens()
    assert one == chat_tokens(tok, wl.history[0], generation_prompt=False)
    wl.next_turn(1)
    wl.answered(1, "a much longer answer than the first one, with many more words in it to hold")
    # measured, not planned: a longer real answer holds more, whatever answer_tokens says
    assert wl.held_tokens() - one > one - shared
    assert wl.held_tokens() == shared + sum(chat_tokens(tok, h, generation_prompt=False) - shared for h in wl.history)


def test_a_user_restarts_after_max_turns(tok) -> None:
    wl = QAWorkload(SPEC, tok)
    for _ in range(2):
        wl.next_turn(0)
        wl.answered(0, "ok")
    grown = len(wl.history[0])
    msgs = wl.next_turn(0)
    assert wl.restarts == 1 and len(msgs) == 2 < grown and msgs[1]["content"].startswith("Document:")


def test_pick_takes_the_idle_user_who_asked_longest_ago(tok) -> None:
    wl = QAWorkload(SPEC, tok)
    assert [wl.pick() for _ in range(3)] == [0, 1, 2]
    wl.answered(1, "x")
    assert wl.pick() == 1 and wl.busy_picks == 0  # 0 and 2 still wait for answers
    assert wl.pick() == 0 and wl.busy_picks == 1  # everyone waits: the longest ago asks anyway
    wl.next_turn(2)
    wl.abandoned(2)  # cancelled: its question is taken back and it is idle again
    assert wl.history[2][-1]["role"] == "system" and 2 not in wl.waiting and wl.turns[2] == 0


def test_measured_ratio_comes_from_the_points() -> None:
    pts = [{"held_tokens_start": 3000, "held_tokens_end": 5000}, {"held_tokens_start": 5000, "held_tokens_end": 5000}]
    r = run.measured_ratio({"radix": [{"points": pts}]}, pool_tokens=1000)
    assert r == {"median": 4.5, "min": 4.0, "max": 5.0, "points": 2}


def test_users_for_a_ratio_fill_that_share_of_the_pool(tok) -> None:
    qa = QASpec(system_tokens=128, context_tokens=640, question_tokens=24, answer_tokens=32, max_turns=4)
    u1, u4 = run.users_for(1.0, qa, 3072, tok), run.users_for(4.0, qa, 3072, tok)
    assert 1 <= u1 < u4 and u4 == pytest.approx(4 * u1, abs=2)


def test_users_for_a_ratio_hold_it_at_the_mean_turns_a_user_has(tok) -> None:
    """A user restarts after max_turns = 4, so it holds 2.5 turns on average: planned at 3 turns the 4x
    run measured 3.68x. At 2 turns (a first question and one more) the users hold at least the ratio."""
    qa = QASpec(system_tokens=128, context_tokens=384, question_tokens=24, answer_tokens=48, max_turns=4)
    users = run.users_for(4.0, qa, 3072, tok)
    held, _ = planned_qa_working_set(replace(qa, users=users, rounds=1), tok)
    assert held >= 4.0 * 3072
