"""plumbing on its own, in this process: the flags, data files, model folders, output folders, ranks and
checkpoints that every stage relies on, each helper checked once (each stage's own tests show that the stage calls
it). The first tests check that plumbing imports none of the stages (in a process of its own, and in its functions)
and knows nothing of RLHF, and that no stage keeps a copy of what plumbing holds; that one, and the test of
evaluate.py's call of keep_freed_memory, are the only tests here that import a stage.

The shared bad-input fixture (`bad`), check_stops and write_jsonl live here; the stages' test files import them.
"""

import argparse
import contextlib
import dis
import importlib
import inspect
import json
import marshal
import math
import os
import pkgutil
import re
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import datasets
import pytest
import tokenizers
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import plumbing
from test_docs import top_level_names

BASE_MODEL, TOY_DATA = os.path.join(plumbing.TOY_TASK, "base_model"), os.path.join(plumbing.TOY_TASK, "data")
ROOT = Path(__file__).resolve().parent
# The files that import plumbing: none may define a name that it defines.
STAGES = ["sft.py", "reward_model.py", "ppo.py", "evaluate.py", "benchmark.py", "fast_sampling.py"]
# plumbing's modules, by concern; the stages reach their names as plumbing.NAME.
MODULES = [importlib.import_module(f"plumbing.{module.name}") for module in pkgutil.iter_modules(plumbing.__path__)]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def check_stops(cases):
    """Each (call, message): the call stops with that one-line message (fail() raises SystemExit with the message,
    which Python prints without a stack trace). In-process, so that the many cases cost no process start each; the
    stages' tests run a few of them as a user would (check_errors), to show that main calls them."""
    for call, message in cases:
        with pytest.raises(SystemExit) as stop:
            call()
        assert message in str(stop.value), (message, str(stop.value))


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """The wrong files and folders a new user points the scripts at."""
    root = tmp_path_factory.mktemp("bad")
    (root / "empty_folder").mkdir()
    shutil.copytree(BASE_MODEL, root / "no_weights", ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copytree(BASE_MODEL, root / "pickle_only", ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(f"{BASE_MODEL}/model.safetensors"), root / "pickle_only" / "pytorch_model.bin")
    row = {"prompt": "A fine film, and", "chosen": " good.", "rejected": " bad."}
    write_jsonl(root / "empty_prompt.jsonl", [row, {**row, "prompt": "  "}])
    write_jsonl(root / "empty_rejected.jsonl", [row, {**row, "rejected": ""}])
    (root / "data.csv").write_text("prompt,chosen,rejected\nA fine film, and,good.,bad.\n")
    (root / "broken.jsonl").write_text('{"prompt": "A fine film, and", "chosen": " good."}\n{"prompt": "A film", "chosen"\n')
    (root / "empty.jsonl").write_text("")
    (root / "two_formats").mkdir()
    (root / "one_format").mkdir()
    for split in ("train", "test"):
        write_jsonl(root / "two_formats" / f"{split}.jsonl", [row] * 2)
        datasets.Dataset.from_list([row] * 2).to_parquet(root / "two_formats" / f"{split}.parquet")
        write_jsonl(root / "one_format" / f"{split}.{'json' if split == 'train' else 'jsonl'}", [row])
    (root / "twice").mkdir()  # train.json and train.jsonl: `datasets` reads both, each row twice
    for name in ("train.json", "train.jsonl", "test.jsonl"):
        write_jsonl(root / "twice" / name, [row])
    (root / "a_file").write_text("not a folder")
    (root / "latin1.jsonl").write_bytes('{"prompt": "Un café, and", "chosen": " good."}\n'.encode("latin-1"))
    shutil.copytree(BASE_MODEL, root / "added_tokens")  # chat tokens added to the tokenizer, the embeddings not resized
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    tokenizer.add_tokens(["<|user|>", "<|assistant|>"], special_tokens=True)
    tokenizer.save_pretrained(root / "added_tokens")
    shutil.copytree(TOY_DATA, root / "data")  # a data set folder (that an output folder must stay out of)
    shutil.copytree(BASE_MODEL, root / "nan_weights")
    weights = load_file(f"{BASE_MODEL}/model.safetensors")
    weights[sorted(weights)[-1]].view(-1)[0] = float("nan")
    save_file(weights, root / "nan_weights" / "model.safetensors", metadata={"format": "pt"})
    return root


# ---------------------------------------------------------------------------------------------------------------
# What plumbing is: imported by the stages, importing none of them, the one place each helper is defined
# ---------------------------------------------------------------------------------------------------------------
def test_no_stage_keeps_a_copy_of_what_plumbing_holds():
    """plumbing holds each helper once: a stage (or evaluate.py, benchmark.py) that defined a name plumbing
    defines would be a second copy, free to drift from the first. What each defines is read from its module
    (test_docs.top_level_names): its own functions and classes, and its values not imported from plumbing."""
    held = set().union(*map(top_level_names, MODULES))
    assert {name for name in vars(plumbing) if not name.startswith("_")} >= held  # each as plumbing.NAME
    assert {"fail", "load_split", "claim_output_dir", "RECORD", "PositiveInt", "commit_checkpoint"} <= held, held
    copies = {script: sorted(top_level_names(importlib.import_module(script.removesuffix(".py"))) & held)
              for script in STAGES}
    assert not any(copies.values()), "defined both in plumbing and in: " + "; ".join(
        f"{script} ({', '.join(names)})" for script, names in copies.items() if names)


# Words of RLHF: plumbing is what a stage needs that is not the learning, so none of them belongs in it.
RLHF_WORDS = re.compile(r"(?<![a-z])(actor|critic|reward|reference|kl)(s|es)?(?![a-z])", re.IGNORECASE)
NOT_IMPORTED = {"rlhf_math", "sft", "reward_model", "ppo", "evaluate", "benchmark"}


def code_objects(module: types.ModuleType) -> list[types.CodeType]:
    """The compiled code of a module's own functions and of its classes' methods, and of the functions in them."""
    def nested(code):
        return [code] + [c for const in code.co_consts if isinstance(const, types.CodeType) for c in nested(const)]

    def functions_of(namespace):
        for value in list(vars(namespace).values()):
            value = getattr(value, "__func__", value)  # a staticmethod's or classmethod's function
            function = inspect.unwrap(value) if callable(value) else value
            if isinstance(function, types.FunctionType) and function.__module__ == module.__name__:
                yield function
            elif isinstance(value, type) and value.__module__ == module.__name__ and value is not namespace:
                yield from functions_of(value)

    return [code for function in functions_of(module) for code in nested(function.__code__)]


def test_plumbing_imports_no_stage_and_knows_nothing_of_rlhf():
    """plumbing imports no stage, nor evaluate.py, benchmark.py or rlhf_math.py: not when it is imported (in a
    process of its own, where no test imports them first; its last line lists the modules then loaded), and not
    later, from a function (what its import statements name, and any string that names one, as
    importlib.import_module("ppo") would take); and no identifier, comment or string in it says actor, critic,
    reward, reference or KL (as a word, or as a part of a snake_case or CamelCase name)."""
    loaded = set(subprocess.run([sys.executable, "-c", "import sys, plumbing; print(*sys.modules)"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.splitlines()[-1].split())
    assert {"torch", "deepspeed", "datasets"} <= loaded  # the list does hold what plumbing imports
    assert not loaded & NOT_IMPORTED, f"importing plumbing imports {sorted(loaded & NOT_IMPORTED)}"
    later = set()
    for code in [code for module in MODULES for code in code_objects(module)]:
        later |= {i.argval.split(".")[0] for i in dis.get_instructions(code) if i.opname == "IMPORT_NAME"}
        later |= {const for const in code.co_consts if isinstance(const, str)}
    assert {"wandb", "resource"} <= later, later  # the functions' own imports are seen
    assert not later & NOT_IMPORTED, f"plumbing's functions import or name {sorted(later & NOT_IMPORTED)}"
    found = [f"{path.name} line {number}: {match.group(0)!r} in {line.strip()!r}"
             for path in sorted((ROOT / "plumbing").glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             for match in RLHF_WORDS.finditer(re.sub(r"([a-z])([A-Z])", r"\1 \2", line))]
    assert not found, "plumbing speaks of RLHF:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------------------------
# Stopping with one line: fail, exact_div, check_ranges
# ---------------------------------------------------------------------------------------------------------------
def test_fail_names_the_running_script(monkeypatch):
    """Every message begins with the running script's file name, sys.argv[0]'s (a stage run in this process by
    run_in_process sets it; a direct call here sets it too)."""
    monkeypatch.setattr(sys, "argv", ["ppo.py", "--resume"])
    with pytest.raises(SystemExit) as stop:
        plumbing.fail("fix this")
    assert str(stop.value) == "ppo.py: error: fix this"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "sft.py")])  # run as python /path/to/sft.py: its file name only
    with pytest.raises(SystemExit) as stop:
        plumbing.exact_div(20, 8, "--total-episodes / (rollout batch x ranks)")
    assert str(stop.value) == "sft.py: error: --total-episodes / (rollout batch x ranks): 20 is not divisible by 8"
    assert plumbing.exact_div(24, 8, "x") == 3
    check_stops([(lambda: plumbing.exact_div(8, 0, "--num-mini-batches"), "8 is not divisible by 0")])


@dataclass
class Ranged:
    """Flags of every range check_ranges knows, at their bounds (all pass), plus an optional one and a plain float."""
    num_steps: plumbing.PositiveInt = 1
    warmup_steps: plumbing.CountInt = 0
    learning_rate: plumbing.PositiveFloat = 1e-9
    weight_decay: plumbing.NonNegativeFloat = 0.0
    keep: plumbing.Fraction = 1.0
    seed: plumbing.Seed = 2**32 - 1
    target: Annotated[float | None, "be positive"] = None
    scale: float = -3.0  # no range: any finite number
    name: str = "x"


def test_check_ranges_names_the_flag_and_its_rule(monkeypatch):
    """Each annotated rule stops a value outside it with "--flag must RULE, not VALUE"; None (an unset optional flag)
    passes; a float flag that is inf or nan stops as not finite, ranged or not (nan is outside every range: the
    finite check comes first, to say why)."""
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    assert {rule for hint in Ranged.__annotations__.values() for rule in getattr(hint, "__metadata__", ())} \
        == set(plumbing.RANGES)  # every rule is tried here
    plumbing.check_ranges(Ranged())
    plumbing.check_ranges(Ranged(keep=0.0, seed=0, target=1e-9, scale=0.0))
    check_stops([(lambda changes=changes: plumbing.check_ranges(Ranged(**changes)), f"sft.py: error: {message}")
                 for changes, message in [
        ({"num_steps": 0}, "--num-steps must be at least 1, not 0"),
        ({"warmup_steps": -1}, "--warmup-steps must not be negative, not -1"),
        ({"learning_rate": 0.0}, "--learning-rate must be positive, not 0.0"),
        ({"weight_decay": -0.5}, "--weight-decay must not be negative, not -0.5"),
        ({"keep": 1.5}, "--keep must be between 0 and 1, not 1.5"),
        ({"keep": -0.1}, "--keep must be between 0 and 1, not -0.1"),
        ({"seed": 2**32}, "--seed must be between 0 and 2**32 - 1, not 4294967296"),
        ({"seed": -1}, "--seed must be between 0 and 2**32 - 1, not -1"),
        ({"target": 0.0}, "--target must be positive, not 0.0"),
        ({"learning_rate": math.inf}, "--learning-rate must be a finite number, not inf"),
        ({"target": math.inf}, "--target must be a finite number, not inf"),
        ({"scale": math.nan}, "--scale must be a finite number, not nan"),
        ({"weight_decay": math.nan}, "--weight-decay must be a finite number, not nan"),  # not "must not be negative"
        ({"scale": -math.inf}, "--scale must be a finite number, not -inf"),
    ]])


# ---------------------------------------------------------------------------------------------------------------
# Data files and cells; prompts as token ids, from text, chat messages or whole conversations
# ---------------------------------------------------------------------------------------------------------------
def test_bad_data_files_stop_with_one_line(bad, tmp_path, capsys):
    """load_split: each wrong file, folder, column or split stops with a line that names it and the flag to check."""
    # One file is every split, and a slice of it works.
    assert len(plumbing.load_split(f"{TOY_DATA}/test.jsonl", "train[:64]", ["prompt"])) == 64
    check_stops([
        (lambda: plumbing.load_split(TOY_DATA, "train[:64]", ["prompt", "answer"]), "has no column ['answer']"),
        (lambda: plumbing.load_split(TOY_DATA, "train", ["promt"]),
         "has no column ['promt']; its columns are ['prompt', 'chosen', 'rejected', 'kind']"),
        (lambda: plumbing.load_split(str(bad / "nothing"), "train", ["prompt"]),
         f"no data set at '{bad}/nothing'; check --dataset"),
        (lambda: plumbing.load_split(str(bad / "data.csv"), "train", ["prompt"]),
         "data.csv' is not a .json, .jsonl or .parquet file"),
        (lambda: plumbing.load_split(str(bad / "broken.jsonl"), "train", ["prompt"]),
         "line 2 of '" + str(bad / "broken.jsonl") + "' is not valid JSON (Expecting ':' delimiter"),
        (lambda: plumbing.load_split(str(bad / "empty.jsonl"), "train", ["prompt"]), "empty.jsonl' is an empty file"),
        (lambda: plumbing.load_split(str(bad / "latin1.jsonl"), "train", ["prompt"]), "split 'train' is not UTF-8 text"),
        (lambda: plumbing.load_split(TOY_DATA, "dev", ["prompt"]),
         f"cannot load split 'dev' of data set '{TOY_DATA}' (Unknown split"),
        (lambda: plumbing.load_split(TOY_DATA, "validation", ["prompt"]),
         f"cannot load split 'validation' of data set '{TOY_DATA}' (Unknown split"),
        # Another flag, and other file kinds (ppo.py's --unsup-dataset, plain text)
        (lambda: plumbing.load_split(str(tmp_path / "missing.txt"), "train", ["text"], "--unsup-dataset",
                                     extensions=(".txt", ".json", ".jsonl", ".parquet")),
         "no data set at"),
        (lambda: plumbing.load_split(str(bad / "data.csv"), "train", ["text"], "--unsup-dataset",
                                     extensions=(".txt", ".json", ".jsonl", ".parquet")),
         "is not a .txt, .json, .jsonl or .parquet file"),
        # Each split as .jsonl and as .parquet: `datasets` would read the parquet files and leave the others out.
        (lambda: plumbing.load_split(str(bad / "two_formats"), "train", ["prompt"]),
         f"--dataset '{bad / 'two_formats'}' holds data files of 2 formats (test.jsonl, test.parquet): only one "
         "format would be read, the other files left out; keep the files of one format in the folder"),
        # A prompt data set given as plain text: the hint names the text flag, not the hh-rlhf layout.
        (lambda: plumbing.load_text_blocks(AutoTokenizer.from_pretrained(BASE_MODEL), TOY_DATA, None, "text",
                                           8, 1),
         "has no column ['text']; its columns are ['prompt', 'chosen', 'rejected', 'kind']; --unsup-dataset is plain "
         "text to learn from: a .txt file, or a data set whose column of text --unsup-text-column names"),
    ])
    assert len(plumbing.load_split(str(bad / "one_format"), "test", ["prompt"])) == 1  # .json and .jsonl: one loader
    # A split of several files (shards, or an old copy in a subfolder): all are read, and said.
    shutil.copytree(bad / "one_format", tmp_path / "nested")
    shutil.copytree(bad / "one_format", tmp_path / "nested" / "old")
    capsys.readouterr()
    assert len(plumbing.load_split(str(tmp_path / "nested"), "test[:5]", ["prompt"])) == 2
    assert f"split 'test[:5]' of --dataset '{tmp_path / 'nested'}' is read from 2 files: old/test.jsonl, test.jsonl" \
        in capsys.readouterr().out
    check_stops([(lambda: plumbing.load_split(str(bad / "twice"), "train", ["prompt"]),
                  f"--dataset '{bad / 'twice'}' holds train.json and train.jsonl: the same data twice, and both would "
                  "be read; keep one of them")])


def dropping_tokenizer():
    """The toy tokenizer with a normalizer that drops every character outside ASCII: a text of such characters is no
    token at all."""
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    tokenizer.backend_tokenizer.normalizer = tokenizers.normalizers.Replace(tokenizers.Regex("[^\\x00-\\x7f]"), "")
    return tokenizer


def test_data_cells_that_are_not_text_are_named_by_row_and_column():
    assert plumbing.text_of({"prompt": "fine"}, 0, "prompt", "train") == "fine"
    dropping = dropping_tokenizer()
    assert plumbing.prompt_ids(dropping, {"prompt": "Ω fine"}, 0, "prompt", "train") == dropping(" fine").input_ids
    assert plumbing.response_ids(dropping, "Ω fine", "row 0") == dropping(" fine").input_ids + [dropping.eos_token_id]
    check_stops([
        (lambda: plumbing.prompt_ids(dropping, {"prompt": "ΩΩé"}, 5, "prompt", "train"),
         "row 5 of split 'train', column 'prompt': the prompt 'ΩΩé' is no token at all in this tokenizer (its "
         "normalizer drops the text); fix or remove the row, or use a tokenizer that reads it"),
        (lambda: plumbing.text_of({"prompt": None}, 3, "prompt", "train"),
         "row 3 of split 'train', column 'prompt': empty (null); fix or remove the row"),
        (lambda: plumbing.text_of({"prompt": [{"role": "user", "content": "hi"}]}, 4, "prompt", "train"),
         "row 4 of split 'train', column 'prompt': a value of type list, not text"),
        (lambda: plumbing.text_of({"chosen": 5}, 0, "chosen", "test"),
         "row 0 of split 'test', column 'chosen': a value of type int, not text"),
    ])


# A template of plain words, so that the toy model can train on its output: each message on its own line, then the
# opening of the assistant's turn.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "You review films."}, {"role": "user", "content": "The story"}]
HH_ROW = {"chosen": "\n\nHuman: Was it good?\n\nAssistant: Yes.\n\nHuman: And the cast?\n\nAssistant: the cast was superb.",
          "rejected": "\n\nHuman: Was it good?\n\nAssistant: Yes.\n\nHuman: And the cast?\n\nAssistant: the cast was bad."}
HH_PROMPT = "\n\nHuman: Was it good?\n\nAssistant: Yes.\n\nHuman: And the cast?\n\nAssistant:"


@pytest.fixture
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL, padding_side="left")
    tokenizer.chat_template = PLAIN_TEMPLATE
    return tokenizer


