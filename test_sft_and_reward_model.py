"""Stages 1 and 2 run for real, for a few steps, on the bundled toy task (on 2 ranks under ZeRO-3: test_launchers.py).

Each script runs as a user would run it (on one rank mostly in this process, to save a process start); the saved
folders are then loaded with from_pretrained and checked. The bad-input tests check that each mistake stops the
script with a one-line message naming what to fix.
"""

import contextlib
import dataclasses
import glob
import importlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import deepspeed
import pytest
import torch
import transformers
import tyro
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import evaluate
import fast_sampling
import plumbing
from plumbing import free_port
import ppo
import reward_model
import rlhf_math
import sft
from test_docs import README, spans_and_lines
# bad is a pytest fixture, used by name
from test_plumbing import BASE_MODEL, TOY_DATA, bad, check_stops, dropping_tokenizer, write_jsonl  # noqa: F401

# The checkout: the tests run in a working folder of their own (conftest), and name each script by its path here.
ROOT = os.path.dirname(os.path.abspath(__file__))
# A few optimizer steps: datasets' split slicing keeps the runs short without a flag of our own.
FEW_STEPS = ["--train-split", "train[:64]", "--eval-split", "test[:32]", "--per-device-train-batch-size", "8"]
# Quiet, and one thread per rank: 2 ranks share this machine's 2 cores.
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1",
       "PYTHONWARNINGS": "ignore::FutureWarning", "TQDM_DISABLE": "1"}


def launcher(ranks):
    """The deepspeed launcher's command for `ranks` ranks on this machine, on a free port."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
            free_port()]


def torchrun(ranks):
    """torchrun's command for `ranks` ranks on this machine, on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
            free_port()]


def run(script, *flags, ranks=None, check=True, launch=launcher, here=False):
    """`python script flags`, or `deepspeed --num_gpus ranks script flags` (launch=torchrun: `torchrun
    --nproc-per-node ranks script flags`); returns the finished process. here=True runs a one-rank script in this
    process instead (run_in_process, its output captured): no process start, whose imports take about 9 s here."""
    if here:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            error = run_in_process(script, list(flags), must_stop=False)
        result = subprocess.CompletedProcess([script, *flags], int(error is not None), stdout.getvalue(),
                                             stderr.getvalue() + (error or ""))
        assert result.returncode == 0 or not check, f"{script} {' '.join(flags)} failed: {error}"
        return result
    if ranks:
        command = [*launch(ranks), os.path.join(ROOT, script), *flags]
    else:
        command = [sys.executable, os.path.join(ROOT, script), *flags]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=600)
    if check:
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        if "--master_port" in command:  # no rank made DeepSpeed's shared-memory files: plain gloo on a CPU
            port = command[command.index("--master_port") + 1]
            assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"), "a run left files in /dev/shm"
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
    result = run("sft.py", *FEW_STEPS, "--output-dir", path, here=True)
    assert "held-out loss" in result.stdout
    return path


def test_sft_one_rank(sft_checkpoint):
    check_sft_folder(sft_checkpoint)


def test_reward_model_one_rank(sft_checkpoint, tmp_path):
    result = run("reward_model.py", *FEW_STEPS, "--model-name-or-path", sft_checkpoint, "--output-dir",
                 str(tmp_path / "rm"), "--normalization-samples", "32", here=True)
    assert "held-out accuracy" in result.stdout and "reward normalization: on 32 responses" in result.stdout
    check_reward_model_folder(str(tmp_path / "rm"))


