"""Stages 1 and 2 run for real, for a few steps, on the bundled toy task: plainly, and on 2 ranks under ZeRO-3.

Each script runs in a subprocess, as a user would run it; the saved folders are then loaded with from_pretrained and
checked. The bad-input tests check that each mistake stops the script with a one-line message naming what to fix.
"""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

BASE_MODEL = "toy_task/base_model"
# A few optimizer steps: datasets' split slicing keeps the runs short without a flag of our own.
FEW_STEPS = ["--train-split", "train[:64]", "--eval-split", "test[:32]", "--per-device-train-batch-size", "8"]
# Quiet, and one thread per rank: 2 ranks share this machine's 2 cores.
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1",
       "PYTHONWARNINGS": "ignore::FutureWarning", "TQDM_DISABLE": "1"}


def run(script, *flags, ranks=None, check=True):
    """`python script flags`, or `deepspeed --num_gpus ranks script flags`; returns the finished process."""
    if ranks:
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), script, *flags]
    else:
        command = [sys.executable, script, *flags]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=600)
    if check:
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def error_of(result):
    """The last line a failed script printed on stderr: where our one-line error message must be."""
    assert result.returncode != 0, f"expected a failure, got:\n{result.stdout[-2000:]}"
    return result.stderr.strip().splitlines()[-1]


