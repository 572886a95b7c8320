"""Which waiting requests a step admits, and how their prompts are grouped for prefill (pure list logic)."""
from __future__ import annotations

from collections import deque

from tandem.engine.request import Request


def take_waiting(waiting: deque[Request], free_rows: int, budget: int | None) -> tuple[list[Request], int | None]:
    """Pop the waiting requests (first come, first served) that fit in `free_rows` and, when `budget` is set, whose
    whole prompts fit in the prompt-token budget left; (those requests, the budget left). Stops at the first that
    does not fit, so the order is kept."""
    taken: list[Request] = []
    while waiting and len(taken) < free_rows and (budget is None or len(waiting[0].prompt_ids) <= budget):
        request = waiting.popleft()
        taken.append(request)
        if budget is not None:
            budget -= len(request.prompt_ids)
    return taken, budget


def prefill_groups(requests: list[Request], budget: int) -> list[list[Request]]:
    """Consecutive groups of at most `budget` prompt tokens in all (a lone request may exceed it)."""
    groups: list[list[Request]] = []
    for request in requests:
        group = groups[-1] if groups else None
        if group and sum(len(r.prompt_ids) for r in group) + len(request.prompt_ids) <= budget:
            group.append(request)
        else:
            groups.append([request])
    return groups


def first_of_each_prompt(requests: list[Request]) -> tuple[list[Request], list[Request]]:
    """(the first request of each distinct prompt, the rest): the rest reuse the first's prefill."""
    seen, first, rest = set(), [], []
    for request in requests:
        key = tuple(request.prompt_ids)
        (rest if key in seen else first).append(request)
        seen.add(key)
    return first, rest
