"""The evaluation's judges and statistics, checked by hand: the toy task's gold judge (toy_task/gold_judge.py), and
the win rate and rank correlation of evaluate.py; then evaluate.py's checks of its inputs, its reading of the
training run's metrics and what its pictures show (the title, the snapshot labels), in-process (one model is loaded,
the toy one, for its precision)."""

import json
import math
import os
import sys

import datasets
import pytest
import torch
import tyro
from matplotlib.backends.backend_agg import FigureCanvasAgg

import evaluate
import plumbing
from evaluate import Args, spearman, win_rate
from test_plumbing import BASE_MODEL
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
        with open(f"{plumbing.TOY_TASK}/data/{split}.jsonl") as f:
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


def stops_with(function, *args) -> str:
    """The one-line message that function(*args) stops with, as evaluate.py (plumbing.fail names the running script:
    under pytest, sys.argv[0] is pytest's)."""
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as stop:
        patch.setattr(sys, "argv", ["evaluate.py"])
        function(*args)
    message = str(stop.value)
    assert message.startswith("evaluate.py: error: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size must be at least 1, not 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--max-prompt-len", "-3"], "--max-prompt-len must be at least 1"),
    (["--snapshot-prompts", "0"], "--snapshot-prompts must be at least 1"),
    (["--num-samples", "-1"], "--num-samples must not be negative"),
    (["--temperature", "0"], "--temperature must be positive, not 0.0"),
    (["--temperature", "-1"], "--temperature must be positive"),
    (["--temperature", "inf"], "--temperature must be a finite number, not inf"),
    (["--temperature", "nan"], "--temperature must be a finite number, not nan"),
    (["--seed", "-1"], "--seed must be between 0 and 2**32 - 1"),
])
def test_bad_flags_stop_with_one_line(flags, message):
    assert message in stops_with(plumbing.check_ranges, tyro.cli(Args, args=flags))


def test_the_default_flags_pass():
    plumbing.check_ranges(Args())


def test_output_dir_that_is_or_holds_an_input_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert "is or holds --sft-model" in stops_with(evaluate.check_evaluation_dir, Args(output_dir=str(model),
                                                                                     sft_model=str(model)))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a"}\n')
    assert "is or holds --dataset" in stops_with(evaluate.check_evaluation_dir, Args(output_dir=str(tmp_path),
                                                                                   dataset=str(data)))
    # Nor inside a data set folder, where evaluation.json would be read as data; nor a link to nowhere.
    (tmp_path / "data").mkdir()
    assert "is inside --dataset" in stops_with(evaluate.check_evaluation_dir, Args(
        output_dir=str(tmp_path / "data" / "eval"), dataset=str(tmp_path / "data")))
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert "which does not exist; make that folder or name another" in stops_with(evaluate.check_evaluation_dir, Args(
        output_dir=str(tmp_path / "link")))
    # The files it writes: never through a link, nor over a folder; the snapshots are an input too.
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "ppo_training.png").symlink_to(tmp_path / "data.jsonl")
    assert f"'{tmp_path / 'eval' / 'ppo_training.png'}', where the evaluation writes, is a link; move it away, or " \
           "name another --output-dir" in stops_with(evaluate.check_evaluation_dir,
                                                     Args(output_dir=str(tmp_path / "eval")))
    assert "is or holds --snapshots-dir" in stops_with(evaluate.check_evaluation_dir, Args(
        output_dir=str(tmp_path), snapshots_dir=str(model)))
    # A folder whose name merely starts like an input's is not the input: the comparison is by whole folders.
    evaluate.check_evaluation_dir(Args(output_dir=str(tmp_path / "mod"), sft_model=str(model)))
    assert os.listdir(tmp_path / "mod") == []  # created, and the probe file removed


def test_a_picture_is_written_whole_never_through_a_hard_link(tmp_path):
    """A picture in the output folder that is another name of a user's file (a hard link) is replaced, not written
    into: the user's file stays as it was (as evaluation.json and every record are written)."""
    import matplotlib.pyplot as plt
    users, picture = tmp_path / "users.png", tmp_path / "ppo_training.png"
    users.write_text("the user's")
    os.link(users, picture)
    figure = plt.figure()
    evaluate.save_figure(figure, str(picture))
    plt.close(figure)
    assert users.read_bytes() == b"the user's" and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_snapshots_dir_that_does_not_exist_stops_with_one_line(tmp_path):
    """--snapshots-dir names the folder of the over-optimisation picture: one that is not there stops the evaluation
    before any model loads (left out, the actor's ../snapshots is used if there is one)."""
    missing = tmp_path / "snapshots"
    message = stops_with(evaluate.main, Args(snapshots_dir=str(missing), output_dir=str(tmp_path / "eval")))
    assert f"--snapshots-dir '{missing}' is no folder; name the snapshots/ folder of a ppo.py run with " \
           "--snapshot-every N, or leave the flag out" in message
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("output_dir", ["/proc/x", "/proc"])  # a folder that cannot be made; one that takes no file
def test_output_dir_that_cannot_be_written_is_refused(output_dir):
    assert f"cannot write to --output-dir {output_dir!r}" in stops_with(evaluate.check_evaluation_dir,
                                                                         Args(output_dir=output_dir))


