"""The workloads of bench.serve, as OpenAI chat messages: multi-round QA and RAG.

QA (the shape of LMCache's multi-round QA benchmark): ``users`` users share one system prompt of
``system_tokens``; each has a private context of ``context_tokens`` (its document, sent with its
first question) and asks one question of ``question_tokens`` per round, answered in
``answer_tokens``. Every turn sends the whole conversation so far, so a turn's prompt extends the
previous one: its KV is reusable up to the new question, from wherever it still is.

RAG: a pool of ``docs`` documents of ``doc_tokens``; each request puts ``docs_per_request`` of them,
drawn at random in a random order, after the system prompt, then a question. Exact prefix caching
reuses a request's KV only as far as it starts with the same documents in the same order.

Text is random words from a fixed list, sized with the model's tokenizer; the load generator never
sends token ids (it sends text and reads the server's usage).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government number "
          "night point home water room mother area money story fact month lot right study book eye job word "
          "business issue side kind head house service friend father power hour game line end member law car "
          "city community name president team minute idea kid body information back parent face others level "
          "office door health person art war history party result change morning reason research girl guy "
          "moment air teacher force education river garden window letter paper market light music field").split()


@dataclass(frozen=True)
class QASpec:
    users: int = 8
    system_tokens: int = 128
    context_tokens: int = 448
    question_tokens: int = 24
    answer_tokens: int = 12
    rounds: int = 4  # measured rounds (a first, unmeasured round puts every context in the cache)
    max_turns: int = 0  # a user starts a new conversation (a new document) after this many turns; 0: never

    def __post_init__(self) -> None:
        if min(self.users, self.system_tokens, self.context_tokens, self.question_tokens, self.answer_tokens,
               self.rounds) <= 0 or self.max_turns < 0:
            raise ValueError(f"every QA workload size must be > 0: {self}")


@dataclass(frozen=True)
class RAGSpec:
    docs: int = 6
    doc_tokens: int = 256
    docs_per_request: int = 2
    question_tokens: int = 24
    answer_tokens: int = 12
    requests: int = 12  # per measured point

    def __post_init__(self) -> None:
        if not 0 < self.docs_per_request <= self.docs or min(self.doc_tokens, self.question_tokens,
                                                               self.answer_tokens, self.requests) <= 0:
            raise ValueError(f"bad RAG workload: {self}")


class Text:
    """Random text of an exact token count under one tokenizer (words, then trimmed by tokens)."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tok = tokenizer
        self.rng = np.random.default_rng(seed)

    def make(self, tokens: int) -> str:
        words = [str(w) for w in self.rng.choice(_WORDS, size=tokens + 8)]
        ids = self.tok(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
        return self.tok.decode(ids).strip()


class QAWorkload:
    """Each user's conversation; ``next_turn(u)`` is its next request, ``answered`` appends the answer.

    Under Poisson arrivals ``pick()`` says who sends: the idle user who sent longest ago (a user
    waits for an answer before asking again); when every user is waiting, the one who sent longest
    ago asks anyway (counted in ``busy_picks``: the population, not the rate, limited the load).
    ``held_tokens()`` is the working set as it is now, measured from the conversations.
    """

    def __init__(self, spec: QASpec, tokenizer, seed: int = 7) -> None:
        self.spec = spec
        self.tok = tokenizer
        text = Text(tokenizer, seed)
        self.system = text.make(spec.system_tokens)
        self.contexts = [text.make(spec.context_tokens) for _ in range(spec.users)]
        self._text = text
        self.turns = [0] * spec.users
        self.history: list[list[dict[str, str]]] = [[{"role": "system", "content": self.system}]
                                                    for _ in range(spec.users)]
        self.waiting: set[int] = set()
        self._last = [-1] * spec.users
        self._picks = 0
        self.busy_picks = 0
        self.restarts = 0

    def pick(self) -> int:
        idle = [u for u in range(self.spec.users) if u not in self.waiting]
        if not idle:
            self.busy_picks += 1
        user = min(idle or range(self.spec.users), key=lambda u: self._last[u])
        self._last[user] = self._picks
        self._picks += 1
        self.waiting.add(user)
        return user

    def held_tokens(self) -> int:
        """Tokens of KV every user's conversation holds now (its prompt so far under the chat
        template, answers included), the shared system turn counted once."""
        shared = chat_tokens(self.tok, self.history[0][:1], generation_prompt=False)
        return shared + sum(chat_tokens(self.tok, h, generation_prompt=False) - shared for h in self.history)

    def next_turn(self, user: int) -> list[dict[str, str]]:
        if self.spec.max_turns and self.turns[user] >= self.spec.max_turns:  # a new conversation, a new document
            self.history[user] = [{"role": "system", "content": self.system}]
            self.contexts[user] = self._text.make(self.spec.context_tokens)
            self.turns[user] = 0
            self.restarts += 1
        question = self._text.make(self.spec.question_tokens)
        if self.turns[user] == 0:
            question = f"Document:\n{self.contexts[user]}\n\nQuestion: {question}"
        self.history[user].append({"role": "user", "content": question})
        self.turns[user] += 1
        return list(self.history[user])

    def answered(self, user: int, text: str) -> None:
        self.history[user].append({"role": "assistant", "content": text})
        self.waiting.discard(user)

    def abandoned(self, user: int) -> None:
        """The user's request was cancelled unanswered: its question is taken back."""
        if self.history[user][-1]["role"] == "user":
            self.history[user].pop()
            self.turns[user] -= 1
        self.waiting.discard(user)


class RAGWorkload:
    def __init__(self, spec: RAGSpec, tokenizer, seed: int = 11) -> None:
        self.spec = spec
        text = Text(tokenizer, seed)
        self.system = text.make(64)
        self.docs = [text.make(spec.doc_tokens) for _ in range(spec.docs)]
        self._text = text
        self.rng = np.random.default_rng(seed + 1)

    def request(self) -> list[dict[str, str]]:
        picked = self.rng.choice(self.spec.docs, size=self.spec.docs_per_request, replace=False)
        body = "\n\n".join(f"Document {i + 1}:\n{self.docs[d]}" for i, d in enumerate(picked))
        question = self._text.make(self.spec.question_tokens)
        return [{"role": "system", "content": self.system}, {"role": "user", "content": f"{body}\n\nQuestion: {question}"}]


def chat_tokens(tokenizer, messages: list[dict[str, str]], generation_prompt: bool = True) -> int:
    """Prompt tokens of ``messages`` under the model's chat template (as the server counts them)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def planned_qa_working_set(spec: QASpec, tokenizer) -> tuple[int, int]:
    """(tokens of every user's KV at the end of the run, tokens of the largest request): the
    system prompt counted once, answers taken at their full length."""
    text = Text(tokenizer, 0)
    system = text.make(spec.system_tokens)
    msgs = [{"role": "system", "content": system}]
    for turn in range(spec.rounds + 1):
        q = text.make(spec.question_tokens)
        msgs.append({"role": "user", "content": f"Document:\n{text.make(spec.context_tokens)}\n\nQuestion: {q}"
                     if turn == 0 else q})
        msgs.append({"role": "assistant", "content": text.make(spec.answer_tokens)})
    per_user = chat_tokens(tokenizer, msgs[:-1]) + spec.answer_tokens
    shared = chat_tokens(tokenizer, msgs[:1], generation_prompt=False)  # the system turn: every user's
    return shared + spec.users * (per_user - shared), per_user
