"""bench/soak/load.py's warm-up: every tenant's every system prompt once, on replicas in turn,
nothing kept (the soak's own answers are the ones checked)."""

from __future__ import annotations

import threading

from bench.soak.load import Answer, Load, workload


def test_warm_asks_each_tenant_each_system_prompt_once_on_alternating_replicas(monkeypatch) -> None:
    load = Load(["http://a", "http://b"], "m", 8, {"t1": "k1", "t2": "k2"})
    asked: list[tuple[str, str, str, bool]] = []
    lock = threading.Lock()

    def ask(prompt, tenant, replica, keep=True, salt=None, max_tokens=None):
        with lock:
            asked.append((prompt.messages[0]["content"], tenant, replica, keep))
        return Answer(prompt.pid, tenant, replica, error="boom" if prompt.pid == "s1q0" and tenant == "t2" else None)

    monkeypatch.setattr(load, "ask", ask)
    prompts = workload(systems=3, questions=4, words=20, seed=0)
    assert load.warm(prompts, ["t1", "t2"]) == 1  # the failed warm-up answer is counted
    systems = {p.messages[0]["content"] for p in prompts}
    assert sorted((s, t) for s, t, _, _ in asked) == sorted((s, t) for s in systems for t in ("t1", "t2"))
    assert not any(keep for *_, keep in asked) and not load.answers
    assert {r for _, _, r, _ in asked} == {"http://a", "http://b"}