def weights(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def check_tokenizer(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    return tokenizer


def check_sft_folder(path):
    """The folder loads as an ordinary causal LM with its tokenizer, gives finite logits, and was trained."""
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    tokenizer = check_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    input_ids = torch.tensor([tokenizer("I watched this film last night and the story was moving.")["input_ids"]])
    assert torch.isfinite(model(input_ids).logits).all()
    base = weights(AutoModelForCausalLM.from_pretrained(BASE_MODEL))
    trained = weights(model)
    assert trained.keys() == base.keys()
    assert all(trained[k].shape == base[k].shape for k in base)  # full weights, not ZeRO-3 shards
    assert any(not torch.equal(trained[k], base[k]) for k in base)


def check_reward_model_folder(path):
    """The folder loads as a 1-label sequence classifier with its tokenizer, scores finitely, stores reward_mean."""
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    tokenizer = check_tokenizer(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    assert model.config.num_labels == 1
    assert isinstance(AutoConfig.from_pretrained(path).reward_mean, float)
    ids = tokenizer("I watched this film and the story was moving.")["input_ids"] + [tokenizer.eos_token_id]
    scores = model(torch.tensor([ids])).logits
    assert scores.shape == (1, 1) and torch.isfinite(scores).all()


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sft") / "model")
    result = run("sft.py", *FEW_STEPS, "--output-dir", path)
    assert "held-out loss" in result.stdout
    return path


def test_sft_one_rank(sft_checkpoint):
    check_sft_folder(sft_checkpoint)


def test_sft_two_ranks_zero3(tmp_path):
    run("sft.py", *FEW_STEPS, "--zero-stage", "3", "--output-dir", str(tmp_path / "sft"), ranks=2)
    check_sft_folder(str(tmp_path / "sft"))


def test_reward_model_one_rank(sft_checkpoint, tmp_path):
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", sft_checkpoint, "--output-dir", str(tmp_path / "rm"))
    assert "held-out accuracy" in result.stdout
    check_reward_model_folder(str(tmp_path / "rm"))


def test_reward_model_two_ranks_zero3(sft_checkpoint, tmp_path):
    run("reward_model.py", *FEW_STEPS, "--model-name-or-path", sft_checkpoint, "--zero-stage", "3",
        "--output-dir", str(tmp_path / "rm"), ranks=2)
    check_reward_model_folder(str(tmp_path / "rm"))


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a one-line error that names what to fix, before any training
# ---------------------------------------------------------------------------------------------------------------
def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


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
    (root / "broken.jsonl").write_text('{"prompt": "A fine film, and", "chosen"\n')
    (root / "empty.jsonl").write_text("")
    (root / "a_file").write_text("not a folder")
    return root


def check_errors(script, flags, cases):
    """Run `script flags case_flags` for each (case_flags, message) case, two at a time (one per core), and check
    that each stopped with its one-line message, not a stack trace."""
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: run(script, *flags, *case[0], check=False), cases))
    for (case_flags, message), result in zip(cases, results):
        assert message in error_of(result) and "Traceback" not in result.stderr, (case_flags, result.stderr[-3000:])


def test_sft_bad_input(bad, tmp_path):
    one_file = ["--train-split", "train", "--eval-split", "train"]
    check_errors("sft.py", [*FEW_STEPS, "--output-dir", str(tmp_path / "out")], [
        (["--response-column", "answer"], "has no column ['answer']"),
        (["--prompt-column", "promt"],
         "has no column ['promt']; its columns are ['prompt', 'chosen', 'rejected', 'kind']"),
        (["--dataset", str(bad / "nothing")], f"no data set at '{bad}/nothing'; check --dataset"),
        (["--dataset", str(bad / "data.csv")], "data.csv' is not a .json, .jsonl or .parquet file"),
        (["--dataset", str(bad / "broken.jsonl"), *one_file], "broken.jsonl' (JSON parse error: Missing a colon"),
        (["--dataset", str(bad / "empty.jsonl"), *one_file], "empty.jsonl' is an empty file"),
        (["--eval-split", "dev"], "cannot load split 'dev' of data set 'toy_task/data' (Unknown split"),
        (["--dataset", str(bad / "empty_prompt.jsonl"), *one_file], "row 1 of split 'train' has an empty 'prompt'"),
        # One file is every split, and a slice of it works; here no row of it fits.
        (["--dataset", "toy_task/data/test.jsonl", "--max-seq-len", "4"],
         "no row of split 'train[:64]' fits --max-seq-len 4"),
        (["--max-seq-len", "1000"], "--max-seq-len 1000 is longer than the model's 128 positions"),
        (["--model-name-or-path", str(bad / "nothing")], "no model folder at"),
        (["--model-name-or-path", str(bad / "empty_folder")], "empty_folder' holds no model (no config.json)"),
        (["--model-name-or-path", str(bad / "no_weights")], "no_weights' has no model weights (model.safetensors)"),
        (["--model-name-or-path", str(bad / "pickle_only")],
         "pickle_only' has no model.safetensors; only safetensors weights are loaded (no pickle)"),
        (["--tokenizer-name-or-path", str(bad / "empty_folder")], "cannot load a tokenizer from"),
        (["--per-device-train-batch-size", "0"], "--per-device-train-batch-size must be at least 1, not 0"),
        (["--per-device-train-batch-size", "100"], "64 training rows make no optimizer step of 100 sequences"),
        (["--learning-rate", "-1"], "--learning-rate must be positive, not -1.0"),
        (["--num-train-epochs", "0"], "--num-train-epochs must be at least 1, not 0"),
        (["--output-dir", str(bad / "a_file")], "a_file' is a file; name a folder"),
        (["--dtype", "fp16"], "--dtype fp16 needs a GPU"),
    ])
    result = run("sft.py", "--zero-stage", "4", check=False)
    assert "invalid choice '4' for argument '--zero-stage'" in result.stderr
    # On 2 ranks every rank says it (the launcher's own lines come last): 2 x 40 sequences > 64 rows.
    result = run("sft.py", *FEW_STEPS, "--per-device-train-batch-size", "40", "--output-dir", str(tmp_path / "out"),
                 ranks=2, check=False)
    assert result.returncode != 0 and "64 training rows make no optimizer step of 80 sequences" in result.stderr


def test_reward_model_bad_input(bad, tmp_path):
    check_errors("reward_model.py", [*FEW_STEPS, "--model-name-or-path", BASE_MODEL, "--output-dir", str(tmp_path)], [
        (["--rejected-column", "worse"], "has no column ['worse']"),
        (["--dataset", str(bad / "data.csv")], "data.csv' is not a .json, .jsonl or .parquet file"),
        (["--dataset", str(bad / "empty_rejected.jsonl"), "--train-split", "train", "--eval-split", "train"],
         "row 1 of split 'train' has an empty 'rejected'"),
        (["--model-name-or-path", str(bad / "nothing")], "no model folder at"),
        (["--model-name-or-path", str(bad / "empty_folder")], "holds no model (no config.json)"),
        (["--model-name-or-path", str(bad / "pickle_only")],
         "has no model.safetensors; only safetensors weights are loaded"),
        (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps must be at least 1, not 0"),
        (["--learning-rate", "0"], "--learning-rate must be positive, not 0.0"),
        (["--output-dir", str(bad / "a_file")], "a_file' is a file; name a folder"),
        (["--dtype", "fp16"], "--dtype fp16 needs a GPU"),
    ])
    result = run("reward_model.py", "--zero-stage", "4", check=False)
    assert "invalid choice '4' for argument '--zero-stage'" in result.stderr


def test_too_long_rows_are_dropped_and_counted(tmp_path):
    result = run("sft.py", *FEW_STEPS, "--max-seq-len", "24", "--output-dir", str(tmp_path / "sft"))
    assert "longer than --max-seq-len 24" in result.stdout
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", BASE_MODEL, "--max-seq-len", "4",
                 "--output-dir", str(tmp_path / "rm"), check=False)
    assert "fits --max-seq-len 4; raise it" in error_of(result)


def test_tokenizer_without_pad_token_gets_one(tmp_path):
    # The base model with a tokenizer that has no pad token, as many hub tokenizers (GPT-2, Pythia, Llama) have.
    model_dir = tmp_path / "no_pad"
    AutoModelForCausalLM.from_pretrained(BASE_MODEL).save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token is None
    result = run("sft.py", *FEW_STEPS, "--model-name-or-path", str(model_dir), "--output-dir", str(tmp_path / "sft"))
    assert "no pad token distinct from EOS: added '<|pad|>'" in result.stdout
    saved = check_tokenizer(str(tmp_path / "sft"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    assert model.get_input_embeddings().num_embeddings >= len(saved)
