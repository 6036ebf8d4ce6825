"""The toy task's gold judge: the task's own sentiment rule, applied to generated text. For evaluation only.

The reward model is a proxy of this rule, learned from pairs; PPO optimises the proxy, never the rule (ppo.py does not
import this file). Whether PPO improved the policy is judged here: a continuation is parsed with the grammar that
make_toy_task.py writes reviews with, and scored with make_toy_task.response_score. Text outside the grammar (a
misspelled word, a clause the task never writes, a missing period) does not parse, and gold_score returns None.

    >>> gold_score(" the plot was dull, but the ending was superb.")    # 0.25 x (-2) + 3
    2.5
    >>> gold_score(" the plot was superb and the ending was truly stunning.")    # 3 + 1.5 x 3
    7.5
    >>> gold_score(" the plot was superb and the ending truly stunning.") is None    # no verb in the second clause
    True
"""

import functools
import itertools

from toy_task.make_toy_task import (ASPECTS, MODIFIERS, NEGATED_VERBS, PLAIN_VERBS, PREFIXES, SUFFIXES, WORD_VALUES,
                                    clause_text, response_score)


@functools.cache
def clause_table() -> dict[str, tuple]:
    """Every clause the task can write, as its text -> (aspect, verb, modifier, word), rendered by make_toy_task's own
    clause_text: modifiers only on plain verbs and adjectives ("hardly somewhat good" is not written), "like" before a
    noun phrase ("felt like a mess"). About 90,000 clauses."""
    table = {}
    for aspect, word in itertools.product(ASPECTS, WORD_VALUES):
        clauses = [(aspect, verb, "", word) for verb in PLAIN_VERBS + NEGATED_VERBS]
        if not word.startswith("a "):
            clauses += [(aspect, verb, modifier, word) for verb in PLAIN_VERBS for modifier in MODIFIERS]
        for clause in clauses:
            table[clause_text(clause)] = clause
    return table


def parse_response(text: str) -> tuple | None:
    """A continuation as make_toy_task writes it: " [prefix ]body[ suffix]." with body one of "A", "A and B",
    "A, but B", "although A, B" -> (form, [clause, ...]), or None when the text is not in the grammar."""
    text = text.strip()
    if not text.endswith("."):
        return None
    body = text[:-1]
    for prefix in PREFIXES:
        if body.startswith(prefix + " "):
            body = body[len(prefix) + 1:]
            break
    for suffix in SUFFIXES:
        if body.endswith(" " + suffix):
            body = body[: -len(suffix) - 1]
            break
    table = clause_table()
    if body.startswith("although "):
        form, parts = "although", body[len("although "):].split(", ")
    elif ", but " in body:
        form, parts = "but", body.split(", but ")
    elif " and " in body:
        form, parts = "and", body.split(" and ")
    else:
        form, parts = "single", [body]
    if len(parts) != (1 if form == "single" else 2) or not all(part in table for part in parts):
        return None
    return form, [table[part] for part in parts]


def gold_score(text: str) -> float | None:
    """The task's rule applied to a generated continuation (make_toy_task.response_score), None if it does not parse."""
    response = parse_response(text)
    return None if response is None else response_score(response)