@pytest.mark.parametrize("value, problem", [(None, "empty (null)"), (["a"], "a value of type list, not text"), ("  ", "empty text")])
def test_a_bad_prompt_cell_is_named_by_row_and_column(value, problem):
    rows = [{"prompt": "fine"}, {"prompt": value}]
    assert plumbing.text_of(rows[0], 0, "prompt", "test") == "fine"
    assert f"row 1 of split 'test', column 'prompt': {problem}" in stops_with(plumbing.text_of, rows[1], 1, "prompt",
                                                                             "test")


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "a"}\n{"prompt": "b\n', "line 2 of"),  # a partial last line, named by its number
    ('{"prompt": "The caf\u00e9 was good, and"}\n'.encode("latin-1"), "is not UTF-8 text"),
])
def test_a_malformed_or_latin_1_data_file_stops_with_one_line(tmp_path, monkeypatch, content, message):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))  # not the user's cache
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    assert message in stops_with(plumbing.load_split, str(path), "test", ["prompt"])


def test_every_model_is_loaded_in_one_precision(tmp_path):
    """A PPO actor saved in bf16 against an SFT model saved in fp32 (ppo.py --dtype bf16 after sft.py's default): each
    is loaded in --dtype, fp32 unless set, not in its checkpoint's, so that the KL between them measures the policies,
    not the rounding of one."""
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(BASE_MODEL, dtype=torch.bfloat16).save_pretrained(tmp_path)
    for dtype, expected in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        model = evaluate.load_model(AutoModelForCausalLM, str(tmp_path), "check --ppo-model", Args(dtype=dtype),
                                    torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {expected}


def test_non_finite_weights_are_refused():
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.bias[1] = float("nan")
    assert "not finite (inf or nan) in 1 tensors (bias)" in stops_with(plumbing.check_finite_weights, model, "model")


def metrics_row(iteration: int, score: float) -> str:
    return json.dumps({"iteration": iteration, "episode": 64 * iteration, "objective/scores": score,
                       "objective/rlhf_reward": score - 0.1, "objective/kl": 0.5 * iteration})


def test_metrics_rows_skip_partial_lines_and_keep_the_last_of_a_repeated_iteration(tmp_path, capsys):
    """A run resumed after a kill may repeat an iteration and leave a partial line where it was killed."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join([metrics_row(1, 0.1), metrics_row(2, 0.2), metrics_row(2, 0.25),
                                  json.dumps({"iteration": 3, "episode": 192}),  # lacks the scores
                                  metrics_row(3, 0.3), '{"iteration": 4, "episode": 25']))  # cut mid-write
    rows = evaluate.read_metrics(str(metrics))
    assert [(row["iteration"], row["objective/scores"]) for row in rows] == [(1, 0.1), (2, 0.25), (3, 0.3)]
    assert "skipped 2 lines" in capsys.readouterr().out
    evaluate.plot_training(str(metrics), str(tmp_path / "ppo_training.png"))
    assert (tmp_path / "ppo_training.png").stat().st_size > 0
    assert "skipped 2 lines" in capsys.readouterr().out


def test_the_metrics_file_is_the_one_named_by_the_actor_folder(tmp_path, capsys, monkeypatch):
    actor, metrics = tmp_path / "actor", tmp_path / "runs" / "ppo__1__2" / "metrics.jsonl"
    actor.mkdir()
    assert evaluate.training_metrics_file(Args(ppo_model=str(actor))) is None
    assert "has no training_run.json" in capsys.readouterr().out
    record = {"script": "ppo.py", "run_name": "ppo__1__2", "metrics_file": str(metrics), "finished": True}
    (actor / plumbing.RECORD).write_text(json.dumps(record))
    assert evaluate.training_metrics_file(Args(ppo_model=str(actor))) is None  # named, but not there (yet)
    assert "does not exist" in capsys.readouterr().out
    metrics.parent.mkdir(parents=True)
    metrics.write_text(metrics_row(1, 0.1) + "\n")
    notes = tmp_path / "notes.jsonl"  # a record names any file it likes: only the run's own metrics file is read
    notes.write_text(metrics_row(1, 0.1) + "\n")
    (actor / plumbing.RECORD).write_text(json.dumps({**record, "metrics_file": str(notes)}))
    assert evaluate.training_metrics_file(Args(ppo_model=str(actor))) is None
    assert f"the metrics file '{notes}' named in {actor / plumbing.RECORD} is no runs/RUN_NAME/metrics.jsonl of its " \
           "run (set --metrics-file)" in capsys.readouterr().out
    (actor / plumbing.RECORD).write_text(json.dumps(record))
    assert evaluate.training_metrics_file(Args(ppo_model=str(actor))) == str(metrics)
    # The project moved, its runs/ with it: the metrics are found where the run logs, runs/RUN_NAME of the working
    # folder, though the record names the old place.
    moved = tmp_path / "moved" / "runs" / "ppo__1__2"
    moved.parent.mkdir(parents=True)
    os.rename(metrics.parent, moved)
    monkeypatch.chdir(tmp_path / "moved")
    assert evaluate.training_metrics_file(Args(ppo_model=str(actor))) == str(moved / "metrics.jsonl")
    os.rename(moved, metrics.parent)
    other = tmp_path / "other.jsonl"  # --metrics-file wins over the record, and must exist
    assert "check --metrics-file" in stops_with(evaluate.training_metrics_file, Args(ppo_model=str(actor),
                                                                                     metrics_file=str(other)))
    other.write_text(metrics_row(1, 0.1) + "\n")
    assert evaluate.training_metrics_file(Args(ppo_model=str(actor), metrics_file=str(other))) == str(other)


def drawn_figure(monkeypatch, plot, *args):
    """The figure that plot(*args) hands to evaluate.save_figure (its file still written), on a canvas of its own
    again (plt.close took the figure's) and drawn, as it was saved."""
    figures, save_figure = [], evaluate.save_figure

    def keeping_save_figure(fig, path):
        save_figure(fig, path)
        figures.append(fig)

    monkeypatch.setattr(evaluate, "save_figure", keeping_save_figure)
    plot(*args)
    (fig,) = figures
    FigureCanvasAgg(fig).draw()
    return fig


def test_the_training_picture_is_titled_with_the_run_name(tmp_path, monkeypatch):
    metrics = tmp_path / "runs" / "ppo__1__1700000000" / "metrics.jsonl"  # where ppo.py writes it, an absolute path
    metrics.parent.mkdir(parents=True)
    metrics.write_text(metrics_row(1, 0.1) + "\n" + metrics_row(2, 0.2) + "\n")
    fig = drawn_figure(monkeypatch, evaluate.plot_training, str(metrics), str(tmp_path / "ppo_training.png"))
    assert fig.get_suptitle() == "ppo__1__1700000000"


@pytest.mark.parametrize("spread", [0.0, 0.02])  # the same point; about a label's height apart
def test_the_snapshot_labels_never_overlap(tmp_path, monkeypatch, spread):
    """Eight snapshots whose points lie within `spread` of one another (KL and gold win rate), beside the axes' right
    edge: no two labels' boxes on the drawn canvas overlap, none covers a plotted point, and every label is drawn
    once."""
    labels = ["SFT"] + [f"it {16 * i}" for i in range(1, 9)]
    points = [{"label": label, "mean_kl_to_sft": 2.0 + spread * i, "gold_win_rate": 0.6 + spread * i,
               "win_rate": 0.7, "parse_rate": 0.9, "mean_score": 0.5, "mean_gold_score": 1.0}
              for i, label in enumerate(labels)]
    points[0]["mean_kl_to_sft"] = 0.0  # the SFT policy's own KL, far to the left
    fig = drawn_figure(monkeypatch, evaluate.plot_overoptimization, points, str(tmp_path / "overoptimization.png"))
    renderer = fig.canvas.get_renderer()
    texts = [text for text in fig.axes[0].texts if text.get_text()]
    assert sorted(text.get_text() for text in texts) == sorted(labels)
    boxes = [text.get_window_extent(renderer) for text in texts]
    for i, box in enumerate(boxes):
        for j, other in enumerate(boxes[:i]):
            assert not box.overlaps(other), (texts[i].get_text(), texts[j].get_text())
    axis = fig.axes[0]
    for line in axis.get_lines():
        for x, y in axis.transData.transform(line.get_xydata()):
            assert not any(box.contains(x, y) for box in boxes), (line.get_label(), x, y)