def ids(tokenizer, text, special=True):
    return tokenizer(text, add_special_tokens=special, split_special_tokens=True)["input_ids"]


def test_chat_prompts_go_through_the_chat_template(tokenizer, tmp_path, capsys):
    """load_prompts (ppo.py's and evaluate.py's prompts): a list of messages becomes the template's text, up to the
    opening of the assistant's turn, tokenized without a second BOS; a text prompt keeps its own path. A prompt
    longer than --max-prompt-len is dropped and counted, never truncated."""
    templated = ids(tokenizer, "system: You review films.\nuser: The story\nassistant:", special=False)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": MESSAGES, "chosen": " was good.", "rejected": " was dull."},
                                                 {"prompt": "A text prompt", "chosen": "", "rejected": ""}])
    assert plumbing.load_prompts(tokenizer, path, "train", "prompt", 64, False) == [templated,
                                                                                    ids(tokenizer, "A text prompt")]
    shorter = len(templated) - 1
    assert plumbing.load_prompts(tokenizer, path, "train", "prompt", shorter, True) == [ids(tokenizer, "A text prompt")]
    assert f"dropped 1 of 2 prompts longer than --max-prompt-len {shorter}" in capsys.readouterr().out


def test_chat_markers_are_real_tokens_and_messages_cannot_spell_them(tokenizer):
    """A template's markers (added tokens) become their own ids; a message whose content spells one is refused, as
    it would fake a turn. A tokenizer without a template, and a cell that is not a list of messages, are refused."""
    marked = AutoTokenizer.from_pretrained(BASE_MODEL)
    marked.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    marked.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    start, end = marked.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt = plumbing.prompt_ids(marked, {"prompt": MESSAGES}, 0, "prompt", "train")
    assert prompt.count(start) == 3 and prompt.count(end) == 2 and prompt[0] == start
    no_template = AutoTokenizer.from_pretrained(BASE_MODEL)
    check_stops([
        (lambda: plumbing.prompt_ids(marked, {"prompt": [{"role": "user", "content": "it was<|im_end|>"}]}, 4, "prompt",
                                     "train"), "row 4 of split 'train', column 'prompt': a message spells the token "
                                               "'<|im_end|>'"),
        (lambda: plumbing.prompt_ids(no_template, {"prompt": MESSAGES}, 2, "prompt", "test"),
         "row 2 of split 'test', column 'prompt' holds chat messages, but the tokenizer has no chat template"),
        (lambda: plumbing.prompt_ids(tokenizer, {"prompt": [{"role": "user"}]}, 1, "prompt", "train"),
         "row 1 of split 'train', column 'prompt': a list of dict, neither text nor chat messages ({'role': ..., "
         "'content': ...} with text content); fix or remove the row"),
        (lambda: plumbing.prompt_ids(tokenizer, {"prompt": []}, 0, "prompt", "train"), "a list of nothing, neither"),
        # A list of strings is named as what it is, with or without a chat template (not "chat messages").
        (lambda: plumbing.prompt_ids(no_template, {"prompt": ["The story", 3]}, 0, "prompt", "train"),
         "a list of int and str, neither text nor chat messages"),
    ])


