"""Deterministic RAG workloads for the CacheBlend benchmark (no downloads).

Two kinds of document sets, built from seeded templates:
- fact documents: entity-attribute sentences about people, cities and companies, with the
  facts a question needs split across chunks (a person's city in one chunk, the city's
  landmark in another);
- one coherent document (a long chronicle) cut into consecutive chunks.
Each chunk is grown sentence by sentence to a target of 128-256 tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
         "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Talia", "Umar", "Vera", "Wes", "Yuki"]
LAST = ["Abara", "Brandt", "Castell", "Dorsey", "Eklund", "Ferreira", "Galloway", "Haddad", "Ivers", "Jansen",
        "Kowal", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quiroga", "Rahman", "Sato", "Tamm"]
CITIES = ["Varnholt", "Esterby", "Quillmouth", "Dunmarrow", "Pellisande", "Orvik", "Tessaly", "Brackwater",
          "Kelmsford", "Sorrento Vale", "Aldermoor", "Ninefold", "Harrowgate", "Lunetta", "Cobaltine", "Westerlin"]
JOBS = ["glassblower", "cartographer", "violin maker", "beekeeper", "structural engineer", "pastry chef",
        "lighthouse keeper", "marine biologist", "bookbinder", "railway signaller", "astronomer", "potter"]
COLORS = ["teal", "crimson", "ochre", "lavender", "charcoal", "saffron", "emerald", "cobalt", "ivory", "maroon"]
PETS = ["a grey parrot", "two tabby cats", "a tortoise", "a beagle", "a lop-eared rabbit", "a goldfish",
        "a border collie", "three hens", "a ferret", "a canary"]
LANDMARKS = ["a copper clock tower", "a floating market", "a salt cathedral", "a glass observatory",
             "a spiral library", "a stone aqueduct", "a lantern bridge", "a botanical dome", "a tide mill"]
FILLER = ["The records were compiled by the regional archive in the spring survey.",
          "Several residents confirmed these details during interviews.",
          "Local newspapers reported on this more than once over the years.",
          "The information below was verified against the municipal registry.",
          "Neighbours describe the area as quiet in winter and busy in summer.",
          "Visitors often remark on the mild climate and the long evenings."]
PLACES = ["the harbour", "the old mill", "the northern pass", "the salt flats", "the river delta", "the cedar forest",
          "the marble quarry", "the lighthouse", "the market square", "the mountain monastery"]
ACTIONS = ["repaired the broken sails", "traded wool for lamp oil", "mapped the hidden springs", "waited out a storm",
           "argued about the route", "found an abandoned cart", "counted the remaining supplies",
           "listened to a travelling singer", "sketched the ruined walls", "bought bread and dried figs"]

_ART = ("a ", "an ", "the ", "two ", "three ")


def _bare(phrase: str) -> str:
    for a in _ART:
        if phrase.startswith(a):
            return phrase[len(a):]
    return phrase


# What answers are made of (bench/blend/figures.py's answer terms; numbers count too): every value
# a fact question or the chronicle's question can be answered with.
ANSWER_VOCAB = tuple(dict.fromkeys(
    COLORS + JOBS + CITIES + [_bare(x) for x in LANDMARKS + PETS + PLACES] + ["Mira", "Tobin", "Hask", "twins"]))


@dataclass
class BlendCase:
    system: str
    documents: list[str]
    question: str
    kind: str  # "facts" | "story"


SYSTEM = ("<|im_start|>system\nYou are a careful assistant. Answer the question using only the documents "
          "provided by the user.<|im_end|>\n<|im_start|>user\nDocuments:\n")


def _q(text: str) -> str:
    return f"Question: {text}<|im_end|>\n<|im_start|>assistant\n"


class _Grower:
    """Adds sentences to a chunk until it reaches a target token length."""

    def __init__(self, tokenizer, rng: random.Random, lo: int, hi: int) -> None:
        self.tok, self.rng, self.lo, self.hi = tokenizer, rng, lo, hi

    def n(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def grow(self, sentences: list[str], more) -> str:
        target = self.rng.randint(self.lo, self.hi)
        text = " ".join(sentences)
        while self.n(text) < target:
            s = more()
            if self.n(text + " " + s) > self.hi:
                break
            text += " " + s
        return text


def fact_pool(tokenizer, n_docs: int, seed: int, lo: int = 128, hi: int = 256):
    """Fact documents plus a question bank: (docs, [(question, doc indices it needs)])."""
    rng = random.Random(seed)
    g = _Grower(tokenizer, rng, lo, hi)
    people = [f"{a} {b}" for a in FIRST for b in LAST]
    rng.shuffle(people)
    city_facts = {c: (rng.choice(LANDMARKS), rng.randint(4, 900) * 1000) for c in CITIES}
    docs: list[str] = []
    questions: list[tuple[str, list[int]]] = []
    for d in range(n_docs):
        sents, facts = [], []
        for _ in range(3):
            p = people.pop()
            city, job, color, pet = rng.choice(CITIES), rng.choice(JOBS), rng.choice(COLORS), rng.choice(PETS)
            sents += [f"{p} lives in {city} and works as a {job}.", f"The favourite colour of {p} is {color}.",
                      f"{p} keeps {pet} at home."]
            facts.append(p)
        city = rng.choice(CITIES)
        lm, pop = city_facts[city]
        sents.append(f"The city of {city} is famous for {lm} and has about {pop} inhabitants.")
        docs.append(g.grow(sents, lambda: rng.choice(FILLER)))
        for p in facts:
            questions.append((f"What is the favourite colour of {p}, and what is their job?", [d]))
            questions.append((f"{p} lives in which city, and what is that city famous for?", [d]))
    # a question that needs two chunks: the person's city in one, the landmark in another
    city_doc = {}
    for i, text in enumerate(docs):
        for c in CITIES:
            if f"The city of {c} is famous" in text:
                city_doc.setdefault(c, i)
    linked = []
    for q, ds in questions:
        for c, j in city_doc.items():
            if "lives in which city" in q and f"lives in {c}" in docs[ds[0]] and j != ds[0]:
                linked.append((q, [ds[0], j]))
                break
    return docs, questions + linked


def story_chunks(tokenizer, n_chunks: int, seed: int, lo: int = 128, hi: int = 256) -> list[str]:
    """One coherent chronicle, cut into consecutive chunks."""
    rng = random.Random(seed)
    g = _Grower(tokenizer, rng, lo, hi)
    day = [0]
    crew = ["Mira", "Tobin", "old Hask", "the twins"]

    def sentence() -> str:
        day[0] += 1
        who, where, what = rng.choice(crew), rng.choice(PLACES), rng.choice(ACTIONS)
        return (f"On day {day[0]} of the journey, {who} reached {where}, where the company {what}; "
                f"by nightfall they had {rng.randint(3, 40)} days of water left.")

    return [g.grow([sentence()], sentence) for _ in range(n_chunks)]


def make_cases(tokenizer, n: int, seed: int = 0, n_fact_docs: int = 40, n_story: int = 24,
               chunks: tuple[int, int] = (4, 8), lo: int = 128, hi: int = 256) -> list[BlendCase]:
    rng = random.Random(seed + 1)
    docs, bank = fact_pool(tokenizer, n_fact_docs, seed, lo, hi)
    story = story_chunks(tokenizer, n_story, seed + 2, lo, hi)
    cases: list[BlendCase] = []
    for i in range(n):
        k = rng.randint(*chunks)
        if i % 4 == 3:  # one coherent document cut into consecutive chunks (kept in order)
            s = rng.randint(0, len(story) - k)
            cases.append(BlendCase(SYSTEM, story[s : s + k], _q("What happened on the last day described, and "
                                                                   "how much water was left?"), "story"))
            continue
        q, need = rng.choice(bank)
        others = [j for j in range(len(docs)) if j not in need]
        pick = need + rng.sample(others, max(0, k - len(need)))
        rng.shuffle(pick)  # retrieved chunks arrive in a random order
        cases.append(BlendCase(SYSTEM, [docs[j] for j in pick], _q(q), "facts"))
    return cases


def timing_case(tokenizer, target_tokens: int, seed: int = 7) -> BlendCase:
    """A fact-document prompt of about ``target_tokens`` tokens (chunks of ~256)."""
    docs, bank = fact_pool(tokenizer, max(4, target_tokens // 200 + 2), seed, 224, 256)
    out, total = [], 60
    for d in docs:
        if total >= target_tokens - 100:
            break
        out.append(d)
        total += g_len(tokenizer, d)
    return BlendCase(SYSTEM, out, _q(bank[0][0]), "facts")


def g_len(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])