def test_reward_model_steps_and_normalization_recomputed(sft_checkpoint, tmp_path, monkeypatch):
    """reward_model.py recorded and recomputed. Each optimizer step's gradient is that of the pairwise loss
    -log sigmoid(r(chosen) - r(rejected)) of its batch (chosen rows first), the scores read by the model's own pooling
    at the weights before the step. reward_mean and reward_std are the mean and standard deviation of the trained
    model's scores of the responses the policy sampled, as ppo.py samples (temperature, length): each response is
    recorded as generate returned it, cut after its EOS, and scored again here, prompt + response alone, unpadded."""
    sampled, steps = [], []
    generate, engine_step = transformers.GenerationMixin.generate, deepspeed.runtime.engine.DeepSpeedEngine.step

    def recording_generate(model, **kwargs):
        sequences = generate(model, **kwargs)
        # The first response made to stop at its second token, padding after its EOS as generate leaves it: a score
        # must be read at the EOS, not at the padding (whatever the policy samples, a response stops in every batch).
        P, config = kwargs["input_ids"].shape[1], model.generation_config
        if sequences.shape[1] < P + 3:  # every response has stopped: room for the padding
            sequences = torch.cat([sequences, torch.full_like(sequences[:, : P + 3 - sequences.shape[1]],
                                                              config.pad_token_id)], dim=1)
        sequences[0, P + 1], sequences[0, P + 2 :] = config.eos_token_id, config.pad_token_id
        sampled.append((kwargs["input_ids"], kwargs["attention_mask"], sequences, model.generation_config))
        return sequences

    # The training loop's batch as the loader makes it (reward_model.collate, its collate_fn, called in this process
    # when the loop asks for the next batch), taken by the optimizer step that ends the batch's accumulation.
    batches, collate = [], reward_model.collate

    def recording_collate(examples, pad_token_id):
        batches[:] = [collate(examples, pad_token_id)]
        return batches[0]

    def recording_step(engine):
        if len(steps) < 3 and batches and engine.is_gradient_accumulation_boundary():
            steps.append((batches[0], {n: p.detach().clone() for n, p in engine.module.named_parameters()},
                          {n: p.grad.clone() for n, p in engine.module.named_parameters()}))
        return engine_step(engine)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", recording_generate)
    monkeypatch.setattr(reward_model, "collate", recording_collate)
    monkeypatch.setattr(deepspeed.runtime.engine.DeepSpeedEngine, "step", recording_step)
    out = tmp_path / "rm"
    assert run_in_process("reward_model.py", [*FEW_STEPS, "--model-name-or-path", sft_checkpoint, "--output-dir",
                                              str(out), "--normalization-samples", "24", "--temperature", "0.8",
                                              "--max-new-tokens", "20"], must_stop=False) is None
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert len(steps) == 3
    for batch, weights, grads in steps:
        model.load_state_dict(weights)
        model.zero_grad()
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        chosen, rejected = scores.chunk(2)
        (-torch.nn.functional.logsigmoid(chosen - rejected).mean()).backward()
        expected = torch.cat([p.grad.flatten() for p in model.parameters()])
        error = (torch.cat([grads[n].flatten() for n, _ in model.named_parameters()]) - expected).norm()
        assert error < 1e-4 * expected.norm(), error / expected.norm()
    model, eos = AutoModelForSequenceClassification.from_pretrained(out).eval(), check_tokenizer(out).eos_token_id
    scores, stopped = [], 0
    for prompt_ids, prompt_mask, sequences, config in sampled:
        assert (config.temperature, config.max_new_tokens, config.top_k, config.top_p) == (0.8, 20, 0, 1.0)
        for prompt, mask, sequence in zip(prompt_ids, prompt_mask, sequences):
            response = sequence[prompt_ids.shape[1] :].tolist()
            stopped += eos in response[:-1]  # then padding follows, which must not be scored
            response = response[: response.index(eos) + 1] if eos in response else response
            with torch.no_grad():
                scores.append(model(torch.tensor([prompt[mask.bool()].tolist() + response])).logits[0, 0].double())
    scores = torch.stack(scores)
    assert len(scores) == 24 and stopped > 0
    assert model.config.reward_mean == pytest.approx(scores.mean().item(), abs=1e-5)
    assert model.config.reward_std == pytest.approx(scores.std().item(), abs=1e-5)  # unbiased
    assert model.config.reward_normalization == {"policy": sft_checkpoint, "temperature": 0.8, "max_new_tokens": 20,
                                                 "policy_identity": plumbing.folder_identity(sft_checkpoint)}


