"""The benchmarks' shared workloads: deterministic texts and the requests built from them.

An evidence file full of names and terms (:func:`evidence`) and questions about it
(``QUESTIONS``); short general questions (``TOPICS``) that the serving benchmarks
send (``bench_batching``, ``bench_llama_server``, ``bench_http``, ``soak``); the
uniform and mixed request sets of the batching benchmark (:func:`workload`),
which ``bench_llama_server`` replays against llama.cpp's server; and the
shared-system-prompt conversations (:func:`shared_workload`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST = ["Mira", "Tomasz", "Aiko", "Oluwaseun", "Ingrid", "Rafael", "Leilani", "Dmitri", "Saoirse", "Kwame",
         "Henrike", "Bao", "Esperanza", "Yusuf", "Annelie", "Caspian"]
LAST = ["Okonkwo", "Wieland", "Tanabe", "Adeyemi", "Halvorsen", "Quintero", "Kahale", "Sokolov", "Byrne",
        "Mensah", "Brandt", "Nguyen", "Villalobos", "Demir", "Lindqvist", "Ashgrove"]
PLACES = ["north quay", "salt barn", "lighthouse fund", "Harbor Street ledger", "tide mill", "rope walk",
          "customs house", "herring market", "chapel of St. Brendan", "old signal tower"]
ROLES = ["treasurer", "clerk", "harbor master", "surveyor", "keeper", "auditor", "pilot", "warden"]


def evidence(n_entries: int, seed: int = 1888) -> str:
    """A ledger of ``n_entries`` lines, each naming people, places, roles and sums."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_entries):
        who = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        lines.append(
            f"Entry {i + 1}: {who}, {rng.choice(ROLES)} of the {rng.choice(PLACES)}, recorded "
            f"{rng.randint(10, 9999)} crowns on {rng.randint(1, 28)} {rng.choice(['March', 'June', 'October'])} "
            f"{rng.randint(1850, 1899)}, witnessed by {rng.choice(FIRST)} {rng.choice(LAST)}."
        )
    return "\n".join(lines)


def evidence_of_tokens(model, target: int, seed: int = 1888) -> str:
    """The shortest ledger whose prompt is at least ``target`` tokens for ``model``."""
    n = 8
    while len(model.prompt_tokens(evidence(n, seed))) < target:
        n += 4
    return evidence(n, seed)


QUESTIONS = [
    "Who recorded the largest sum, and in which year?",
    "List every treasurer named in the ledger.",
    "Which entries mention the salt barn?",
    "Who witnessed the first entry?",
    "Summarize the ledger in one sentence.",
]

# Short general questions, cycled over the clients of the serving benchmarks.
TOPICS = [
    "Why is the sky blue?",
    "Name three uses of copper.",
    "How do bees make honey?",
    "What causes ocean tides?",
    "Explain what a compiler does.",
    "Why do leaves change colour in autumn?",
    "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?",
]
CONTEXT_SENTENCE = (
    "The harbour town keeps a ledger of every ship, its cargo, its captain and the day it arrived. "
)


@dataclass(frozen=True)
class Request:
    """One request of a batching run: a name for reports, the prompt and its output budget."""

    name: str
    prompt: str
    max_tokens: int


def workload(kind: str, clients: int, max_tokens: int) -> list[Request]:
    """The requests of one run: uniform (short prompts, same budget) or mixed (4x spread)."""
    requests = []
    for i in range(clients):
        topic = TOPICS[i % len(TOPICS)]
        if kind == "uniform":
            requests.append(Request(f"u{i}", topic, max_tokens))
        else:
            reps = 1 + (i % 4)  # prompt length 1x..4x
            budget = max(1, max_tokens * (1 + (i * 3 + 1) % 4) // 4)  # 1/4..4/4, not aligned with the prompt
            prompt = f"{CONTEXT_SENTENCE * reps * 2}Question: {topic}"
            requests.append(Request(f"m{i}", prompt, budget))
    return requests


def shared_workload(lease, clients: int, questions: int, system_tokens: int, seed: int) -> list[list[list[dict]]]:
    """Per client, its ``questions`` conversations: one system prompt (a ledger of about
    ``system_tokens`` tokens, different for each ``seed``) and a different short question each."""
    system = "Answer questions about this ledger briefly.\n" + evidence_of_tokens(lease, system_tokens, seed=seed)
    return [
        [[{"role": "system", "content": system}, {"role": "user", "content": TOPICS[(c * questions + q) % len(TOPICS)]}]
         for q in range(questions)]
        for c in range(clients)
    ]


# -- speculation (bench_lookup): six tasks, written once, not tuned on any model's output ------------------

CODE = '''def summarize_orders(orders, region):
    """Total, count and largest order of one region."""
    total = 0
    count = 0
    largest = None
    for order in orders:
        if order["region"] != region:
            continue
        amount = order["quantity"] * order["unit_price"]
        total += amount
        count += 1
        if largest is None or amount > largest["amount"]:
            largest = {"id": order["id"], "amount": amount}
    average = total / count if count else 0.0
    return {"region": region, "total": total, "count": count, "average": average, "largest": largest}
'''

ARTICLE = (
    "The harbor commission met on Tuesday to review the winter repairs. The chief engineer reported that the "
    "north breakwater lost forty meters of capstone in the January storms and that temporary barriers would hold "
    "until April. \"We can finish the permanent work before the herring season if the quarry delivers on time,\" "
    "she said. The treasurer warned that the repair fund stands at 412,000 crowns, about a third short of the "
    "estimate, and proposed a levy of two crowns per berth. Several fishermen objected. \"The levy falls on those "
    "who already lost the most days at sea,\" said Aiko Tanabe, who has fished from the quay for thirty years. "
    "The commission agreed to defer the vote until the quarry confirms its prices, and asked the engineer to "
    "publish a schedule of the closures along the south wall."
)

TWO_PASS_FIRST = ("Write a Python function parse_duration(text) that turns strings like '1h30m', '45s' or "
                  "'2h' into a number of seconds. Raise ValueError on anything else. Give only the code.")
TWO_PASS_SECOND = ("Write a Python function parse_duration(text) that turns strings like '1h30m', '45s' or "
                   "'2h' into a number of seconds. Raise ValueError on anything else. Also accept days, "
                   "such as '3d4h'. Give only the code.")


@dataclass(frozen=True)
class SpeculationTask:
    """One speculation workload: the measured prompt, and for a two-pass edit the request that ran before it."""

    name: str
    prompt: str
    before: str | None = None


def speculation_tasks() -> list[SpeculationTask]:
    ledger = evidence(12)
    return [
        SpeculationTask("copy-heavy", "Quote the ledger below line by line, keeping every name, place and sum, "
                                      f"then summarize it using its original names and terms.\n\n{ledger}"),
        SpeculationTask("code-edit", "Rename the variable `largest` to `biggest` in this function and return the "
                                     f"whole function, otherwise unchanged.\n\n{CODE}"),
        SpeculationTask("summary-quotes", "Summarize this report in three sentences, quoting the speakers word "
                                          f"for word.\n\n{ARTICLE}"),
        SpeculationTask("two-pass", TWO_PASS_SECOND, before=TWO_PASS_FIRST),
        SpeculationTask("open-ended", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
        # Counting repeats ", " constantly but never the digits after it: n-gram matches keep
        # proposing continuations the model rejects, the worst case for prompt lookup.
        SpeculationTask("counting", "Count upward from 1 to 200, separated by commas: 1, 2, 3,"),
    ]
