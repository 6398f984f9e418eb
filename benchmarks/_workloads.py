"""Deterministic benchmark texts: an evidence file full of names and terms, and questions about it."""

from __future__ import annotations

import random

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