def test_the_hh_rlhf_layout_is_cut_at_its_last_marker_and_named_without_the_flag(tokenizer, tmp_path):
    """A whole conversation's prompt is its text up to and including its last "\\n\\nAssistant:" (load_prompts with
    the marker, as ppo.py and evaluate.py read it under --split-conversations); without the flag, data in that layout
    stops with a message that names the flag; a conversation that does not split is refused."""
    write_jsonl(tmp_path / "hh.jsonl", [HH_ROW])
    assert plumbing.load_prompts(tokenizer, str(tmp_path / "hh.jsonl"), "train", "chosen", 64, False,
                                 "\n\nAssistant:") == [ids(tokenizer, HH_PROMPT)]
    assert plumbing.split_conversation(HH_ROW["chosen"], "\n\nAssistant:", "row 0") == (HH_PROMPT,
                                                                                        " the cast was superb.")
    check_stops([
        (lambda: plumbing.load_split(str(tmp_path / "hh.jsonl"), "train", ["prompt"]),
         "has no column ['prompt']; its columns are ['chosen', 'rejected']; if 'chosen' and 'rejected' each hold the "
         "whole conversation (the hh-rlhf layout), pass --split-conversations (ppo.py and evaluate.py also "
         "--prompt-column chosen)"),
        (lambda: plumbing.split_conversation("\n\nHuman: hi\n\nAssistant: ", "\n\nAssistant:", "row 3"),
         "row 3: nothing after the last '\\n\\nAssistant:'"),
        (lambda: plumbing.split_conversation("Human: hi. Bot: hello.", "\n\nAssistant:", "row 0"),
         "row 0: no '\\n\\nAssistant:' to split the conversation at; check --assistant-marker"),
    ])


# ---------------------------------------------------------------------------------------------------------------
# Model folders, tokenizers, weights
# ---------------------------------------------------------------------------------------------------------------
def test_bad_model_folders_and_tokenizers_stop_with_one_line(bad, tmp_path):
    """check_model_folder and load_tokenizer: a line that names the folder, what is wrong, and the caller's hint."""
    check_stops([
        (lambda: plumbing.check_model_folder(str(bad / "nothing"), "check --model-name-or-path"), "no model folder at"),
        (lambda: plumbing.check_model_folder(str(tmp_path / "missing"), "check --reward-model-name-or-path"),
         "no model folder at"),
        (lambda: plumbing.check_model_folder(str(bad / "empty_folder"), "check --model-name-or-path"),
         "empty_folder' holds no model (no config.json)"),
        (lambda: plumbing.check_model_folder(str(bad / "empty_folder"),
                                             "run sft.py first or check --actor-model-name-or-path"),
         "holds no model (no config.json); run sft.py first or check --actor-model-name-or-path"),
        (lambda: plumbing.check_model_folder(str(bad / "no_weights"), "check --model-name-or-path"),
         "no_weights' has no model weights (model.safetensors)"),
        (lambda: plumbing.check_model_folder(str(bad / "pickle_only"), "check --reward-model-name-or-path"),
         "has no model.safetensors; only safetensors weights are loaded (no pickle)"),
        (lambda: plumbing.load_tokenizer(str(bad / "empty_folder"), "check --tokenizer-name-or-path", False),
         "cannot load a tokenizer from"),
    ])


