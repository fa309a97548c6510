"""bench.tenant_flood's ``--replica soak``: the soak's DoS-phase client, asked as the soak asks it."""

from __future__ import annotations

import pytest

from bench.soak.load import dos_client_prompts, workload
from bench.soak.run import QUICK, SEED
from bench.tenant_flood import _soak_prompts, main


def test_the_soak_replica_asks_what_the_soaks_dos_client_asks() -> None:
    measured = dos_client_prompts(workload(QUICK.systems, QUICK.questions, QUICK.words, SEED))
    messages, tokens = _soak_prompts()
    assert len(messages) == 4 and messages == [p.messages for p in measured] and tokens == QUICK.normal_tokens
    assert all(m[0]["role"] == "system" and len(m[0]["content"]) > 500 for m in messages)


def test_an_unknown_replica_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--out", "/dev/null", "--replica", "vllm"])
    assert "invalid choice" in capsys.readouterr().err
