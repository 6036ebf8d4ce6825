"""Stages 1 and 2 run for real, for a few steps, on the bundled toy task: plainly, and on 2 ranks under ZeRO-3.

Each script runs in a subprocess, as a user would run it; the saved folders are then loaded with from_pretrained and
checked. The bad-input tests check that each mistake stops the script with a one-line message naming what to fix.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
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


def test_missing_column(tmp_path):
    result = run("sft.py", *FEW_STEPS, "--response-column", "answer", "--output-dir", str(tmp_path), check=False)
    assert "has no column ['answer']" in error_of(result)
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", BASE_MODEL, "--rejected-column", "worse",
                 "--output-dir", str(tmp_path), check=False)
    assert "has no column ['worse']" in error_of(result)


def test_empty_prompt(tmp_path):
    rows = [{"prompt": "A fine film, and", "chosen": " good.", "rejected": " bad."},
            {"prompt": "  ", "chosen": " good.", "rejected": " bad."}]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    result = run("sft.py", "--dataset", data, "--train-split", "train", "--eval-split", "train",
                 "--output-dir", str(tmp_path), check=False)
    assert "row 1 of split 'train' has an empty 'prompt'" in error_of(result)


def test_too_long_rows_are_dropped_and_counted(tmp_path):
    result = run("sft.py", *FEW_STEPS, "--max-seq-len", "24", "--output-dir", str(tmp_path / "sft"))
    assert "longer than --max-seq-len 24" in result.stdout
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", BASE_MODEL, "--max-seq-len", "4",
                 "--output-dir", str(tmp_path / "rm"), check=False)
    assert "fits --max-seq-len 4; raise it" in error_of(result)


def test_wrong_model_path(tmp_path):
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", str(tmp_path / "nothing_here"),
                 "--output-dir", str(tmp_path), check=False)
    assert "no model or tokenizer folder at" in error_of(result)


def test_fp16_on_cpu(tmp_path):
    result = run("sft.py", *FEW_STEPS, "--dtype", "fp16", "--output-dir", str(tmp_path), check=False)
    assert "--dtype fp16 needs a GPU" in error_of(result)


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