def test_damaged_misnamed_or_mistyped_weights_are_refused(bad, tmp_path):
    # A reward model whose score head was saved under another name would load with a random head.
    renamed = tmp_path / "renamed_head"
    AutoModelForSequenceClassification.from_pretrained(BASE_MODEL, num_labels=1).save_pretrained(renamed)
    weights = load_file(renamed / "model.safetensors")
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, renamed / "model.safetensors", metadata={"format": "pt"})
    truncated = tmp_path / "truncated"
    shutil.copytree(BASE_MODEL, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    nan_model = AutoModelForCausalLM.from_pretrained(bad / "nan_weights")
    check_stops([
        (lambda: plumbing.load_pretrained(AutoModelForSequenceClassification, str(renamed), "check --reward"),
         "weights missing from it ['score.weight'], weights in it that the model does not use ['value_head.weight']"),
        (lambda: plumbing.load_pretrained(AutoModelForCausalLM, str(truncated), "check --model"),
         f"cannot load the model in '{truncated}'"),
        (lambda: plumbing.check_finite_weights(nan_model, "model 'x'"),
         "the model 'x' has weights that are not finite (inf or nan) in 1 tensors"),
        # A mistyped local path is reported missing, not looked up on the hub.
        (lambda: plumbing.check_model_folder("chekpoints/sft", "check --model-name-or-path"),
         "no model folder at 'chekpoints/sft'"),
    ])
    assert plumbing.is_hub_name("gpt2") and plumbing.is_hub_name("EleutherAI/pythia-410m")
    assert not any(plumbing.is_hub_name(path) for path in ["chekpoints/sft", "checkpoints/sft", "./model", "toy_task/x"])


# ---------------------------------------------------------------------------------------------------------------
# Output folders: never destroyed, one run each; ranks
# ---------------------------------------------------------------------------------------------------------------
def test_an_output_folder_is_never_destroyed(tmp_path, monkeypatch):
    """claim_output_dir and save_model_folder, as sft.py and then reward_model.py (the running script owns what it
    writes)."""
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    check_stops([
        (lambda: plumbing.claim_output_dir(str(ROOT), {"--dataset": TOY_DATA}, True),
         f"--output-dir '{ROOT}' is or holds --dataset '{TOY_DATA}', which this run reads"),
        (lambda: plumbing.claim_output_dir(BASE_MODEL, {"--model-name-or-path": BASE_MODEL}, True),
         "is or holds --model-name-or-path"),
        (lambda: plumbing.claim_output_dir(str(notes), {}, False),
         "is not empty and holds no earlier output of sft.py; name a new or empty folder, or pass --overwrite"),
        (lambda: plumbing.claim_output_dir("/proc/x", {}, False), "cannot write to --output-dir '/proc/x'"),
        (lambda: plumbing.claim_output_dir(str(notes / "notes.txt"), {}, True), "notes.txt' is a file; name a folder"),
    ])
    assert os.listdir(notes) == ["notes.txt"] and (notes / "notes.txt").read_text() == "mine"
    # With --overwrite the model is written beside the user's files, whatever their names: even weights files of
    # another layout stay (from_pretrained reads model.safetensors first, which is ours).
    user_files = {"model_backup.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"}
    for name in user_files:
        (notes / name).write_text("the user's")
    plumbing.claim_output_dir(str(notes), {}, True)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(BASE_MODEL), AutoTokenizer.from_pretrained(BASE_MODEL)
    plumbing.save_model_folder(model, tokenizer, str(notes), {"script": "sft.py", "finished": True})
    assert (notes / "notes.txt").read_text() == "mine"
    assert all((notes / name).read_text() == "the user's" for name in user_files)
    assert not (notes / ".saving").exists() and plumbing.read_record(str(notes))["finished"]
    assert torch.equal(AutoModelForCausalLM.from_pretrained(notes).lm_head.weight, model.lm_head.weight)
    # The next save removes only what an earlier save wrote (its record lists its files) and this one does not.
    record = plumbing.read_record(str(notes))
    assert "model.safetensors" in record["files"] and not user_files & set(record["files"])
    (notes / "model-00002-of-00002.safetensors").write_text("an earlier save's shard")
    plumbing.write_json(str(notes / plumbing.RECORD), {**record, "files": [*record["files"],
                                                                            "model-00002-of-00002.safetensors"]})
    plumbing.save_model_folder(model, tokenizer, str(notes), {"script": "sft.py", "finished": True})
    assert not (notes / "model-00002-of-00002.safetensors").exists()
    assert all((notes / name).read_text() == "the user's" for name in user_files)
    # One run per folder: while the lock's holder (this process) lives, another run is refused; the folder now holds
    # an output of sft.py, which reward_model.py does not replace.
    check_stops([(lambda: plumbing.claim_output_dir(str(notes), {}, False),
                  f"is in use by another run (pid {os.getpid()} on {socket.gethostname()})")])
    monkeypatch.setattr(sys, "argv", ["reward_model.py"])
    check_stops([(lambda: plumbing.claim_output_dir(str(notes), {}, False),
                  "holds no earlier output of reward_model.py")])
    # A lock left by a run that was killed is taken over.
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    (notes / ".lock").write_text(f"{socket.gethostname()} {gone.pid}")
    plumbing.claim_output_dir(str(notes), {}, False)
    assert (notes / ".lock").read_text() == f"{socket.gethostname()} {os.getpid()}"
    # Taken over in a folder that holds no record: the claim still writes this script's record.
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / ".lock").write_text(f"{socket.gethostname()} {gone.pid}")
    plumbing.claim_output_dir(str(tmp_path / "killed"), {}, True)
    assert plumbing.read_record(str(tmp_path / "killed")) == {"script": "sft.py", "finished": False}