# ---------------------------------------------------------------------------------------------------------------
# What the stages log: every metric in the README's guide
# ---------------------------------------------------------------------------------------------------------------
def test_every_logged_metric_is_in_the_readme(tmp_path, monkeypatch):
    """Every metric name that sft.py, reward_model.py and ppo.py log, as a short run of each logs them (every step;
    ppo.py with --unsup-dataset, whose loss it logs too), recorded where each goes to tensorboard
    (SummaryWriter.add_scalar; ppo.py's metrics.jsonl lines hold the same names), is an inline span of the README."""
    logged, add_scalar = {}, SummaryWriter.add_scalar

    def recording_add_scalar(writer, tag, *args, **kwargs):
        logged[script].add(tag)
        return add_scalar(writer, tag, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_scalar", recording_add_scalar)
    steps = ["--train-split", "train[:16]", "--eval-split", "test[:8]", "--per-device-train-batch-size", "8",
             "--logging-steps", "1"]
    sft_out, rm_out = str(tmp_path / "sft"), str(tmp_path / "rm")
    for script, flags in [
            ("sft.py", [*steps, "--output-dir", sft_out]),
            ("reward_model.py", [*steps, "--model-name-or-path", sft_out, "--normalization-samples", "2",
                                 "--max-new-tokens", "4", "--output-dir", rm_out]),
            ("ppo.py", ["--actor-model-name-or-path", sft_out, "--reward-model-name-or-path", rm_out,
                        "--per-device-rollout-batch-size", "4", "--num-mini-batches", "1",
                        "--per-device-train-batch-size", "4", "--num-ppo-epochs", "1", "--max-new-tokens", "4",
                        "--total-episodes", "4", "--unsup-dataset", f"{plumbing.TOY_TASK}/pretrain.txt",
                        "--output-dir", str(tmp_path / "ppo")])]:
        logged[script] = set()
        exp_name = f"test_logged_metrics_{script[:-3]}"
        assert run_in_process(script, [*flags, "--exp-name", exp_name], must_stop=False) is None
        for old in glob.glob(f"runs/{exp_name}__*"):
            shutil.rmtree(old)
    assert all(logged.values()), f"a run logged nothing through SummaryWriter.add_scalar: {logged}"
    named = {span for _, span, inline in spans_and_lines(README) if inline}
    missing = sorted(set().union(*logged.values()) - named)
    assert not missing, "metrics the stages log that the README's metrics guide does not name: " + ", ".join(missing)


# ---------------------------------------------------------------------------------------------------------------
# What the stages log, against what they trained: each train/ figure is the mean over exactly its window of
# optimizer steps (logging_steps of them, fewer in the last), whatever the epochs and the gradient accumulation
# ---------------------------------------------------------------------------------------------------------------
def recorded_run(script, flags, patch):
    """`python script flags` run here (run_in_process, exp_name `test_windows`, its runs/ folder removed after),
    recording with `patch` (a pytest.MonkeyPatch) what the run itself does: each training micro-batch's loss as
    DeepSpeed's backward receives it (and, for the reward model, its accuracy, from rlhf_math.pairwise_reward_loss
    with gradients on); the learning rate after each optimizer step (DeepSpeed's engine.global_steps after its step:
    lr), and each scalar logged, with the optimizer steps the engine had taken when it was logged."""
    recorded = {"micro_batches": [], "accuracies": [], "lr_after": {}, "logged": {}}
    engines, backward, step = [], deepspeed.runtime.engine.DeepSpeedEngine.backward, \
        deepspeed.runtime.engine.DeepSpeedEngine.step
    add_scalar, pairwise_reward_loss = SummaryWriter.add_scalar, rlhf_math.pairwise_reward_loss

    def recording_backward(engine, loss, *args, **kwargs):
        engines[:] = [engine]
        recorded["micro_batches"].append(loss.item())
        return backward(engine, loss, *args, **kwargs)

    def recording_step(engine, *args, **kwargs):
        result = step(engine, *args, **kwargs)
        recorded["lr_after"][engine.global_steps] = engine.get_lr()[0]
        return result

    def recording_pairwise_reward_loss(*args, **kwargs):
        loss, accuracy = pairwise_reward_loss(*args, **kwargs)
        if torch.is_grad_enabled():  # training, not the held-out evaluation
            recorded["accuracies"].append(accuracy.item())
        return loss, accuracy

    def recording_add_scalar(writer, tag, value, global_step=None, *args, **kwargs):
        recorded["logged"].setdefault(tag, []).append((global_step, value, engines[0].global_steps if engines else 0))
        return add_scalar(writer, tag, value, global_step, *args, **kwargs)

    patch.setattr(deepspeed.runtime.engine.DeepSpeedEngine, "backward", recording_backward)
    patch.setattr(deepspeed.runtime.engine.DeepSpeedEngine, "step", recording_step)
    patch.setattr(rlhf_math, "pairwise_reward_loss", recording_pairwise_reward_loss)
    patch.setattr(SummaryWriter, "add_scalar", recording_add_scalar)
    try:
        assert run_in_process(script, [*flags, "--exp-name", "test_windows"], must_stop=False) is None
    finally:
        for folder in glob.glob("runs/test_windows__*"):
            shutil.rmtree(folder)
    return recorded


def check_windows(recorded, accumulation, logging_steps, names):
    """Each train/NAME (names: "loss", and "accuracy" for the reward model) is logged at every logging_steps-th
    optimizer step and at the last, when the engine has taken exactly that many optimizer steps, as the mean of the
    micro-batches of the optimizer steps since the previous log; train/lr at step s is the learning rate after
    optimizer step s."""
    per_micro_batch = {"loss": recorded["micro_batches"], "accuracy": recorded["accuracies"]}
    steps = max(recorded["lr_after"])  # the optimizer steps of the run
    assert len(recorded["micro_batches"]) == steps * accumulation  # each step whole, every micro-batch once
    expected_steps = sorted({*range(logging_steps, steps + 1, logging_steps), steps})
    for name in [*names, "lr"]:
        logged = recorded["logged"][f"train/{name}"]
        assert [s for s, _, _ in logged] == expected_steps, name
        assert all(taken == s for s, _, taken in logged), (name, logged)
    for name in names:
        previous = 0
        for s, value, _ in recorded["logged"][f"train/{name}"]:
            window = per_micro_batch[name][previous * accumulation : s * accumulation]
            assert value == pytest.approx(sum(window) / len(window), rel=1e-5, abs=1e-6), (name, s)
            previous = s
    for s, lr, _ in recorded["logged"]["train/lr"]:
        assert lr == pytest.approx(recorded["lr_after"][s], rel=1e-9), s


def test_sft_logs_each_window_of_steps_across_epochs(tmp_path):
    """Two epochs of 2 optimizer steps (40 rows in micro-batches of 8, accumulation 2: the 5th micro-batch of each
    epoch is left out), logged every 3 steps: the first window spans both epochs (steps 1-3), the last is step 4
    alone."""
    with pytest.MonkeyPatch.context() as patch:
        recorded = recorded_run("sft.py", ["--train-split", "train[:40]", "--eval-split", "test[:8]",
                                           "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "2",
                                           "--num-train-epochs", "2", "--logging-steps", "3",
                                           "--output-dir", str(tmp_path / "sft")], patch)
    assert max(recorded["lr_after"]) == 4
    check_windows(recorded, accumulation=2, logging_steps=3, names=["loss"])


@pytest.fixture(scope="module")
def reward_model_windows(tmp_path_factory):
    """reward_model.py at gradient accumulation 2 and 3 (logged every 4 and 3 optimizer steps), two epochs of 56
    pairs in micro-batches of 8 each, recorded (recorded_run), and each run's held-out split of 7 pairs. This process
    evaluates rank 1's share of that split on 2 ranks (plumbing.rank_share patched to rank 1 of 2): pairs 1, 3 and
    5, and the filler pair that keeps it in step with rank 0's four, which must count for nothing."""
    root, runs = tmp_path_factory.mktemp("rm_windows"), {}
    for accumulation, logging_steps in [(2, 4), (3, 3)]:
        out = root / f"rm_{accumulation}"
        with pytest.MonkeyPatch.context() as patch:
            share = plumbing.rank_share
            patch.setattr(plumbing, "rank_share", lambda rows, rank, world_size, filler: share(rows, 1, 2, filler))
            recorded = recorded_run("reward_model.py", [
                "--model-name-or-path", BASE_MODEL, "--train-split", "train[:56]", "--eval-split", "test[:7]",
                "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", str(accumulation),
                "--num-train-epochs", "2", "--logging-steps", str(logging_steps), "--normalization-samples", "2",
                "--max-new-tokens", "4", "--output-dir", str(out)], patch)
        runs[accumulation] = (recorded, logging_steps, str(out))
    return runs


@pytest.mark.parametrize("accumulation", [2, 3])
def test_reward_model_logs_each_window_of_steps_under_accumulation(reward_model_windows, accumulation):
    """DeepSpeed's is_gradient_accumulation_boundary(), asked after engine.step(), answers for the next micro-batch:
    the step count, the learning rate read and the windows would run one micro-batch early."""
    recorded, logging_steps, _ = reward_model_windows[accumulation]
    check_windows(recorded, accumulation, logging_steps, names=["loss", "accuracy"])


def test_reward_model_held_out_figures_leave_out_the_filler_pair(reward_model_windows):
    """eval/loss, eval/accuracy, eval/chosen_score and eval/rejected_score are those of this rank's pairs alone (1, 3
    and 5 of the 7), each scored again here by the saved model's own pooling: the filler pair (a copy of pair 0)
    counts for nothing."""
    columns = ["prompt", "chosen", "rejected"]
    for recorded, _, out in reward_model_windows.values():
        tokenizer = check_tokenizer(out)
        pairs = reward_model.tokenize_pairs(plumbing.load_split(TOY_DATA, "test[:7]", columns), tokenizer,
                                            reward_model.Args(), "test[:7]")
        assert len(pairs) == 7
        model = AutoModelForSequenceClassification.from_pretrained(out).eval()
        with torch.no_grad():
            chosen, rejected = (torch.stack([model(torch.tensor([pair[side]])).logits[0, 0] for pair in pairs[1::2]])
                                for side in ("chosen", "rejected"))
        expected = {"loss": -torch.nn.functional.logsigmoid(chosen - rejected).mean().item(),
                    "accuracy": (chosen > rejected).float().mean().item(), "chosen_score": chosen.mean().item(),
                    "rejected_score": rejected.mean().item()}
        for name, value in expected.items():
            ((_, logged, _),) = recorded["logged"][f"eval/{name}"]
            assert logged == pytest.approx(value, rel=1e-4, abs=1e-5), (name, out)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a one-line error that names what to fix, before any training
# ---------------------------------------------------------------------------------------------------------------
def run_in_process(script, argv, must_stop=True):
    """`python script argv` run in this process, to the error it must stop with (or, with must_stop=False, to its
    end): the script's module runs `main(tyro.cli(Args))` on argv, as its `if __name__ == "__main__":` block does, so
    that a helper a test patches through the module (monkeypatch.setattr(ppo, NAME, ...)) is the one main calls (one
    the script imports by name, as evaluate.py's `from ppo import sample`, is patched as the script's own:
    evaluate.sample); no process start per run. Returns the message of the SystemExit it raised (None for a run that
    finished). sys.argv is the script's command line while it runs (its messages name the script from it). What the
    script changes for a one-rank run (the environment, signal handlers, sys.argv) is restored; the one-rank process
    group it starts stays for the next. Every run shares the one module object: the scripts keep no state in it from
    one run to the next."""
    saved_env, saved_argv = dict(os.environ), sys.argv
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    sys.argv = [script, *argv]
    try:
        module = importlib.import_module(os.path.splitext(os.path.basename(script))[0])
        module.main(tyro.cli(module.Args, args=argv))
    except SystemExit as stop:
        return str(stop)
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert not must_stop, f"{script} {' '.join(argv)} did not stop"


def check_errors(script, flags, cases, out):
    """Run `script flags case_flags` for each (case_flags, message) case, each with an output folder of its own under
    `out` (a case's own --output-dir comes later and wins), and check that each stopped with its one-line message.
    The first case runs as a user runs it, in a process of its own, whose last line on stderr must be the message
    with no stack trace before it; the others run in this process (run_in_process), where any other exception fails
    the test."""
    for i, (case_flags, message) in enumerate(cases):
        argv = [*flags, "--output-dir", str(out / f"case_{i}"), *case_flags]
        if i == 0:
            result = run(script, *argv, check=False)
            assert message in error_of(result) and "Traceback" not in result.stderr, (case_flags, result.stderr[-3000:])
        else:
            error = run_in_process(script, argv)
            assert message in error, (case_flags, error)


def test_sft_bad_input(bad, tmp_path, capsys):
    """sft.py's own checks, and its wiring of plumbing's (a wrong data file or model folder alone:
    test_plumbing.py)."""
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    one_file = plumbing.load_split(str(bad / "empty_prompt.jsonl"), "train", ["prompt", "chosen"])
    # What is learned: the response and its EOS, never the prompt (labels -100 there).
    (example,) = sft.tokenize_demonstrations([{"prompt": "A film, and", "chosen": " it was fine."}], tokenizer,
                                             sft.Args(), "train")
    prompt = tokenizer("A film, and").input_ids
    response = tokenizer(" it was fine.", add_special_tokens=False).input_ids
    assert example == {"input_ids": prompt + response + [tokenizer.eos_token_id],
                       "labels": [-100] * len(prompt) + response + [tokenizer.eos_token_id]}
    check_stops([
        (lambda: sft.tokenize_demonstrations(one_file, tokenizer, sft.Args(), "train"),
         "row 1 of split 'train', column 'prompt': empty text; fix or remove the row"),
        # One file is every split, and a slice of it works; here no row of it fits.
        (lambda: sft.tokenize_demonstrations(plumbing.load_split(f"{TOY_DATA}/test.jsonl", "train[:64]", ["prompt"]),
                                             tokenizer, sft.Args(max_seq_len=4), "train[:64]"),
         "no row of split 'train[:64]' fits --max-seq-len 4"),
        (lambda: sft.tokenize_demonstrations([{"prompt": "A film, and", "chosen": "ΩΩ"}], dropping_tokenizer(),
                                             sft.Args(), "train"),
         "row 0 of split 'train', column 'chosen': the response 'ΩΩ' is no token at all in this tokenizer"),
        (lambda: plumbing.check_ranges(sft.Args(learning_rate=-1.0)), "--learning-rate must be positive, not -1.0"),
        (lambda: plumbing.check_ranges(sft.Args(num_train_epochs=0)), "--num-train-epochs must be at least 1, not 0"),
        (lambda: plumbing.check_ranges(sft.Args(learning_rate=float("inf"))),
         "--learning-rate must be a finite number"),
        (lambda: plumbing.check_ranges(sft.Args(offload=True)), "--offload needs --zero-stage 1, 2 or 3"),
    ])
    check_errors("sft.py", FEW_STEPS, [
        (["--max-seq-len", "1000"], "--max-seq-len 1000 is longer than the model's 128 positions"),
        (["--per-device-train-batch-size", "100"], "64 training rows make no optimizer step of 100 sequences"),
        (["--dtype", "fp16"], "--dtype fp16 needs a GPU"),
        # The output folder is checked before any model loads: never the folder that holds the inputs.
        (["--output-dir", plumbing.TOY_TASK], f"--output-dir '{plumbing.TOY_TASK}' is or holds --model-name-or-path "
                                              f"'{BASE_MODEL}'"),
        (["--output-dir", str(bad / "a_file")], "a_file' is a file; name a folder"),
        (["--model-name-or-path", str(bad / "nan_weights")], "has weights that are not finite (inf or nan)"),
        (["--model-name-or-path", str(bad / "added_tokens")], "tokens were added to it without "
         "model.resize_token_embeddings(len(tokenizer))"),
        (["--dataset", str(bad / "data"), "--output-dir", str(bad / "data" / "sft")],
         f"is inside --dataset '{bad / 'data'}', which this run reads (its files would become part of it)"),
    ], tmp_path)
    assert sorted(os.listdir(bad / "data")) == ["test.jsonl", "train.jsonl"]
    with pytest.raises(SystemExit):
        tyro.cli(sft.Args, args=["--zero-stage", "4"])
    assert "invalid choice '4' for argument '--zero-stage'" in capsys.readouterr().err
    # On 2 ranks every rank says it (the launcher's own lines come last): 2 x 40 sequences > 64 rows.
    result = run("sft.py", *FEW_STEPS, "--per-device-train-batch-size", "40", "--output-dir", str(tmp_path / "out"),
                 ranks=2, check=False)
    assert result.returncode != 0 and "64 training rows make no optimizer step of 80 sequences" in result.stderr


def test_reward_model_bad_input(bad, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    one_prompt = tmp_path / "one_prompt"
    one_prompt.mkdir()
    for split in ("train", "test"):
        (one_prompt / f"{split}.jsonl").write_text(16 * (json.dumps(
            {"prompt": "I watched this film and", "chosen": " it was great.", "rejected": " it was bad."}) + "\n"))
    columns = ["prompt", "chosen", "rejected"]
    alike = tmp_path / "alike"  # every pair's chosen and rejected the same text: no preference to learn
    alike.mkdir()
    for split in ("train", "test"):
        write_jsonl(alike / f"{split}.jsonl", [{"prompt": "A film, and", "chosen": " fine.", "rejected": " fine."}] * 8)
    rows = [{"prompt": "A film, and", "chosen": " fine.", "rejected": " fine."},
            {"prompt": "A film, and", "chosen": " fine.", "rejected": " bad."}]
    assert len(reward_model.tokenize_pairs(rows, tokenizer, reward_model.Args(), "train")) == 1
    assert "dropped 1 of 2 pairs of split 'train' whose chosen and rejected responses are the same tokens (no " \
           "preference to learn)" in capsys.readouterr().out
    check_stops([
        (lambda: reward_model.tokenize_pairs(plumbing.load_split(str(bad / "empty_rejected.jsonl"), "train", columns),
                                             tokenizer, reward_model.Args(), "train"),
         "row 1 of split 'train', column 'rejected': empty text; fix or remove the row"),
        (lambda: reward_model.tokenize_pairs([{**rows[1], "rejected": "ΩΩ"}], dropping_tokenizer(),
                                             reward_model.Args(), "train"),
         "row 0 of split 'train', column 'rejected': the response 'ΩΩ' is no token at all in this tokenizer"),
        (lambda: reward_model.tokenize_pairs(rows[:1], tokenizer, reward_model.Args(), "train"),
         "every pair of split 'train' that fits --max-seq-len has the same chosen and rejected response: there is no "
         "preference to learn; check --chosen-column 'chosen' and --rejected-column 'rejected'"),
        (lambda: reward_model.check_args(reward_model.Args(gradient_accumulation_steps=0)),
         "--gradient-accumulation-steps must be at least 1, not 0"),
        (lambda: reward_model.check_args(reward_model.Args(normalization_samples=1)),
         "--normalization-samples must be at least 2"),
    ])
    check_errors("reward_model.py", [*FEW_STEPS, "--model-name-or-path", BASE_MODEL], [
        (["--rejected-column", "worse"], "has no column ['worse']"),
        (["--max-seq-len", "1000"], "--max-seq-len 1000 is longer than the model's 128 positions; lower it"),
        (["--max-new-tokens", "100"], "--max-seq-len 64 + --max-new-tokens 100 (a training prompt and a sampled "
                                      "response) is longer than the model's 128 positions; lower them"),
        (["--output-dir", BASE_MODEL], "is or holds --model-name-or-path"),
        (["--output-dir", str(bad / "a_file")], "a_file' is a file; name a folder"),
        (["--model-name-or-path", str(bad / "pickle_only")],
         "has no model.safetensors; only safetensors weights are loaded"),
        (["--learning-rate", "0"], "--learning-rate must be positive, not 0.0"),
        (["--dtype", "fp16"], "--dtype fp16 needs a GPU"),
        (["--model-name-or-path", str(bad / "added_tokens")], "embeds only 993: tokens were added to it without"),
        (["--dataset", str(alike)], "has the same chosen and rejected response: there is no preference to learn"),
        # One prompt, answered alike every time: every score the same, no scale to normalize by.
        (["--dataset", str(one_prompt), "--temperature", "1e-6", "--normalization-samples", "4"],
         "standard deviation 0.0: the reward model must score them finite and not all alike"),
    ], tmp_path)
    with pytest.raises(SystemExit):
        tyro.cli(reward_model.Args, args=["--zero-stage", "4"])
    assert "invalid choice '4' for argument '--zero-stage'" in capsys.readouterr().err


def test_too_long_rows_are_dropped_and_counted(tmp_path):
    result = run("sft.py", *FEW_STEPS, "--max-seq-len", "24", "--output-dir", str(tmp_path / "sft"), here=True)
    assert "longer than --max-seq-len 24" in result.stdout
    error = run_in_process("reward_model.py", [*FEW_STEPS, "--model-name-or-path", BASE_MODEL, "--max-seq-len", "4",
                                               "--output-dir", str(tmp_path / "rm")])
    assert "fits --max-seq-len 4; raise it" in error


def test_tokenizer_without_pad_token_gets_one(tmp_path):
    # The base model with a tokenizer that has no pad token, as many hub tokenizers (GPT-2, Pythia, Llama) have.
    model_dir = tmp_path / "no_pad"
    AutoModelForCausalLM.from_pretrained(BASE_MODEL).save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token is None
    result = run("sft.py", *FEW_STEPS, "--model-name-or-path", str(model_dir), "--output-dir", str(tmp_path / "sft"),
                 here=True)
    assert "no pad token distinct from EOS: added '<|pad|>'" in result.stdout
    saved = check_tokenizer(str(tmp_path / "sft"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    assert model.get_input_embeddings().num_embeddings >= len(saved)


# ---------------------------------------------------------------------------------------------------------------
# Reliability: ranks that outlive their launcher, text that spells a special token. (The user's folders, one run
# per folder, damaged or misnamed weights, data cells that are not text: plumbing's, in test_plumbing.py.)
# ---------------------------------------------------------------------------------------------------------------
def test_every_rank_stops_when_one_dies(tmp_path):
    """Rank 1 killed in the middle of training: rank 0 and the launcher end within seconds, not at a collective's
    half-hour timeout. (A killed launcher is test_ppo's kill-and-resume test.)"""
    out = tmp_path / "sft"
    process = subprocess.Popen([*launcher(2), os.path.join(ROOT, "sft.py"), *FEW_STEPS, "--num-train-epochs", "1000",
                                "--output-dir", str(out)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    for line in process.stdout:
        if "optimizer steps" in line:  # training has started
            break
    (rank_1,) = [pid for pid, command in processes_with(str(out)).items() if "--local_rank=1" in command]
    os.kill(rank_1, signal.SIGKILL)
    start = time.time()
    process.communicate(timeout=60)
    while processes_with(str(out)) and time.time() < start + 30:
        time.sleep(0.2)
    assert process.returncode != 0 and not processes_with(str(out)), processes_with(str(out))
    assert time.time() - start < 15


def processes_with(text):
    """{pid: command line} of this machine's processes whose command line holds `text`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        if text in command and int(pid) != os.getpid():
            found[int(pid)] = command
    return found


def test_text_that_spells_a_special_token_stays_text():
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    eos = tokenizer.eos_token  # "<|endoftext|>", as a web page about tokenizers may well contain
    rows = [{"prompt": f"A film about {eos} and", "chosen": f" good {eos} fun.", "rejected": " bad."}]
    (example,) = sft.tokenize_demonstrations(rows, tokenizer, sft.Args(max_seq_len=128), "train")
    (pair,) = reward_model.tokenize_pairs(rows, tokenizer, reward_model.Args(max_seq_len=128), "train")
    for ids in [example["input_ids"], pair["chosen"], pair["rejected"]]:
        assert ids.count(tokenizer.eos_token_id) == 1 and ids[-1] == tokenizer.eos_token_id  # only the one appended
    assert tokenizer.decode(example["input_ids"][:-1]).count(eos) == 2  # the text is still there, as text


def test_every_stage_takes_the_local_rank_the_deepspeed_launcher_passes():
    """deepspeed starts each rank with `--local_rank=N` (torchrun only sets LOCAL_RANK): every stage must take it."""
    for stage in (sft, reward_model, ppo):
        assert tyro.cli(stage.Args, args=["--local_rank=1"]).local_rank == 1


def test_the_bundled_defaults_are_found_from_any_working_folder():
    """A default that names a bundled file (the toy task's base model and data) is its path in the project, found
    from any working folder (the tests run in one of their own: conftest), never looked up on the hub as toy_task/..."""
    import evaluate
    bundled = {(stage.__name__, field.name): field.default for stage in (sft, reward_model, ppo, evaluate)
               for field in dataclasses.fields(stage.Args) if "toy_task" in str(field.default)}
    assert set(bundled) >= {("sft", "model_name_or_path"), ("sft", "dataset"), ("reward_model", "dataset"),
                            ("ppo", "dataset"), ("evaluate", "dataset")}
    for name, default in bundled.items():
        assert os.path.isabs(default) and os.path.exists(default) and not plumbing.is_hub_name(default), (name, default)


# ---------------------------------------------------------------------------------------------------------------
# What runs on a CPU must run on a GPU
# ---------------------------------------------------------------------------------------------------------------
def one_rank_process_group(monkeypatch):
    """A process group of this process alone, as a stage run here (run_in_process) leaves one, for the collectives of
    the helpers called in-process."""
    if not torch.distributed.is_initialized():
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=free_port()).items():
            monkeypatch.setenv(name, value)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as plumbing.init_distributed on a CPU
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def test_stage_helpers_make_their_tensors_where_their_inputs_are(monkeypatch):
    """On a GPU a tensor made without device= lands on the CPU and stops the run where it meets the model's tensors
    (reward_model.evaluate did so at its first held-out batch). Here the stages' evaluation, statistics, rollout and
    update helpers run on models and batches in CPU memory while torch's default device is `meta`: a tensor made
    without the device of what it meets is then a meta tensor, and the first operation that joins it with theirs
    fails, as it would on CUDA. The inputs are made before, as the stages make them on the CPU before moving them."""
    one_rank_process_group(monkeypatch)
    cpu = torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(BASE_MODEL).eval()
    scorer = AutoModelForSequenceClassification.from_pretrained(BASE_MODEL, num_labels=1).eval()
    engine = types.SimpleNamespace(module=scorer, eval=scorer.eval, train=scorer.train)
    actor = types.SimpleNamespace(module=policy)
    texts = ["I watched this film and", "The story was", "A film about a dog that"]
    demonstrations = sft.tokenize_demonstrations([{"prompt": t, "chosen": " it was good."} for t in texts], tokenizer,
                                                 sft.Args(), "test")
    pairs = reward_model.tokenize_pairs([{"prompt": t, "chosen": " good.", "rejected": " bad."} for t in texts],
                                        tokenizer, reward_model.Args(), "test")
    # Each batch with a copy that counts for nothing, as plumbing.rank_share fills a short share: the figures must be
    # those of the batch alone.
    no_label = {**demonstrations[0], "labels": [-100] * len(demonstrations[0]["labels"])}
    sft_batches = [sft.collate([*demonstrations, no_label], tokenizer.pad_token_id)]
    pair_batches = [reward_model.collate([*pairs, {**pairs[0], "counted": False}], tokenizer.pad_token_id)]
    alone = (sft.evaluate(policy, [sft.collate(demonstrations, tokenizer.pad_token_id)], cpu),
             reward_model.evaluate(engine, [reward_model.collate(pairs, tokenizer.pad_token_id)], cpu))
    padded = tokenizer.pad({"input_ids": [tokenizer(t)["input_ids"] for t in texts]}, return_tensors="pt")
    args = ppo.Args(world_size=1, batch_size=3, num_iterations=2, gradient_accumulation_steps=1,
                    per_device_train_batch_size=2, target_kl=0.1)
    config = ppo.sampling_config(tokenizer, 6, 1.0)
    sampler = fast_sampling.static_sampler(actor, config, False, ppo.Args(max_prompt_len=12,
                                                                          per_device_rollout_batch_size=3),
                                           cpu)  # made before: transformers' StaticCache makes a tensor without device=
    with torch.device("meta"):
        assert sft.evaluate(policy, sft_batches, cpu) == pytest.approx(alone[0], rel=1e-6)
        assert reward_model.evaluate(engine, pair_batches, cpu) == pytest.approx(alone[1], rel=1e-6)
        # ppo.py's rollout, as its loop calls the helpers
        P = padded["input_ids"].shape[1]
        assert fast_sampling.sample_static(sampler, policy, padded["input_ids"], padded["attention_mask"],
                                           config).device == cpu
        responses = ppo.sample(policy, padded["input_ids"], padded["attention_mask"], config, False)
        response_mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
        sequences = torch.cat([padded["input_ids"], responses], dim=1)
        attention_mask = torch.cat([padded["attention_mask"], response_mask], dim=1)
        logprobs = ppo.in_micro_batches(ppo.response_logprobs, 2, policy, sequences, attention_mask, P, 1.0)
        values = ppo.in_micro_batches(ppo.critic_values, 2, scorer, sequences, attention_mask, P, 0.5, 2.0)
        scores = ppo.in_micro_batches(ppo.reward_scores, 2, scorer, sequences, attention_mask, P, 0.5, 2.0,
                                      tokenizer, tokenizer)  # decoded and tokenized again, as for another tokenizer
        ppo.check_finite_rollout(response_mask, logprobs, logprobs, values, scores, 0, 0)
        valid = response_mask.sum(dim=1) >= 1
        rewards, kl = rlhf_math.per_token_rewards(scores, logprobs, logprobs - 0.1, response_mask, 0.05, 5.0, "k3")
        rewards = rlhf_math.masked_whiten(rewards, response_mask, shift_mean=False,
                                          stats=ppo.batch_mean_var(rewards, response_mask, across_ranks=True))
        advantages, returns = rlhf_math.gae_advantages_and_returns(rewards, values, response_mask, 1.0, 0.95)
        advantages = rlhf_math.masked_whiten(advantages, response_mask,
                                             stats=ppo.batch_mean_var(advantages, response_mask, across_ranks=False))
        # ... and its update, one micro-batch
        mini_batches = torch.randperm(3, device=cpu).split(3)
        tokens = ppo.tokens_per_mini_batch(response_mask, mini_batches)
        new_logits = ppo.response_logits(policy, sequences, attention_mask, P)
        new_logprobs = rlhf_math.logprobs_from_logits(new_logits, sequences[:, P:], 1.0)
        pg_loss, pg_stats = rlhf_math.policy_loss(new_logprobs, logprobs, advantages, response_mask, 0.2)
        vf_loss, vf_clipfrac = rlhf_math.value_loss(values + 0.1, values, returns, response_mask, 0.2)
        ppo.check_update(new_logprobs, {"mask": response_mask, "logprobs": logprobs}, pg_loss, vf_loss, False, 0, args)
        assert torch.isfinite(ppo.loss_weight(response_mask, tokens[0], args) * pg_loss)
        sums = ppo.new_update_sums(cpu)
        ppo.add_update_sums(sums, new_logits, response_mask, pg_loss, vf_loss, pg_stats, vf_clipfrac, args)
        rollout = dict(kl=kl, scores=scores, valid=valid, logprobs=logprobs, mask=response_mask, kl_coef=0.05,
                       response_mask=response_mask, contains_eos=(responses == tokenizer.eos_token_id).any(dim=1))
        times = {"eps": 1.0, "time/rollout": 1.0, "time/generation": 1.0, "time/update": 1.0}
        metrics = ppo.iteration_metrics(sums, rollout, 1e-5, 0, times, args)
        assert math.isfinite(metrics["objective/kl"]) and ppo.adapted_kl_coef(0.05, kl, valid, args) > 0
