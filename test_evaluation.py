"""The evaluation's judges and statistics, checked by hand: the toy task's gold judge (toy_task/gold_judge.py), and
the win rate and rank correlation of evaluate.py."""

import json
import math

import pytest

from evaluate import spearman, win_rate
from toy_task.gold_judge import gold_score, parse_response


@pytest.mark.parametrize("text, score", [
    (" the story was good.", 1.0),  # "good" +1
    (" the story was truly superb.", 4.5),  # "superb" +3, "truly" x1.5
    (" the story was not boring.", 1.0),  # "boring" -2, negated: -0.5 x -2 = +1
    (" the ending felt like a mess.", -2.0),  # a noun phrase, "like" after "felt"
    (" the ending did not feel like a mess.", 1.0),  # -0.5 x -2
    (" the plot was dull, but the ending was superb.", 2.5),  # 0.25 x -2 + 3: the conceded clause counts a quarter
    (" although the plot was superb, the ending was dull.", -1.25),  # 0.25 x 3 - 2
    (" the humor was fun and the story seemed superb.", 4.0),  # "and" adds: 1 + 3
    (" all in all, the cast was somewhat bland and the music was slow in my opinion.", -1.5),  # -0.5 - 1, fillers
    (" the humor was incredibly brilliant and the story seemed truly superb.", 9.0),  # 4.5 + 4.5, the highest
])
def test_gold_score_by_hand(text, score):
    assert gold_score(text) == score


@pytest.mark.parametrize("text", [
    "",
    " the story was good",  # no period
    " the story was goood.",  # not a word of the task
    " the story was superb and the ending truly stunning.",  # no verb in the second clause
    " the story was not truly good.",  # the task never modifies a negated clause
    " the story felt a mess.",  # "felt" takes "like" before a noun phrase
    " the story was good and the ending was bad and the cast was fun.",  # at most two clauses
    " although the pacing was dull and the plot felt superb.",  # "although" needs its comma
    " the story was good. the ending was bad.",  # one sentence
])
def test_text_outside_the_grammar_does_not_parse(text):
    assert parse_response(text) is None and gold_score(text) is None


def test_every_bundled_pair_parses_and_the_rule_prefers_chosen():
    """The judge reads the task's own data as the task wrote it: every response parses, and the chosen one has the
    higher gold score, by the gap the task keeps (1 at least)."""
    for split in ("train", "test"):
        with open(f"toy_task/data/{split}.jsonl") as f:
            for line in f:
                row = json.loads(line)
                chosen, rejected = gold_score(row["chosen"]), gold_score(row["rejected"])
                assert chosen is not None and rejected is not None, row
                assert chosen - rejected >= 1.0, row


def test_win_rate_by_hand():
    # 3 > 1 wins, 2 = 2 ties (half), 1 < 4 loses, a number beats None, None loses to a number, None ties None:
    # (1 + 0.5 + 0 + 1 + 0 + 0.5) / 6 = 0.5
    assert win_rate([3, 2, 1, 0.0, None, None], [1, 2, 4, None, -9, None]) == 0.5


def test_spearman_by_hand():
    # Ranks of x = [1, 2, 3, 4] are 0, 1, 2, 3; y = [10, 30, 20, 40] has ranks 0, 2, 1, 3. Centred: -1.5, -.5, .5, 1.5
    # and -1.5, .5, -.5, 1.5; products 2.25 - .25 - .25 + 2.25 = 4; norms sqrt(5) each: rho = 4 / 5 = 0.8.
    assert spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    # Ties share their average rank: y = [5, 5, 7, 9] has ranks .5, .5, 2, 3 (mean 1.5): centred -1, -1, .5, 1.5,
    # against x's -1.5, -.5, .5, 1.5: products 1.5 + .5 + .25 + 2.25 = 4.5; norms sqrt(5) and sqrt(4.5):
    # rho = 4.5 / sqrt(22.5) = 0.9487.
    assert spearman([1, 2, 3, 4], [5, 5, 7, 9]) == pytest.approx(4.5 / math.sqrt(22.5))
    # Any increasing map of x ranks the same: rho = 1; a decreasing one: -1.
    assert spearman([0.1, 5, 2, 9], [1, 125, 8, 729]) == pytest.approx(1.0)
    assert spearman([0.1, 5, 2, 9], [-1, -125, -8, -729]) == pytest.approx(-1.0)