@contextlib.contextmanager
def full_disk(megabytes=1):
    """Writes past MEGABYTES in one file fail as on a full disk (EFBIG: Python ignores SIGXFSZ), as `ulimit -f` does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (megabytes * 2**20, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_save_on_a_full_disk_keeps_the_earlier_model(tmp_path, monkeypatch):
    """save_model_folder on a full disk: one line that says how much was written, the partial copy removed, and the
    folder's earlier model whole."""
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    model, tokenizer = AutoModelForCausalLM.from_pretrained(BASE_MODEL), AutoTokenizer.from_pretrained(BASE_MODEL)
    plumbing.save_model_folder(model, tokenizer, str(tmp_path / "sft"), {"script": "sft.py", "finished": True})
    before = {name: (tmp_path / "sft" / name).read_bytes() for name in os.listdir(tmp_path / "sft")}
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with full_disk():
        check_stops([(lambda: plumbing.save_model_folder(model, tokenizer, str(tmp_path / "sft"), {"script": "sft.py"}),
                      f"cannot write the model to '{tmp_path / 'sft'}' (Error while serializing: I/O error: File too "
                      "large (os error 27)); the 0.0 MB of it written are removed again, and "
                      f"'{tmp_path / 'sft'}' keeps what it held. Free some space and run again")])
    assert {name: (tmp_path / "sft" / name).read_bytes() for name in os.listdir(tmp_path / "sft")} == before
    with full_disk(0):  # a record, a summary: one line too, and no temporary file left
        check_stops([(lambda: plumbing.write_json(str(tmp_path / "run.json"), {"finished": True}),
                      f"cannot write '{tmp_path / 'run.json'}' (File too large); free some space and run again")])
    assert not list(tmp_path.glob("run.json*"))


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    """Nodes share the output folder's filesystem, and a lock's pid means something only on the host that wrote it:
    a lock of another host stops the run even where no process of that pid lives."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text(f"node-7 {gone.pid}")
    check_stops([(lambda: plumbing.claim_output_dir(str(out), {}, True),
                  f"is in use by another run (pid {gone.pid} on node-7)")])
    assert (out / ".lock").read_text() == f"node-7 {gone.pid}"


# ---------------------------------------------------------------------------------------------------------------
# What a run reads back from an output folder is untrusted: a name in it is used only if it is one a run writes there
# ---------------------------------------------------------------------------------------------------------------
def test_a_records_file_list_removes_only_files_that_a_save_writes(tmp_path, monkeypatch, capsys):
    """save_model_folder removes what the folder's record lists and this save does not write, but only names of the
    files a save writes, regular files in the folder: never a path out of it, the folder itself, a file of another
    kind, or a link (a folder received from someone else holds any record)."""
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    model, tokenizer = AutoModelForCausalLM.from_pretrained(BASE_MODEL), AutoTokenizer.from_pretrained(BASE_MODEL)
    out = tmp_path / "received"
    plumbing.save_model_folder(model, tokenizer, str(out), {"script": "sft.py", "finished": True})
    assert all(plumbing.SAVED_FILE.fullmatch(name) for name in plumbing.read_record(str(out))["files"])
    outside, linked = tmp_path / "README.md", tmp_path / "weights_elsewhere.safetensors"
    climbed, absolute = tmp_path / "x" / "model.safetensors", tmp_path / "y" / "config.json"  # names a save writes
    for path in [outside, linked, out / "notes.txt", climbed, absolute]:
        path.parent.mkdir(exist_ok=True)
        path.write_text("the user's")
    os.symlink(linked, out / "model-00002-of-00002.safetensors")
    (out / "model-00003-of-00003.safetensors").write_text("an earlier save's shard")
    listed = ["../README.md", str(outside), "..", ".", "notes.txt", "model-00002-of-00002.safetensors", 7,
              "model-00003-of-00003.safetensors", "../x/model.safetensors", str(absolute)]
    record = plumbing.read_record(str(out))
    plumbing.write_json(str(out / plumbing.RECORD), {**record, "files": record["files"] + listed})
    plumbing.save_model_folder(model, tokenizer, str(out), {"script": "sft.py", "finished": True})
    assert all(path.read_text() == "the user's" for path in [outside, linked, out / "notes.txt", climbed, absolute])
    assert os.path.islink(out / "model-00002-of-00002.safetensors")
    assert not (out / "model-00003-of-00003.safetensors").exists()  # an earlier save's, as its record says
    assert f"{out / plumbing.RECORD} lists 9 names that are no files of a save there ('../README.md', " \
           f"'{outside}', '..'): left alone" in capsys.readouterr().out
    plumbing.write_json(str(out / plumbing.RECORD), {**record, "files": "model.safetensors"})  # not even a list
    plumbing.save_model_folder(model, tokenizer, str(out), {"script": "sft.py", "finished": True})
    assert torch.equal(AutoModelForCausalLM.from_pretrained(out).lm_head.weight, model.lm_head.weight)


def test_a_run_never_writes_through_a_link_in_its_output_folder(tmp_path, monkeypatch):
    """A link where a run writes (the staging folder .saving, a folder the run writes and what is in it, a record's
    temporary file) stops the run with one line before it writes, and what the link points to stays as it was; a
    folder the run writes is checked against its inputs, as the output folder is. A record that is a link is none."""
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    model, tokenizer = AutoModelForCausalLM.from_pretrained(BASE_MODEL), AutoTokenizer.from_pretrained(BASE_MODEL)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    plumbing.save_model_folder(model, tokenizer, str(out), {"script": "sft.py", "finished": True})
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("the user's")
    os.symlink(elsewhere, out / ".saving")
    link_line = f"'{out / '.saving'}' is a link (to '{elsewhere}') inside --output-dir: the run writes there and " \
                "never through a link; remove the link, or name another --output-dir"
    check_stops([(lambda: plumbing.claim_output_dir(str(out), {}, False), link_line),
                 (lambda: plumbing.save_model_folder(model, tokenizer, str(out), {"script": "sft.py"}), link_line)])
    os.remove(out / ".saving")
    (out / "snapshots").mkdir()
    os.symlink(elsewhere, out / "snapshots" / "iteration_1")
    os.symlink(os.path.abspath(BASE_MODEL), out / "model")
    check_stops([
        (lambda: plumbing.claim_output_dir(str(out), {}, False, ["snapshots"]),
         f"'{out / 'snapshots' / 'iteration_1'}' is a link (to '{elsewhere}') inside --output-dir"),
        (lambda: plumbing.claim_output_dir(str(out), {"--model-name-or-path": BASE_MODEL}, False, ["model"]),
         f"--output-dir '{out / 'model'}' is or holds --model-name-or-path '{BASE_MODEL}', which this run reads"),
    ])
    assert os.listdir(elsewhere) == ["keep.txt"]
    assert os.listdir(BASE_MODEL) == os.listdir(out / "model") and plumbing.read_record(str(out))["finished"]
    os.remove(out / "model")
    os.remove(out / "snapshots" / "iteration_1")
    # A record is written in a new file of a fresh name, then renamed into place: never through an entry there,
    # a link or a hard link named as a temporary file (the user's file it points to stays as it was).
    victim, other = tmp_path / "victim.txt", tmp_path / "other.txt"
    victim.write_text("the user's")
    other.write_text("the user's too")
    os.link(victim, out / (plumbing.RECORD + ".tmp"))
    plumbing.write_json(str(out / plumbing.RECORD), {"script": "sft.py", "finished": True})
    assert victim.read_text() == "the user's" and os.path.samefile(victim, out / (plumbing.RECORD + ".tmp"))
    os.remove(out / plumbing.RECORD)
    os.link(other, out / plumbing.RECORD)  # the record itself a hard link: replaced, the user's file kept
    plumbing.write_json(str(out / plumbing.RECORD), {"script": "sft.py", "finished": True})
    assert other.read_text() == "the user's too" and plumbing.read_record(str(out))["finished"]
    # An entry that no run leaves there stops a run before anything loads, with one line that names it: a .tmp that
    # is neither a file nor a folder (here a link), a plain file .saving (where a save stages its folder), a .lock
    # that is no run's lock (a folder, or a hard link to the user's file, whatever it holds).
    os.remove(out / (plumbing.RECORD + ".tmp"))
    os.symlink(victim, out / (plumbing.RECORD + ".tmp"))
    check_stops([(lambda: plumbing.claim_output_dir(str(out), {}, False),
                  f"'{out / (plumbing.RECORD + '.tmp')}' is a link (to '{victim}') inside --output-dir")])
    os.remove(out / (plumbing.RECORD + ".tmp"))
    (out / ".saving").write_text("the user's")
    check_stops([(lambda: plumbing.claim_output_dir(str(out), {}, False),
                  f"'{out / '.saving'}' is not what a run leaves in --output-dir (a save's staging folder): move it "
                  "away, or name another --output-dir")])
    assert (out / ".saving").read_text() == "the user's"
    os.remove(out / ".saving")
    (victim).write_text(f"{socket.gethostname()} {os.getpid() + 10**7}")  # reads as a killed run's lock
    for make, remove in [(os.mkdir, os.rmdir), (lambda lock: os.link(victim, lock), os.remove)]:
        make(out / ".lock")
        check_stops([(lambda: plumbing.claim_output_dir(str(out), {}, False),
                      f"'{out / '.lock'}' is not the lock file of a run (a host and a pid, in a file of its own); "
                      "remove it")])
        remove(out / ".lock")
    assert victim.read_text() == f"{socket.gethostname()} {os.getpid() + 10**7}"
    os.remove(out / plumbing.RECORD)
    os.symlink(out / "tokenizer.json", out / plumbing.RECORD)  # a dict, but a link
    assert plumbing.read_record(str(out)) is None


def test_a_record_of_another_kind_is_no_record(tmp_path, monkeypatch):
    """A training_run.json that does not read as this project's, whatever it holds (a field of another type, such as
    "finished": "no", or JSON nested past Python's recursion limit), is no record: its folder holds no earlier output
    of a stage, and is refused as any other non-empty folder is, with the usual line."""
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    out = tmp_path / "out"
    out.mkdir()
    for text in ['{"script": "sft.py", "finished": "no"}', '{"script": "sft.py", "files": "model.safetensors"}',
                 "[" * 100_000 + "]" * 100_000]:
        (out / plumbing.RECORD).write_text(text)
        assert plumbing.read_record(str(out)) is None
        check_stops([(lambda: plumbing.claim_output_dir(str(out), {}, False), f"--output-dir '{out}' is not empty and "
                      "holds no earlier output of sft.py; name a new or empty folder, or pass --overwrite")])
    (out / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    assert plumbing.read_state(str(out)) is None  # a checkpoint's state.json alike
    (out / plumbing.RECORD).write_text('{"script": "sft.py", "finished": false, "files": []}')
    assert plumbing.read_record(str(out)) == {"script": "sft.py", "finished": False, "files": []}


def test_a_model_is_known_by_its_weights_config_and_tokenizer(tmp_path):
    """folder_identity reads the whole of every file that makes the model and its tokenizer: a byte changed anywhere in
    them gives another identity; the record and the generation config (which ppo.py replaces) do not count."""
    folder = tmp_path / "model"
    shutil.copytree(BASE_MODEL, folder)
    identity = plumbing.folder_identity(str(folder))
    for name in ["generation_config.json", plumbing.RECORD]:
        (folder / name).write_text('{"changed": true}')
    assert plumbing.folder_identity(str(folder)) == identity
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        content = (folder / name).read_bytes()
        middle = len(content) // 2
        (folder / name).write_bytes(content[:middle] + bytes([content[middle] ^ 1]) + content[middle + 1:])
        assert plumbing.folder_identity(str(folder)) != identity, name
        (folder / name).write_bytes(content)
    assert plumbing.folder_identity(str(folder)) == identity


def test_checkpoints_and_snapshots_of_the_users_are_never_removed(tmp_path):
    """commit_checkpoint removes only the run's older checkpoints and iteration_N.tmp folders cut short, and
    remove_earlier_runs only iteration_N folders of another run: never a copy of the user's (iteration_1_good), a
    link, or a folder of the user's named as a checkpoint without a state.json (iteration_8), which counts for
    nothing: the run's two newest checkpoints stay beside it, and it is never written over."""
    resume, elsewhere = tmp_path / "resume", tmp_path / "elsewhere"
    plumbing.commit_checkpoint(write_checkpoint(resume, 1), RUN)
    shutil.copytree(resume / "iteration_1", resume / "iteration_1_good")
    elsewhere.mkdir()
    (elsewhere / "state.json").write_text("{}")
    os.symlink(elsewhere, resume / "iteration_9")
    for iteration in (2, 3, 4):
        plumbing.commit_checkpoint(write_checkpoint(resume, iteration), RUN)
    assert sorted(os.listdir(resume)) == ["iteration_1_good", "iteration_3", "iteration_4", "iteration_9", "latest"]
    assert plumbing.complete_checkpoints(str(resume)) == [str(resume / "iteration_4"), str(resume / "iteration_3")]
    (resume / "iteration_8").mkdir()
    (resume / "iteration_8" / "notes.txt").write_text("the user's")
    plumbing.commit_checkpoint(write_checkpoint(resume, 5), RUN)
    assert sorted(os.listdir(resume)) == ["iteration_1_good", "iteration_4", "iteration_5", "iteration_8", "iteration_9",
                                          "latest"]
    write_checkpoint(resume, 8)
    check_stops([(lambda: plumbing.commit_checkpoint(str(resume / "iteration_8"), RUN),
                  f"'{resume / 'iteration_8'}' is in the way of this run's checkpoint, and no run wrote it (no "
                  "state.json): move it away")])
    shutil.rmtree(resume / "iteration_8.tmp")
    plumbing.remove_earlier_runs(str(resume), "this_run__1__1", plumbing.read_state)  # all of RUN, another run
    assert sorted(os.listdir(resume)) == ["iteration_1_good", "iteration_8", "iteration_9", "latest"]
    assert os.listdir(elsewhere) == ["state.json"] and (resume / "iteration_8" / "notes.txt").read_text() == "the user's"


def test_a_checkpoint_of_other_shapes_is_no_checkpoint_of_the_model(tmp_path):
    """engine_state_problem reads every tensor's name and shape: a checkpoint written for another model of the same
    parameter names (another width) would stop --resume with a traceback from inside torch's copy."""
    engine = types.SimpleNamespace(module=torch.nn.Linear(2, 3))
    weights = {"weight": torch.zeros(3, 2), "bias": torch.zeros(3)}
    save_file(weights, tmp_path / "model.safetensors")
    save_file({f"{name}.{moment}": w.clone() for name, w in weights.items() for moment in ("exp_avg", "exp_avg_sq")},
              tmp_path / "adam.safetensors")
    assert plumbing.engine_state_problem(str(tmp_path), engine, trained=True) is None
    save_file({**weights, "weight": torch.zeros(2, 3)}, tmp_path / "model.safetensors")
    assert plumbing.engine_state_problem(str(tmp_path), engine, trained=True) == \
        f"{tmp_path.name}/model.safetensors does not hold this model's parameters (their names and shapes)"


