"""Stages 1 and 2 run for real, for a few steps, on the bundled toy task: plainly, and on 2 ranks under ZeRO-3.

Each script runs in a subprocess, as a user would run it; the saved folders are then loaded with from_pretrained and
checked. The bad-input tests check that each mistake stops the script with a one-line message naming what to fix.
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import evaluate
import ppo
import reward_model
import sft

BASE_MODEL = "toy_task/base_model"
# A few optimizer steps: datasets' split slicing keeps the runs short without a flag of our own.
FEW_STEPS = ["--train-split", "train[:64]", "--eval-split", "test[:32]", "--per-device-train-batch-size", "8"]
# Quiet, and one thread per rank: 2 ranks share this machine's 2 cores.
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1",
       "PYTHONWARNINGS": "ignore::FutureWarning", "TQDM_DISABLE": "1"}


def free_port() -> int:
    """A TCP port free on this machine now, for a launcher's --master_port: two suites running side by side must
    not both take the launcher's default, 29500."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(ranks):
    """The deepspeed launcher's command for `ranks` ranks on this machine, on a free port."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
            str(free_port())]


def run(script, *flags, ranks=None, check=True):
    """`python script flags`, or `deepspeed --num_gpus ranks script flags`; returns the finished process."""
    if ranks:
        command = [*launcher(ranks), script, *flags]
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
    """The folder loads as a 1-label sequence classifier with its tokenizer, scores finitely, and stores the
    normalization, reward_mean and reward_std."""
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    tokenizer = check_tokenizer(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    assert model.config.num_labels == 1
    config = AutoConfig.from_pretrained(path)
    assert math.isfinite(config.reward_mean) and math.isfinite(config.reward_std) and config.reward_std > 0
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


def normalized_scores_of_samples(policy_path, reward_path, prompts, seed):
    """(score - reward_mean) / reward_std of one response per prompt, sampled from the policy as ppo.py samples."""
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path).eval()
    result = evaluate.answer(policy, policy, reward, tokenizer, tokenizer(prompts)["input_ids"],
                             ppo.sampling_config(tokenizer, max_new_tokens=24, temperature=1.0),
                             evaluate.Args(seed=seed, batch_size=len(prompts), gold_judge=False),
                             reward.config.reward_mean, reward.config.reward_std, torch.device("cpu"))
    return torch.tensor(result["scores"])


def test_reward_model_one_rank(sft_checkpoint, tmp_path):
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", sft_checkpoint, "--output-dir",
                 str(tmp_path / "rm"), "--normalization-samples", "256")
    assert "held-out accuracy" in result.stdout and "reward normalization: on 256 responses" in result.stdout
    check_reward_model_folder(str(tmp_path / "rm"))
    # The stored normalization is that of the SFT policy's responses to training prompts: on other samples of it
    # (another seed), the normalized scores have mean about 0 and standard deviation about 1 (the standard errors of
    # both estimates together: about 0.09 for the mean, 0.06 for the standard deviation).
    prompts = [json.loads(line)["prompt"] for line in open("toy_task/data/train.jsonl")][:64] * 4
    scores = normalized_scores_of_samples(sft_checkpoint, str(tmp_path / "rm"), prompts, seed=12345)
    assert abs(scores.mean().item()) < 0.3 and abs(scores.std().item() - 1) < 0.25, (scores.mean(), scores.std())


def test_reward_model_two_ranks_zero3(sft_checkpoint, tmp_path):
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", sft_checkpoint, "--zero-stage", "3",
                 "--output-dir", str(tmp_path / "rm"), "--normalization-samples", "64", ranks=2)
    assert "reward normalization: on 64 responses" in result.stdout
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


def check_stops(cases):
    """Each (call, message): calling one of a script's own checks stops it with that one-line message (its fail()
    raises SystemExit with the message, which Python prints without a stack trace). In-process, so that the many
    cases cost no process start each; check_errors runs a few of them as a user would, to show main calls them."""
    for call, message in cases:
        with pytest.raises(SystemExit) as stop:
            call()
        assert message in str(stop.value), (message, str(stop.value))


def test_sft_bad_input(bad, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    one_file = sft.load_split(str(bad / "empty_prompt.jsonl"), "train", ["prompt", "chosen"])
    check_stops([
        (lambda: sft.load_split("toy_task/data", "train[:64]", ["prompt", "answer"]), "has no column ['answer']"),
        (lambda: sft.load_split(str(bad / "nothing"), "train", ["prompt"]),
         f"no data set at '{bad}/nothing'; check --dataset"),
        (lambda: sft.load_split(str(bad / "data.csv"), "train", ["prompt"]),
         "data.csv' is not a .json, .jsonl or .parquet file"),
        (lambda: sft.load_split(str(bad / "broken.jsonl"), "train", ["prompt"]),
         "broken.jsonl' (JSON parse error: Missing a colon"),
        (lambda: sft.load_split(str(bad / "empty.jsonl"), "train", ["prompt"]), "empty.jsonl' is an empty file"),
        (lambda: sft.load_split("toy_task/data", "dev", ["prompt"]),
         "cannot load split 'dev' of data set 'toy_task/data' (Unknown split"),
        (lambda: sft.tokenize_demonstrations(one_file, tokenizer, sft.Args(), "train"),
         "row 1 of split 'train' has an empty 'prompt'"),
        # One file is every split, and a slice of it works; here no row of it fits.
        (lambda: sft.tokenize_demonstrations(sft.load_split("toy_task/data/test.jsonl", "train[:64]", ["prompt"]),
                                             tokenizer, sft.Args(max_seq_len=4), "train[:64]"),
         "no row of split 'train[:64]' fits --max-seq-len 4"),
        (lambda: sft.check_model_folder(str(bad / "nothing"), "check --model-name-or-path"), "no model folder at"),
        (lambda: sft.check_model_folder(str(bad / "empty_folder"), "check --model-name-or-path"),
         "empty_folder' holds no model (no config.json)"),
        (lambda: sft.check_model_folder(str(bad / "no_weights"), "check --model-name-or-path"),
         "no_weights' has no model weights (model.safetensors)"),
        (lambda: sft.load_tokenizer(str(bad / "empty_folder"), "check --tokenizer-name-or-path", False),
         "cannot load a tokenizer from"),
        (lambda: sft.check_args(sft.Args(learning_rate=-1.0)), "--learning-rate must be positive, not -1.0"),
        (lambda: sft.check_args(sft.Args(num_train_epochs=0)), "--num-train-epochs must be at least 1, not 0"),
        (lambda: sft.check_args(sft.Args(output_dir=str(bad / "a_file"))), "a_file' is a file; name a folder"),
    ])
    check_errors("sft.py", [*FEW_STEPS, "--output-dir", str(tmp_path / "out")], [
        (["--prompt-column", "promt"],
         "has no column ['promt']; its columns are ['prompt', 'chosen', 'rejected', 'kind']"),
        (["--model-name-or-path", str(bad / "pickle_only")],
         "pickle_only' has no model.safetensors; only safetensors weights are loaded (no pickle)"),
        (["--max-seq-len", "1000"], "--max-seq-len 1000 is longer than the model's 128 positions"),
        (["--per-device-train-batch-size", "0"], "--per-device-train-batch-size must be at least 1, not 0"),
        (["--per-device-train-batch-size", "100"], "64 training rows make no optimizer step of 100 sequences"),
        (["--dtype", "fp16"], "--dtype fp16 needs a GPU"),
    ])
    result = run("sft.py", "--zero-stage", "4", check=False)
    assert "invalid choice '4' for argument '--zero-stage'" in result.stderr
    # On 2 ranks every rank says it (the launcher's own lines come last): 2 x 40 sequences > 64 rows.
    result = run("sft.py", *FEW_STEPS, "--per-device-train-batch-size", "40", "--output-dir", str(tmp_path / "out"),
                 ranks=2, check=False)
    assert result.returncode != 0 and "64 training rows make no optimizer step of 80 sequences" in result.stderr


def test_reward_model_bad_input(bad, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    columns = ["prompt", "chosen", "rejected"]
    check_stops([
        (lambda: reward_model.load_split(str(bad / "data.csv"), "train", columns),
         "data.csv' is not a .json, .jsonl or .parquet file"),
        (lambda: reward_model.tokenize_pairs(reward_model.load_split(str(bad / "empty_rejected.jsonl"), "train",
                                                                     columns), tokenizer, reward_model.Args(), "train"),
         "row 1 of split 'train' has an empty 'rejected'"),
        (lambda: reward_model.check_model_folder(str(bad / "nothing"), "check --model-name-or-path"),
         "no model folder at"),
        (lambda: reward_model.check_model_folder(str(bad / "empty_folder"), "check --model-name-or-path"),
         "holds no model (no config.json)"),
        (lambda: reward_model.check_args(reward_model.Args(gradient_accumulation_steps=0)),
         "--gradient-accumulation-steps must be at least 1, not 0"),
        (lambda: reward_model.check_args(reward_model.Args(normalization_samples=1)),
         "--normalization-samples must be at least 2"),
        (lambda: reward_model.check_args(reward_model.Args(output_dir=str(bad / "a_file"))),
         "a_file' is a file; name a folder"),
    ])
    check_errors("reward_model.py", [*FEW_STEPS, "--model-name-or-path", BASE_MODEL, "--output-dir", str(tmp_path)], [
        (["--rejected-column", "worse"], "has no column ['worse']"),
        (["--model-name-or-path", str(bad / "pickle_only")],
         "has no model.safetensors; only safetensors weights are loaded"),
        (["--learning-rate", "0"], "--learning-rate must be positive, not 0.0"),
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