def test_run_names_are_unique_even_in_the_same_second(tmp_path, monkeypatch, capsys):
    """Two runs started in the same second under one name and seed get runs/ folders of their own, the second said;
    an --exp-name that is a path is refused."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    monkeypatch.setattr(plumbing.time, "time", lambda: 1700000000.5)
    assert plumbing.new_run_name("sft", 1) == "sft__1__1700000000"
    assert plumbing.new_run_name("sft", 1) == "sft__1__1700000000_2"
    assert "runs/sft__1__1700000000 is another run's (started in the same second): this run logs to " \
           "runs/sft__1__1700000000_2" in capsys.readouterr().out
    assert sorted(os.listdir("runs")) == ["sft__1__1700000000", "sft__1__1700000000_2"]
    assert all(plumbing.RUN_NAME.fullmatch(name) for name in os.listdir("runs"))
    check_stops([(lambda: plumbing.new_run_name("../elsewhere", 1),
                  "--exp-name '../elsewhere' must be a plain name (no '/'): it names the run's folder in runs/")])
    shutil.rmtree("runs")
    open("runs", "w").close()  # a file where the runs' folder goes
    check_stops([(lambda: plumbing.new_run_name("sft", 1),
                  "cannot make runs/sft__1__1700000000 for the run's logs (Not a directory); run from a folder you can "
                  "write, where runs is no file")])


def test_on_rank_0_follows_the_jobs_rank_0_not_each_nodes(monkeypatch):
    """On node 1 (RANK=1, LOCAL_RANK=0) on_rank_0 must not run its function (claim_output_dir, start_run) but take
    rank 0's result. The two-node runs of test_launchers cannot show it: rank 0's broadcast overwrites what node 1
    did, and node 1's claim of the output folder fails (or wins) only when the two race for its lock. On rank 0 the
    function runs, and a stop there stops every rank with its message."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src: objects.__setitem__(0, "rank 0's"))
    assert plumbing.on_rank_0(lambda: pytest.fail("ran on node 1")) == "rank 0's"
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src: None)
    assert plumbing.on_rank_0(lambda: "mine") == "mine"
    check_stops([(lambda: plumbing.on_rank_0(lambda: plumbing.fail("the folder is in use")), "the folder is in use")])


def test_a_lost_rank_ends_the_surviving_rank_with_one_line(monkeypatch, capsys):
    """The excepthook init_distributed sets on several ranks: gloo's error for a peer that went away (as a 2-rank
    ppo.py printed it when rank 1 was killed), and NCCL's on a GPU (as torch 2.x words it: a DistBackendError of
    several lines, the source file first), becomes one line; any other error keeps its stack trace."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    lost = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:2237. This is typically caused by a remote worker crashing. Check the logs")
    nccl_lost = dist.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3763, remote process exited or there "
        "was a network error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network error or a "
        "remote process exiting prematurely.\nLast error:\nsocketProgress: Connection closed by remote peer")
    nccl_aborted = dist.DistBackendError("[Rank 1] NCCL communicator was aborted on rank 1.")
    for error, reason in [(lost, "Connection closed by peer [127.0.0.1]:2237"),
                          (nccl_lost, "remote process exited or there was a network error, NCCL version 2.27.5"),
                          (nccl_aborted, "NCCL communicator was aborted on rank 1.")]:
        plumbing.one_line_for_a_lost_rank([], type(error), error, None)
        assert capsys.readouterr().err == (f"ppo.py: error: rank 0 lost its connection to another rank of this run "
                                           f"({reason}): that rank stopped, or the launcher did; their output says "
                                           "why\n")
    try:
        raise RuntimeError("a bug")
    except RuntimeError as error:
        plumbing.one_line_for_a_lost_rank([], RuntimeError, error, error.__traceback__)
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_new_threads_take_one_openmp_thread():
    """one_openmp_thread_for_new_threads, which relies on how torch gives each thread its OpenMP count: after it, a
    thread started later (as gloo's, which run the collectives) works on one OpenMP thread, and the calling thread
    keeps its count."""
    counts = []
    main_count = torch.get_num_threads()
    plumbing.one_openmp_thread_for_new_threads()
    thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert counts == [1] and torch.get_num_threads() == main_count


@pytest.mark.parametrize("device, zero3", [("cpu", True), ("cpu", False), ("cuda", True)])
def test_init_distributed_sets_up_each_device_as_it_should(device, zero3, monkeypatch):
    """init_distributed on a CPU: plain gloo, DeepSpeed's shared-memory all-reduce marked not compatible before the
    process group starts, so that no rank compiles it (a build waits in silence forever on the lock a killed build
    leaves; conftest.py plants one for the whole suite); one OpenMP thread for the threads started later (gloo's)
    where a model is under ZeRO-3, whose collectives copy tensors on those threads, elsewhere torch's default (3%
    faster at ZeRO-0 and ZeRO-2 on one rank). On a GPU the process group is DeepSpeed's own: the backend its
    accelerator names (NCCL), its ops untouched. The process group and the process-wide settings are stubbed: only
    the calls count."""
    calls, compatible = [], {"deepspeed_shm_comm": True}
    for name in ["one_openmp_thread_for_new_threads", "keep_freed_memory", "stop_on_signals"]:
        monkeypatch.setattr(plumbing.processes, name, lambda name=name: calls.append(name))
    monkeypatch.setattr(plumbing.processes.deepspeed.ops, "__compatible_ops__", compatible)
    monkeypatch.setattr(plumbing.processes.deepspeed, "init_distributed", lambda dist_backend, **kwargs: calls.append(
        ("process group", dist_backend, dict(compatible))))
    monkeypatch.setattr(plumbing.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(plumbing.atexit, "register", lambda function: None)
    if device == "cuda":
        accelerator = types.SimpleNamespace(device_name=lambda index=None: "cuda" if index is None else f"cuda:{index}",
                                            communication_backend_name=lambda: "nccl", set_device=lambda index: None)
        monkeypatch.setattr(plumbing.processes, "get_accelerator", lambda: accelerator)
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=plumbing.free_port()).items():
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(dtype="fp32")
    assert plumbing.init_distributed(args, zero3=zero3) == torch.device("cuda:0" if device == "cuda" else "cpu")
    if device == "cuda":
        assert calls == [("process group", "nccl", {"deepspeed_shm_comm": True}), "stop_on_signals"]
    else:
        openmp = ["one_openmp_thread_for_new_threads"] if zero3 else []
        assert calls == ["keep_freed_memory", *openmp, ("process group", "gloo", {"deepspeed_shm_comm": False}),
                         "stop_on_signals"]


def in_a_bare_process(function) -> tuple[str, str]:
    """One of plumbing's functions that need only the standard library, for a process of its own that has imported
    neither plumbing nor torch: (Python lines that define it there, from its compiled code, and that code, the
    process's last command-line argument). The lines before them import sys and what the function uses."""
    return (f"import marshal, types\n{function.__name__} = types.FunctionType(marshal.loads(bytes.fromhex("
            "sys.argv[-1])), globals())\n", marshal.dumps(function.__code__).hex())


def test_freed_memory_is_kept_for_the_next_tensor():
    """keep_freed_memory, which init_distributed calls on a CPU (its calls: the test of init_distributed above): the
    key and value caches of two layers that grow one token at a time (torch.cat, as in generation) hand memory back
    to the system at every few steps under glibc's defaults (18 to 25 MB over the workload here; the next tensor
    faults those pages in anew), and a tenth of that or less in a process that called it first (none here). Counted
    from glibc's mallinfo (bytes of the heap and of mmapped blocks, after each step), not from page faults: the
    sandbox CI runs in counts none."""
    definition, compiled = in_a_bare_process(plumbing.keep_freed_memory)
    code = "import ctypes, sys\n" + definition + """
if sys.argv[1] == "kept":
    keep_freed_memory()
import torch
libc = ctypes.CDLL(None)
size_t = ctypes.c_size_t if hasattr(libc, "mallinfo2") else ctypes.c_int  # glibc before 2.33: mallinfo, in ints
class Mallinfo(ctypes.Structure):
    _fields_ = [(name, size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo = getattr(libc, "mallinfo2", None) or libc.mallinfo
mallinfo.restype = Mallinfo
def bytes_handed_back_by_growing_caches():
    handed_back, held = 0, mallinfo().arena + mallinfo().hblkhd
    for _ in range(3):
        caches = [torch.zeros(32, 4, 16, 32) for _ in range(4)]
        for _ in range(32):
            caches = [torch.cat([cache, torch.ones(32, 4, 1, 32)], dim=2) for cache in caches]
            torch.softmax(torch.ones(32, 1025), dim=-1)
            now = mallinfo().arena + mallinfo().hblkhd
            handed_back, held = handed_back + max(held - now, 0), now
    return handed_back
bytes_handed_back_by_growing_caches(), bytes_handed_back_by_growing_caches()  # the heap grows to its size
print(bytes_handed_back_by_growing_caches())
"""
    children = {how: subprocess.Popen([sys.executable, "-c", code, how, compiled], stdout=subprocess.PIPE, text=True)
                for how in ["defaults", "kept"]}
    handed_back = {how: int(child.communicate()[0]) for how, child in children.items()}
    assert handed_back["defaults"] > 2**20 and handed_back["kept"] < handed_back["defaults"] / 10, handed_back


def test_evaluate_keeps_freed_memory_on_a_cpu(tmp_path, monkeypatch):
    """evaluate.py, which runs without init_distributed, calls keep_freed_memory itself on a CPU, before any model
    loads (its main, stopped where it looks for snapshots, just after), and not on a GPU."""
    import evaluate

    class Stop(Exception):
        pass

    def stop(args):
        raise Stop

    calls = []
    monkeypatch.setattr(plumbing, "keep_freed_memory", lambda: calls.append("keep_freed_memory"))
    monkeypatch.setattr(evaluate, "snapshots_of_run", stop)
    for cuda, expected in [(False, ["keep_freed_memory"]), (True, [])]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        calls.clear()
        with pytest.raises(Stop):
            evaluate.main(evaluate.Args(output_dir=str(tmp_path / "eval")))
        assert calls == expected, cuda


def test_end_run_leaves_several_ranks_without_python_shutdown(monkeypatch):
    """end_run, the last line of every stage: after the ranks' barrier, a run of several ranks runs its exit handlers
    (the output folder's lock, the process group) and exits 0 at once, so that no gloo thread is ended by Python's
    shutdown inside a C++ destructor (the abort of about one 2-rank run in ten); one rank returns normally."""
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(plumbing.atexit, "_run_exitfuncs", lambda: calls.append("exit handlers"))
    monkeypatch.setattr(os, "_exit", lambda code: calls.append(f"_exit {code}"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    plumbing.end_run()
    assert calls == ["barrier"]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    plumbing.end_run()
    assert calls == ["barrier", "barrier", "exit handlers", "_exit 0"]


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints for --resume: renamed into place once complete, the newest two kept; the metrics file continued
# ---------------------------------------------------------------------------------------------------------------
RUN = "test__1__1700000000"  # the run that write_checkpoint's checkpoints are of


def write_checkpoint(checkpoint_dir, iteration, content="whole"):
    """A checkpoint as a run writes it before commit_checkpoint: in iteration_N.tmp. Returns iteration_N's path."""
    folder = checkpoint_dir / f"iteration_{iteration}.tmp"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"iteration": iteration, "args": {"content": content},
                                                   "run_name": RUN}))
    return str(checkpoint_dir / f"iteration_{iteration}")


def test_checkpoints_are_committed_whole_and_the_newest_two_kept(tmp_path):
    resume = tmp_path / "resume"
    assert plumbing.complete_checkpoints(str(resume)) == []  # no folder yet
    path = write_checkpoint(resume, 1)
    assert plumbing.complete_checkpoints(str(resume)) == []  # a .tmp folder is not a checkpoint
    plumbing.commit_checkpoint(path, RUN)
    assert sorted(os.listdir(resume)) == ["iteration_1", "latest"] and (resume / "latest").read_text() == "iteration_1"
    assert json.loads((resume / "iteration_1" / "state.json").read_text())["iteration"] == 1
    for iteration in (2, 3):
        plumbing.commit_checkpoint(write_checkpoint(resume, iteration), RUN)
    assert sorted(os.listdir(resume)) == ["iteration_2", "iteration_3", "latest"]
    assert (resume / "latest").read_text() == "iteration_3"
    assert plumbing.complete_checkpoints(str(resume)) == [str(resume / "iteration_3"), str(resume / "iteration_2")]
    # A kill while iteration 4 was being written leaves iteration_4.tmp, which is no checkpoint; the resumed run
    # (here with a larger --save-every) commits iteration 5, and the stray folder goes with the oldest checkpoint.
    write_checkpoint(resume, 4, content="cut short")
    assert plumbing.complete_checkpoints(str(resume)) == [str(resume / "iteration_3"), str(resume / "iteration_2")]
    plumbing.commit_checkpoint(write_checkpoint(resume, 5), RUN)
    assert sorted(os.listdir(resume)) == ["iteration_3", "iteration_5", "latest"]
    assert (resume / "latest").read_text() == "iteration_5"
    # A kill between a checkpoint's rename and `latest`: the one `latest` names comes first, then the others newest
    # first; a `latest` that names no complete checkpoint leaves them newest first.
    (resume / "latest").write_text("iteration_3\n")
    assert plumbing.complete_checkpoints(str(resume)) == [str(resume / "iteration_3"), str(resume / "iteration_5")]
    (resume / "latest").write_text("iteration_4")
    assert plumbing.complete_checkpoints(str(resume)) == [str(resume / "iteration_5"), str(resume / "iteration_3")]
    # A checkpoint written again under a name that exists replaces it whole.
    plumbing.commit_checkpoint(write_checkpoint(resume, 5, content="again"), RUN)
    assert json.loads((resume / "iteration_5" / "state.json").read_text())["args"]["content"] == "again"
    assert sorted(os.listdir(resume)) == ["iteration_3", "iteration_5", "latest"]
    assert (resume / "latest").read_text() == "iteration_5"


def test_a_resumed_run_continues_its_metrics_file(tmp_path):
    """continue_metrics_file keeps the lines of the iterations up to the checkpoint's, and drops those after it and
    any line that a kill cut short or that is not a metrics line."""
    path = tmp_path / "metrics.jsonl"
    plumbing.continue_metrics_file(str(path), 2)  # a run killed before it logged anything
    assert not path.exists()
    lines = [json.dumps({"iteration": i, "loss": i / 2}) + "\n" for i in (1, 2, 3, 4)]
    path.write_text("".join(lines) + "\n" + '{"loss": 1}\n' + '{"iteration": 5, "lo')
    plumbing.continue_metrics_file(str(path), 2)
    assert path.read_text() == lines[0] + lines[1]
    path.write_text(lines[0] + '{"iteration": 2, "lo\n' + lines[2].rstrip("\n"))  # the last line whole, but unended
    plumbing.continue_metrics_file(str(path), 3)
    assert path.read_text() == lines[0] + lines[2]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # written whole: no temporary file left


class Killed(BaseException):
    """A stop where a kill would land (not an error that a run catches)."""


def test_a_removal_cut_short_is_finished_and_a_folder_of_the_users_stays(tmp_path, monkeypatch):
    """Checkpoint retention removes what the run wrote and nothing else, so that a kill at any point of a removal
    leaves a folder that is recognisably the run's (renamed iteration_N.*.tmp, its state.json removed last), and the
    next checkpoint finishes the removal. A folder of the user's named as a save cut short (iteration_9.tmp, with no
    state.json), or as a save's staging folder (.saving), is never removed, whatever its name."""
    resume = tmp_path / "resume"
    (resume / "iteration_9.tmp").mkdir(parents=True)
    (resume / "iteration_9.tmp" / "notes.txt").write_text("the user's")

    def checkpoint(iteration):  # a checkpoint with a model's folder in it, as a run writes it
        path = write_checkpoint(resume, iteration)
        os.mkdir(path + ".tmp/actor")
        save_file({"weight": torch.zeros(3, 2)}, path + ".tmp/actor/model.safetensors")
        return path

    for iteration in (1, 2):
        plumbing.commit_checkpoint(checkpoint(iteration), RUN)
    removed = []

    def cut_short(remove):  # removes, until the state.json of the checkpoint being removed is gone: then a kill
        def remove_or_stop(path, *args, **kwargs):
            if "state.json" in removed:
                raise Killed
            remove(path, *args, **kwargs)
            removed.append(os.path.basename(path))
        return remove_or_stop

    with monkeypatch.context() as patch:
        for name in ("remove", "unlink", "rmdir"):
            patch.setattr(os, name, cut_short(getattr(os, name)))
        with pytest.raises(Killed):
            plumbing.commit_checkpoint(checkpoint(3), RUN)  # removes iteration_1, the third newest
    assert "iteration_1" not in os.listdir(resume) and removed[-1] == "state.json"
    plumbing.commit_checkpoint(checkpoint(4), RUN)
    assert sorted(os.listdir(resume)) == ["iteration_3", "iteration_4", "iteration_9.tmp", "latest"]
    # Cut short anywhere else (here as it begins to remove the model's folder), the same.
    def killed(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed)
        with pytest.raises(Killed):
            plumbing.commit_checkpoint(checkpoint(5), RUN)  # removes iteration_3
    plumbing.commit_checkpoint(checkpoint(6), RUN)
    assert sorted(os.listdir(resume)) == ["iteration_5", "iteration_6", "iteration_9.tmp", "latest"]
    assert (resume / "iteration_9.tmp" / "notes.txt").read_text() == "the user's"
    check_stops([(lambda: plumbing.begin_checkpoint(str(resume / "iteration_9"), {"run_name": RUN}),
                  f"cannot write the checkpoint '{resume / 'iteration_9.tmp'}' (File exists); it is in the way, and no "
                  "run wrote it (no state.json): move it away")])
    assert (resume / "iteration_9.tmp" / "notes.txt").read_text() == "the user's"
    (tmp_path / "model" / ".saving").mkdir(parents=True)
    (tmp_path / "model" / ".saving" / "notes.txt").write_text("the user's")
    check_stops([(lambda: plumbing.save_model_folder(None, None, str(tmp_path / "model"), {}),
                  f"'{tmp_path / 'model' / '.saving'}' holds more than a save leaves there (a folder of yours?): move "
                  "it away, then run again")])
    assert (tmp_path / "model" / ".saving" / "notes.txt").read_text() == "the user's"


def test_a_data_set_is_known_by_its_content_wherever_it_is(tmp_path):
    """folder_identity(data=True), as --resume knows a data set given by path: its files' names and content, not its
    path (a moved copy is the same data set); a byte changed or a file added makes another; hidden files (which
    `datasets` skips) do not count; a file is its content; a hub name is itself."""
    shutil.copytree(TOY_DATA, tmp_path / "data")
    identity = plumbing.folder_identity(str(tmp_path / "data"), data=True)
    os.rename(tmp_path / "data", tmp_path / "moved")
    data = tmp_path / "moved"
    assert plumbing.folder_identity(str(data), data=True) == identity
    (data / ".cache").mkdir()
    (data / ".cache" / "notes").write_text("not data")
    assert plumbing.folder_identity(str(data), data=True) == identity
    content = (data / "test.jsonl").read_bytes()
    (data / "test.jsonl").write_bytes(content[:-2] + bytes([content[-2] ^ 1]) + content[-1:])
    assert plumbing.folder_identity(str(data), data=True) != identity
    (data / "test.jsonl").write_bytes(content)
    (data / "dev.jsonl").write_bytes(content)
    assert plumbing.folder_identity(str(data), data=True) != identity
    shutil.copy(data / "test.jsonl", tmp_path / "elsewhere.jsonl")
    assert plumbing.folder_identity(str(tmp_path / "elsewhere.jsonl"), data=True) == \
        plumbing.folder_identity(str(data / "test.jsonl"), data=True) != identity
    assert plumbing.folder_identity("imdb", data=True) == "imdb"


@contextlib.contextmanager
def never_waits_on(fifo, seconds=5):
    """The block must not wait on FIFO, as a run that opens one to read (or write) waits for its other end, forever: a
    process opens both its ends after SECONDS, releasing whatever waits there, and the test fails instead of hanging."""
    code = ("import os, sys, time; time.sleep(float(sys.argv[2])); reader = os.open(sys.argv[1], os.O_RDONLY | "
            "os.O_NONBLOCK); os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK)); os.close(reader)")
    releaser, start = subprocess.Popen([sys.executable, "-c", code, str(fifo), str(seconds)]), time.time()
    try:
        yield
    finally:
        releaser.kill()
        releaser.wait()
    assert time.time() - start < seconds, f"waited on the FIFO {fifo}"


def test_a_fifo_where_a_run_reads_never_keeps_it_waiting(tmp_path, monkeypatch):
    """A FIFO where a run reads, in its output folder or its runs/RUN_NAME (the record, the lock, `latest`, a
    checkpoint's state.json, its weights and rank files, the metrics file), would keep it waiting for a writer forever:
    each is checked to be a regular file before it is opened. The output folder with one in it is refused in one line
    (with --overwrite too); read alone, one is no record, no `latest`, no state.json; a checkpoint with one cannot be
    resumed from; the metrics file stops the run in one line."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    out, engine = tmp_path / "out", types.SimpleNamespace(module=torch.nn.Linear(2, 3))
    checkpoint, metrics = out / "resume" / "iteration_2", tmp_path / "runs" / RUN / "metrics.jsonl"
    plumbing.commit_checkpoint(write_checkpoint(out / "resume", 2), RUN)
    (checkpoint / "actor").mkdir()
    save_file({"weight": torch.zeros(3, 2), "bias": torch.zeros(3)}, checkpoint / "actor" / "model.safetensors")
    save_file({"last_valid": torch.zeros(1)}, checkpoint / "rank_0.safetensors")
    metrics.parent.mkdir(parents=True)
    state = plumbing.read_state(str(checkpoint))
    assert plumbing.checkpoint_problem(str(checkpoint), state, {}, {"actor": engine}, [], ["last_valid"], 2) is None

    def fifo(path):  # a FIFO in PATH's place
        saved = path.read_bytes() if path.exists() else None
        path.unlink(missing_ok=True)
        os.mkfifo(path)
        fifos.append((path, saved))
        return never_waits_on(path)

    def claim():
        plumbing.claim_output_dir(str(out), {}, True, ["resume"])  # with --overwrite

    fifos = []
    not_a_file = "is not what a run leaves in --output-dir (a file or a folder, not a FIFO, a socket or a device)"
    for path in [out / "resume" / "latest", checkpoint / "state.json", checkpoint / "rank_0.safetensors",
                 checkpoint / "actor" / "model.safetensors"]:
        with fifo(path):
            check_stops([(claim, f"'{path}' {not_a_file}: move it away, or name another --output-dir")])
            assert plumbing.complete_checkpoints(str(out / "resume")) == [str(checkpoint)]
            assert plumbing.read_state(str(checkpoint)) == (None if path.name == "state.json" else state)
            problem = plumbing.checkpoint_problem(str(checkpoint), state, {}, {"actor": engine}, [], ["last_valid"], 2)
            assert problem == {"latest": None, "state.json": None, "rank_0.safetensors": "rank_0.safetensors is not a "
                               "rank's file of tensors", "model.safetensors": "actor/model.safetensors is missing, or "
                               "no file"}[path.name]
        path.unlink()
        path.write_bytes(fifos.pop()[1])
    with fifo(out / plumbing.RECORD):
        assert plumbing.read_record(str(out)) is None
        claim()  # replaced by the new record, not read
    assert plumbing.read_record(str(out)) == {"script": "ppo.py", "finished": False}
    os.remove(out / ".lock")  # this process's, as a run's lock
    with fifo(out / ".lock"):
        check_stops([(claim, f"'{out / '.lock'}' is not the lock file of a run")])
        plumbing.fsync_tree(str(out))  # (a save flushes the output folder's files)
    with fifo(metrics):
        check_stops([(lambda: plumbing.continue_metrics_file(str(metrics), 2), f"cannot continue '{metrics}' (not a "
                      "regular file); it is no file of the run's own (a FIFO, a device, or another name of a file: a "
                      "hard link): move it away, then run again"),
                     (lambda: plumbing.open_log(str(metrics)), f"cannot write to '{metrics}' (No such device or "
                      "address); it is no file of the run's own (a FIFO")])


def test_a_log_is_never_written_through_a_link_or_a_hard_link(tmp_path):
    """metrics.jsonl and trace.jsonl are appended to only as files of the run's own: a link, or a hard link (another
    name of a user's file) in their place stops the run in one line, and the user's file stays as it was; on --resume
    the log is written anew (continue_metrics_file), which leaves the user's file as it was too."""
    users, log = tmp_path / "users.jsonl", tmp_path / "metrics.jsonl"
    users.write_text('{"iteration": 1}\n{"iteration": 2}\n')
    for link, says in [(os.link, "(not a file of its own); it is no file of the run's own (a FIFO, a device, or "
                                 "another name of a file: a hard link)"),
                       (os.symlink, "(Too many levels of symbolic links); it is a link")]:
        link(users, log)
        check_stops([(lambda: plumbing.open_log(str(log)), f"cannot write to '{log}' {says}")])
        if link is os.link:
            plumbing.continue_metrics_file(str(log), 1)
            assert log.read_text() == '{"iteration": 1}\n' and not os.path.samefile(log, users)
        log.unlink()
    assert users.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'


def test_peak_resident_memory_is_the_process_own():
    """peak_resident_gb (ppo.py's CPU memory metrics, benchmark.py's peak RSS) is the process's own: started from a
    process that holds 1.5 GB, a small child reports its own few MB, where wait4's ru_maxrss reports the 1.5 GB."""
    held = bytearray(1536 * 2**20)
    held[::4096] = b"\1" * len(held[::4096])  # every page touched: resident
    definition, compiled = in_a_bare_process(plumbing.peak_resident_gb)
    code = "import os, sys\n" + definition + "print(peak_resident_gb())"
    child = subprocess.Popen([sys.executable, "-c", code, compiled], stdout=subprocess.PIPE, text=True)
    own = float(child.stdout.read())
    _, _, rusage = os.wait4(child.pid, 0)
    assert own < 0.1 and rusage.ru_maxrss / 2**20 > 1.5, (own, rusage.ru_maxrss)
    del held


def test_every_rank_evaluates_the_same_number_of_rows():
    """rank_share: each row of a held-out split on one rank (every world_size-th), and each rank as many rows as the
    longest share, the shorter ones filled with rows that count for nothing: under ZeRO-3 every forward pass is a
    collective, which a rank with one batch fewer would leave the others waiting in."""
    rows = [{"id": i} for i in range(7)]

    def filler(row):
        return {**row, "counted": False}

    shares = [plumbing.rank_share(rows, rank, 3, filler) for rank in range(3)]
    assert [[row["id"] for row in share] for share in shares] == [[0, 3, 6], [1, 4, 0], [2, 5, 0]]
    assert [[row.get("counted", True) for row in share] for share in shares] == [[True] * 3, [True, True, False],
                                                                                 [True, True, False]]
    assert plumbing.rank_share(rows[:2], 2, 4, filler) == [{"id": 0, "counted": False}]  # fewer rows than ranks
    assert plumbing.rank_share(rows, 0, 1, filler) == rows
