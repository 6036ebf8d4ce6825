"""Stage 3 runs for real, for a few iterations, on the bundled toy task: on 2 ranks with the actor under ZeRO-3 and
with ZeRO-0, with the k3 KL estimator and the EOS trick, and killed then resumed. The stage-1 and stage-2 checkpoints
it starts from are trained here for a few steps first.
"""

import contextlib
import copy
import dataclasses
import functools
import glob
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import types

import pytest
import safetensors.torch
import torch
import tyro
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig)

import benchmark
import evaluate
import fast_sampling
import plumbing
import ppo
import reward_model
import rlhf_math
import sft
from ppo import response_logits
from test_architectures import ARCHITECTURES
# bad is a pytest fixture, used by name
from test_plumbing import (BASE_MODEL, HH_ROW, TOY_DATA, bad, check_stops, full_disk, never_waits_on,  # noqa: F401
                           write_jsonl)
from test_sft_and_reward_model import (ENV, ROOT, check_errors, free_port, launcher, processes_with, run,
                                       run_in_process)

# 2 iterations of 8 prompts per rank; PPO splits each rank's 8 into 2 mini-batches of 2 forward passes of 2.
FEW_ITERATIONS = ["--per-device-rollout-batch-size", "8", "--num-mini-batches", "2",
                  "--per-device-train-batch-size", "2", "--num-ppo-epochs", "2", "--max-new-tokens", "12",
                  "--sample-every", "1"]


def run_ppo(stages, out, *flags, ranks=None, check=True, here=False):
    exp_name = f"test_{os.path.basename(out)}"
    for old in glob.glob(f"runs/{exp_name}__*"):
        shutil.rmtree(old)
    result = run("ppo.py", *stages, *FEW_ITERATIONS, "--output-dir", str(out), "--exp-name", exp_name, *flags,
                 ranks=ranks, check=check, here=here)
    return result, exp_name


def ppo_error(stages, out, *flags):
    """The one-line error ppo.py stops with, run in this process (run_in_process) with run_ppo's flags."""
    exp_name = f"test_{os.path.basename(out)}"
    error = run_in_process("ppo.py", [*stages, *FEW_ITERATIONS, "--output-dir", str(out), "--exp-name", exp_name,
                                      *flags])
    for old in glob.glob(f"runs/{exp_name}__*"):
        shutil.rmtree(old)
    return error


def read_metrics(exp_name):
    """Every metrics.jsonl line of the runs of this experiment, oldest run first."""
    lines = []
    for path in sorted(glob.glob(f"runs/{exp_name}__*/metrics.jsonl")):
        lines += [json.loads(line) for line in open(path)]
        shutil.rmtree(os.path.dirname(path))
    return lines


def check_metrics(metrics, iterations):
    assert [m["iteration"] for m in metrics] == list(range(1, iterations + 1))
    for m in metrics:
        for name in ["eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                     "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
                     "loss/value_avg", "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var",
                     "val/num_eos_tokens", "lr", "episode", "time/rollout", "time/update", "memory/max_allocated_gb"]:
            assert math.isfinite(m[name]), f"{name} = {m[name]}"


def check_actor_trained(out, stages):
    sft_path = stages[1]
    actor = AutoModelForCausalLM.from_pretrained(os.path.join(out, "actor"))
    sft = AutoModelForCausalLM.from_pretrained(sft_path)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "actor"))
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    changed = [name for name, p in actor.state_dict().items() if not torch.equal(p, sft.state_dict()[name])]
    assert changed, "the saved actor equals the SFT model"
    assert all(p.shape == sft.state_dict()[n].shape for n, p in actor.state_dict().items())  # gathered, not shards


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_generation_and_forward_log_probs_agree(model_type):
    """The log-probs ppo.py computes by a forward pass over prompt + response are those of the distribution the
    response was sampled from with ppo.sampling_config: same positions (left padding, the shift by one), same
    temperature, in every family. ppo.sample draws the tokens generate draws from the same seed."""
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL, padding_side="left")
    model, _ = tiny_models(model_type, tokenizer)
    prompts = tokenizer(["I watched this film last night and", "We saw it"], padding=True, return_tensors="pt")
    torch.manual_seed(0)
    config = ppo.sampling_config(tokenizer, max_new_tokens=8, temperature=0.7)
    config.eos_token_id = None  # all 8 tokens, whatever the random model samples
    out = model.generate(**prompts, generation_config=config, output_logits=True, output_scores=True,
                         return_dict_in_generate=True)
    P = prompts["input_ids"].shape[1]
    responses = out.sequences[:, P:]
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(ppo.sample(model, prompts["input_ids"], prompts["attention_mask"], config, False), responses)
    sampled_logprobs = rlhf_math.logprobs_from_logits(torch.stack(out.logits, dim=1), responses, temperature=0.7)
    # What ppo.sampling_config samples from: the logits at the temperature, the pad token suppressed, nothing else.
    expected_scores = torch.stack(out.logits, dim=1) / 0.7
    expected_scores[..., tokenizer.pad_token_id] = -math.inf
    torch.testing.assert_close(torch.stack(out.scores, dim=1), expected_scores)
    attention_mask = torch.cat([prompts["attention_mask"], torch.ones_like(responses)], dim=1)
    with torch.no_grad():
        logits = response_logits(model, out.sequences, attention_mask, P)
    forward_logprobs = rlhf_math.logprobs_from_logits(logits, responses, temperature=0.7)
    torch.testing.assert_close(forward_logprobs, sampled_logprobs, atol=1e-4, rtol=1e-4)


def tiny_models(model_type, tokenizer):
    """A random causal LM and a random 1-label classifier of this family (test_architectures.py's tiny shapes)."""
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), num_labels=1,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=tokenizer.bos_token_id, **ARCHITECTURES[model_type])
    torch.manual_seed(0)
    return (AutoModelForCausalLM.from_config(config).eval(),
            AutoModelForSequenceClassification.from_config(config).eval())


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_logprobs_values_and_scores_of_a_padded_batch_are_those_of_each_row_alone(model_type):
    """ppo.py's forward passes over a left-padded batch of prompt + response (ending in EOS, then pad) give, at every
    response position, what the model gives for that row alone, unpadded: log pi(a_t|s_t) and V(s_t) from the outputs
    one position before a_t, and the score at the EOS, which here is the classifier's own pooled output."""
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL, padding_side="left")
    policy, classifier = tiny_models(model_type, tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [("I watched this film last night and", " the story was good."),
            ("We saw it, and", " although the plot was dull, the ending was truly superb."),
            ("My sister recommended this romantic comedy, and I have to say", " the cast was bad.")]
    prompts = [tokenizer(prompt)["input_ids"] for prompt, _ in rows]
    responses = [tokenizer(response)["input_ids"] + [eos] for _, response in rows]
    P, R = max(map(len, prompts)), max(map(len, responses)) + 2  # every response ends in pad
    sequences = torch.tensor([[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(prompts, responses)])
    attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r))
                                   for p, r in zip(prompts, responses)])
    with torch.no_grad():
        logprobs = ppo.response_logprobs(policy, sequences, attention_mask, P, temperature=0.7)
        values = ppo.critic_values(classifier, sequences, attention_mask, P, mean=0.5, std=2.0)
        scores = ppo.reward_scores(classifier, sequences, attention_mask, P, mean=0.5, std=2.0)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            alone = torch.tensor([prompt + response])
            p, r = len(prompt), len(response)
            # the logits at p - 1 + t predict response token t
            expected = torch.log_softmax(policy(alone).logits[0, p - 1 : -1] / 0.7, dim=-1)[torch.arange(r), response]
            torch.testing.assert_close(logprobs[i, :r], expected, rtol=1e-5, atol=1e-5)
            hidden = getattr(classifier, classifier.base_model_prefix)(alone).last_hidden_state
            head = classifier.score(hidden)[0, :, 0]
            torch.testing.assert_close(values[i, :r], (head[p - 1 : -1] - 0.5) / 2.0, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(scores[i], (classifier(alone).logits[0, 0] - 0.5) / 2.0, rtol=1e-5, atol=1e-5)


def test_offload_bf16_and_gradient_checkpointing(stages, tmp_path):
    # --offload puts actor and critic optimizer states in CPU memory (ZeRO-2 and ZeRO-1 here: ZeRO-0 offloads nothing);
    # the frozen models' own offload runs them under ZeRO-3 with their parameters in CPU memory.
    result, exp_name = run_ppo(stages, tmp_path / "offload", "--total-episodes", "16", "--offload",
                               "--actor-zero-stage", "2", "--critic-zero-stage", "1",
                               "--offload-reference-model", "--offload-reward-model", "--dtype", "bf16",
                               "--actor-gradient-checkpointing", "--critic-gradient-checkpointing", here=True)
    check_metrics(read_metrics(exp_name), 2)
    check_actor_trained(tmp_path / "offload", stages)


def run_metrics(out):
    """The metrics.jsonl lines of the run in `out` (its one file, across resumes); a line cut short by a kill is
    skipped."""
    lines = []
    for line in open(plumbing.read_record(str(out))["metrics_file"]):
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    return lines


def kill_after_checkpoint(stages, out, exp_name, flags, ranks, sig):
    """Start ppo.py (with --resume when a checkpoint exists), wait until it has completed a checkpoint of its own,
    then send `sig` to the process we started: on 2 ranks the launcher alone, whose ranks must then stop by
    themselves within seconds. Returns the iteration of the checkpoint and the iterations logged so far."""
    marker = out / "resume" / "latest"
    before = marker.read_text() if marker.exists() else None
    command = [sys.executable, os.path.join(ROOT, "ppo.py"), *stages, *FEW_ITERATIONS, *flags, "--output-dir",
               str(out), "--exp-name", exp_name] + (["--resume"] if before else [])
    if ranks:
        command[0:2] = [*launcher(ranks), os.path.join(ROOT, "ppo.py")]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while (not marker.exists() or marker.read_text() == before) and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(sig)
    killed = time.time()
    stderr = process.communicate()[1].decode()  # returns once every rank has closed its end of the pipe
    while processes_with(str(out)) and time.time() < killed + 30:
        time.sleep(0.2)
    assert not processes_with(str(out)) and time.time() - killed < 15, "a rank outlived its launcher"
    if ranks:  # a line from each rank that saw it first (the other may be stopped by launch.py), no stack trace
        said = [f"rank {rank}: the launcher that started this rank is gone" in stderr for rank in range(ranks)]
        assert any(said) and stderr.count("the launcher that started this rank is gone") == sum(said), stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
    assert marker.exists() and marker.read_text() != before, stderr[-3000:]
    assert not (out / "actor").exists(), f"the run finished before it could be killed:\n{stderr[-3000:]}"
    return int(marker.read_text().removeprefix("iteration_")), [m["iteration"] for m in run_metrics(out)]


# One actor optimizer step per iteration, of one forward pass: the snapshots of every iteration are the actor's weight
# history.
ONE_STEP_PER_ITERATION = ["--num-mini-batches", "1", "--num-ppo-epochs", "1", "--per-device-train-batch-size", "8",
                          "--snapshot-every", "1"]


@pytest.mark.parametrize("ranks, sigs, flags", [
    (None, [signal.SIGTERM, signal.SIGKILL], ["--enable-ema", "--actor-lora-dim", "4", "--critic-lora-dim", "4",
                                              "--only-optimize-lora", "--target-kl", "0.01", "--kl-horizon", "100"]),
    (2, [signal.SIGKILL], ["--actor-zero-stage", "3", "--critic-zero-stage", "2", "--enable-ema", "--ema-decay", "0.5",
                           "--unsup-dataset", f"{plumbing.TOY_TASK}/pretrain.txt", "--actor-lora-dim", "4",
                           "--critic-lora-dim", "4", *ONE_STEP_PER_ITERATION]),
])
def test_killed_run_resumes_to_the_same_metrics(stages, tmp_path, monkeypatch, ranks, sigs, flags):
    """Killed after a checkpoint, a run loses at most --save-every iterations, and --resume repeats exactly what the
    uninterrupted run did: optimizer moments and step counts, learning rates and the KL coefficient included, and
    the EMA, the LoRA adapters (on one rank trained alone, --only-optimize-lora, the rest frozen) and the adaptive KL
    coefficient end where they would have (on two ranks with the actor
    under ZeRO-3, the critic's LoRA under ZeRO-2 and the pretraining mix, the EMA checked against the actor's weight
    history too: check_ema; the state in fp16 and bf16: test_mixed_precision_resume_keeps_master_weights_and_scale).
    On one rank the latest checkpoint is then damaged, and the resume falls back to the one before it. Killed in one
    project folder, the run resumes after the folder has moved, its data set named where it is now: it keeps one
    metrics file, the moved folder's runs/RUN_NAME/metrics.jsonl, with every iteration logged once."""
    iterations = 6 if len(sigs) > 1 else 4  # of 8 prompts per rank; a checkpoint every 2, one killed per signal
    flags = ["--total-episodes", str(8 * iterations * (ranks or 1)), "--save-every", "2", "--sample-every", "0", *flags]
    out = tmp_path / "straight"
    _, exp_name = run_ppo(stages, out, *flags, ranks=ranks)
    uninterrupted = read_metrics(exp_name)
    check_metrics(uninterrupted, iterations)
    check_actor_trained(out, stages)
    if "--snapshot-every" in flags:
        check_ema(out, stages, uninterrupted, decay=float(flags[flags.index("--ema-decay") + 1]))

    project, exp_name, done = tmp_path / "project", f"test_killed_{ranks}", 0
    shutil.copytree(TOY_DATA, project / "data")
    monkeypatch.chdir(project)  # the run's working folder: its logs go to runs/ there
    out = project / "killed"
    for sig in sigs:
        checkpoint, logged = kill_after_checkpoint(stages, out, exp_name, [*flags, "--dataset", str(project / "data")],
                                                   ranks, sig)
        assert logged == list(range(1, logged[-1] + 1)) and checkpoint <= logged[-1] < checkpoint + 2, logged
        done = checkpoint
    # Checkpoints are safetensors and JSON, nothing pickled. The last two complete ones are kept (a kill can land
    # after `latest` names the new one and before the oldest is deleted: it may remain until the next checkpoint).
    files = sorted(str(p.relative_to(out / "resume")) for p in (out / "resume").rglob("*") if p.is_file())
    assert {os.path.splitext(f)[1] for f in files} <= {".safetensors", ".json", ""}, files
    folders = {f.split(os.sep)[0] for f in files} - {"latest"}
    assert f"iteration_{done}" in folders and all(int(f.removeprefix("iteration_")) <= done for f in folders), files
    if len(sigs) > 1:  # the latest checkpoint damaged: the one before it is used, with a message
        assert f"iteration_{done - 2}" in folders
        weights = out / "resume" / f"iteration_{done}" / "actor" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        done -= 2
    monkeypatch.chdir(tmp_path)
    shutil.move(project, tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    out = tmp_path / "moved" / "killed"

    # (--trace-every, which --resume may change, changes nothing the run computes: the metrics below stay the same.)
    result = run("ppo.py", *stages, *FEW_ITERATIONS, *flags, "--dataset", str(tmp_path / "moved" / "data"),
                 "--output-dir", str(out), "--exp-name", exp_name, "--resume", "--trace-every", "1", ranks=ranks)
    assert f"resumed from {out / 'resume' / f'iteration_{done}'} at iteration {done}" in result.stdout
    assert f"iteration {iterations}: response" in result.stdout and "position by position" in result.stdout
    if len(sigs) > 1:
        assert f"cannot resume from {out / 'resume' / f'iteration_{done + 2}'} (actor/model.safetensors" in result.stdout
    assert sorted(os.listdir(out / "resume")) == [f"iteration_{iterations - 2}", f"iteration_{iterations}", "latest"]
    resumed = run_metrics(out)
    assert [m["iteration"] for m in resumed] == list(range(1, iterations + 1))  # one file, each iteration once
    record = plumbing.read_record(str(out))
    assert record["metrics_file"] == str(tmp_path / "moved" / "runs" / record["run_name"] / "metrics.jsonl")
    for after in resumed:
        before = uninterrupted[after["iteration"] - 1]
        for name in ["objective/scores", "objective/kl", "objective/kl_coef", "loss/policy_avg", "loss/value_avg",
                     "lr"]:
            assert after[name] == pytest.approx(before[name], rel=1e-5, abs=1e-6), (after["iteration"], name)
    for folder in ["actor", "actor_ema"]:
        straight, resumed = saved_weights(tmp_path / "straight" / folder), saved_weights(out / folder)
        for name in straight:
            torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-5)
    shutil.rmtree(os.path.dirname(plumbing.read_record(str(out))["metrics_file"]))


NO_TENSORBOARD = types.SimpleNamespace(log_dir="runs/x")  # in place of tensorboard, in tests of the run's files


def test_resume_continues_only_the_run_it_claims(tmp_path, monkeypatch):
    """--resume continues the unfinished run of its output folder with its settings; a new run never silently takes
    the place of an unfinished one. (In-process: start_run only reads and writes files. The output folder is claimed
    for the running script, sys.argv[0]: here ppo.py.)"""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    out = tmp_path / "out"
    args = ppo.Args(output_dir=str(out), exp_name="test_start_run", save_every=2, world_size=1, batch_size=64)

    def start(**changes):
        (out / ".lock").unlink(missing_ok=True)  # the lock of the run before, which has ended
        return ppo.new_or_resumed_run(dataclasses.replace(args, **changes))

    def begin(run, **changes):  # what plumbing.start_logging does once every input has loaded: the run's record
        monkeypatch.setattr(plumbing.checkpoints, "start_tensorboard", lambda *_, **__: NO_TENSORBOARD)
        plumbing.start_logging(run, 0, dataclasses.replace(args, **changes), [])[1].close()

    first = start()
    assert "run_name" not in plumbing.read_record(str(out))  # nothing of the run is written before its inputs load
    begin(first)
    record = plumbing.read_record(str(out))
    assert record["run_name"] == first["run_name"] and not record["finished"] and first["checkpoints"] == []
    (out / "resume" / "iteration_2").mkdir(parents=True)  # a checkpoint as ppo.py writes it (its state.json here)
    state = {"iteration": 2, "kl_coef": 0.1, "actor": {}, "critic": {}, "args": dataclasses.asdict(args),
             "run_name": first["run_name"]}
    plumbing.write_json(str(out / "resume" / "iteration_2" / "state.json"), state)
    (out / "resume" / "latest").write_text("iteration_2")
    check_stops([
        (lambda: start(), "holds checkpoints of an unfinished run (iteration_2): continue it with --resume, or pass "
                          "--overwrite to start a new run, which deletes them"),
        (lambda: start(resume=True, kl_coef=0.05, actor_learning_rate=1e-3),
         "--resume: the run was started with other settings: --kl-coef 0.1 (now 0.05), --actor-learning-rate 0.0002 "
         "(now 0.001); resume with its settings (only how a run is saved, logged, sampled or laid out in memory may "
         "change)"),
        (lambda: start(resume=True, world_size=2, batch_size=128),
         "--resume: the run was started with other settings: the number of ranks 1 (now 2); resume with its settings"),
        (lambda: start(resume=True, output_dir=str(tmp_path / "empty")), "--resume: no run of ppo.py in"),
    ])
    resumed = start(resume=True, save_every=4, sample_every=0, actor_zero_stage=3, sampler="static")  # may change
    assert resumed == {**first, "checkpoints": [str(out / "resume" / "iteration_2")]}
    # A run recorded with DeepSpeed's hybrid engine, which ppo.py no longer has, cannot continue (no version here can):
    # a new run can.
    plumbing.write_json(str(out / "resume" / "iteration_2" / "state.json"),
                        {**state, "args": {**state["args"], "enable_hybrid_engine": True, "inference_tp_size": 1}})
    check_stops([(lambda: start(resume=True), "--resume: the run was started with --enable-hybrid-engine, which "
                  "ppo.py no longer has, and no run can continue without it; start a new run with --overwrite, or name "
                  "another --output-dir")])
    plumbing.write_json(str(out / "resume" / "iteration_2" / "state.json"),
                        {**state, "args": {**state["args"], "enable_hybrid_engine": False}})
    assert start(resume=True)["run_name"] == first["run_name"]  # recorded with it off: as if it had never been
    # The folder moved elsewhere: the run continues where it now is.
    shutil.move(out, tmp_path / "moved")
    (tmp_path / "moved" / ".lock").unlink()
    moved = ppo.new_or_resumed_run(dataclasses.replace(args, resume=True, output_dir=str(tmp_path / "moved")))
    assert moved["run_name"] == first["run_name"]
    assert moved["checkpoints"] == [str(tmp_path / "moved" / "resume" / "iteration_2")]
    shutil.move(tmp_path / "moved", out)
    plumbing.write_json(str(out / "training_run.json"), {**plumbing.read_record(str(out)), "finished": True})
    check_stops([(lambda: start(resume=True), "has finished all its iterations; nothing to resume")])
    plumbing.write_json(str(out / "training_run.json"), {**plumbing.read_record(str(out)), "finished": False})
    # A new run in its place: the earlier run's record and checkpoint stay until the new run writes its own (a run
    # that stops on a typo deletes nothing); a checkpoint of another run is never resumed from.
    second = start(overwrite=True, exp_name="test_start_run_2")
    assert second["checkpoints"] == [] and plumbing.read_record(str(out))["run_name"] == first["run_name"]
    begin(second, overwrite=True, exp_name="test_start_run_2")
    assert plumbing.read_record(str(out))["run_name"] == second["run_name"]
    assert (out / "resume" / "iteration_2").exists()
    check_stops([(lambda: start(resume=True, exp_name="test_start_run_2"), "--resume: no complete checkpoint")])
    plumbing.remove_earlier_runs(str(out / "resume"), second["run_name"], plumbing.read_state)  # at its first one
    assert os.listdir(out / "resume") == ["latest"]
    # At its first snapshot: the earlier run's snapshot goes, a folder of the user's that no run wrote stays.
    (out / "snapshots" / "iteration_1").mkdir(parents=True)
    plumbing.write_json(str(out / "snapshots" / "iteration_1" / plumbing.RECORD), {"run_name": first["run_name"]})
    (out / "snapshots" / "mine").mkdir()
    plumbing.remove_earlier_runs(str(out / "snapshots"), second["run_name"], plumbing.read_record)
    assert os.listdir(out / "snapshots") == ["mine"]
    for run_name in {first["run_name"], second["run_name"]}:
        shutil.rmtree(os.path.join("runs", run_name))


def made_up_checkpoint(out, run_name, args):
    """OUT/resume/iteration_2 as --resume reads it before any model loads: a state.json of RUN_NAME's, with ARGS."""
    (out / "resume" / "iteration_2").mkdir(parents=True)
    plumbing.write_json(str(out / "resume" / "iteration_2" / "state.json"), {
        "iteration": 2, "kl_coef": 0.1, "actor": {}, "critic": {}, "args": dataclasses.asdict(args),
        "run_name": run_name})


def test_a_run_trusts_no_path_its_output_folder_names(tmp_path, monkeypatch, capsys):
    """--resume continues runs/RUN_NAME/metrics.jsonl of the working folder (up to its checkpoint), whatever file the
    folder's record names, which stays as it was; a record whose run name is none that a run writes stops it. Runs
    started in the same second log apart. The trace file is checked writable before the first iteration and at every
    trace, and a trace that finds no response of the kind asked for says so."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    monkeypatch.setattr(plumbing.checkpoints, "start_tensorboard", lambda *_, **__: NO_TENSORBOARD)
    out = tmp_path / "out"
    args = ppo.Args(output_dir=str(out), exp_name="test_untrusted", save_every=2, world_size=1, batch_size=64)
    for old in glob.glob("runs/test_untrusted__*"):  # left by a run of this test that failed
        shutil.rmtree(old)

    def start(**changes):
        (out / ".lock").unlink(missing_ok=True)  # the lock of the run before, which has ended
        return ppo.new_or_resumed_run(dataclasses.replace(args, **changes))

    first = start()
    plumbing.start_logging(first, 0, args, [])[1].close()
    made_up_checkpoint(out, first["run_name"], args)
    record, notes = plumbing.read_record(str(out)), tmp_path / "notes.jsonl"
    notes.write_text("the user's\n")
    plumbing.write_json(str(out / plumbing.RECORD), {**record, "metrics_file": str(notes)})
    resumed = start(resume=True)
    assert resumed["metrics_file"] == first["metrics_file"]
    plumbing.start_logging(resumed, 2, dataclasses.replace(args, resume=True), [])[1].close()
    assert notes.read_text() == "the user's\n"
    plumbing.write_json(str(out / plumbing.RECORD), {**record, "run_name": "../elsewhere"})
    check_stops([(lambda: start(resume=True), f"--resume: {out / plumbing.RECORD} is damaged (its run_name is not one "
                                              "ppo.py writes); start a new run with --overwrite")])
    plumbing.write_json(str(out / plumbing.RECORD), {**record, "run_name": ["../elsewhere"]})  # no record of ours
    # (The folder holds ppo.py's checkpoint, which --overwrite would replace: said so, not that it holds none.)
    check_stops([(lambda: start(resume=True), f"--output-dir '{out}' holds output of ppo.py (resume/iteration_2), "
                  "but its training_run.json is missing or damaged, so no run can continue it: name another "
                  "--output-dir, or pass --overwrite to start a new run there")])
    # Two new runs in the same second: each its own runs/ folder.
    monkeypatch.setattr(plumbing.time, "time", lambda: 1700000000.5)
    names = [start(overwrite=True)["run_name"] for _ in range(2)]
    assert names == ["test_untrusted__1__1700000000", "test_untrusted__1__1700000000_2"]
    # A trace.jsonl that cannot be written (here a folder of that name) stops the run with one line, at the start
    # and at a trace.
    trace = os.path.join("runs", names[1], "trace.jsonl")
    os.mkdir(trace)
    run = {"run_name": names[1], "metrics_file": os.path.abspath(os.path.join("runs", names[1], "metrics.jsonl")),
           "inputs": {}, "models": {}}
    cannot = f"'{os.path.abspath(trace)}' (Is a directory); a folder is in its place: move it away"
    check_stops([(lambda: plumbing.start_logging(run, 0, args, ["trace.jsonl"]), cannot)])
    monkeypatch.setattr(ppo.dist, "get_rank", lambda: 0)
    pad, eos = 0, 1
    responses = torch.tensor([[5, eos, pad], [6, eos, pad]])  # both stopped with EOS: none was cut at the limit
    rollout = {name: torch.zeros(2, 3) for name in ["logprobs", "ref_logprobs", "kl", "rewards", "values",
                                                     "gae_advantages", "advantages", "returns"]}
    rollout.update(sequences=torch.cat([torch.full((2, 2), 7), responses], dim=1), P=2, scores=torch.zeros(2),
                   mask=torch.tensor([[1, 1, 0], [1, 1, 0]]), contains_eos=torch.tensor([True, True]))
    trace_args = dataclasses.replace(args, trace_every=1, trace_response="cut")
    tokenizer = types.SimpleNamespace(pad_token_id=pad, decode=lambda ids: str(ids))
    first_logprobs = torch.full((2, 3), -1.0)

    def trace_one():
        ppo.trace_response(0, tokenizer, first_logprobs, rollout, run, trace_args)

    check_stops([(trace_one, cannot)])
    os.rmdir(trace)
    capsys.readouterr()
    trace_one()
    assert "iteration 1: no response of rank 0 in the update was cut at the length limit (--trace-response cut): " \
           "the trace shows the first" in capsys.readouterr().out
    assert [json.loads(line)["row"] for line in open(trace)] == [0, 0, 0]
    # Row 0 cut at the limit, row 1 stopped with an EOS in the last place it had: the one that stopped is row 1.
    rollout.update(sequences=torch.tensor([[7, 7, 5, 8, 9], [7, 7, 6, 8, eos]]), mask=torch.ones(2, 3),
                   contains_eos=torch.tensor([False, True]))
    for trace_args.trace_response, row in [("stopped", 1), ("cut", 0)]:
        trace_one()
        assert json.loads(open(trace).readlines()[-1])["row"] == row
    for name in {first["run_name"], *names}:
        shutil.rmtree(os.path.join("runs", name))


def test_a_normalization_record_of_another_shape_is_said_to_differ(monkeypatch, capsys):
    """A reward model's config.json is input too: a reward_normalization that is not reward_model.py's (not a dict, or
    one with settings missing) is said to differ from this run's, instead of a KeyError or an AttributeError."""
    monkeypatch.setattr(ppo.dist, "get_rank", lambda: 0)
    for measured in (["a list"], {"policy": "elsewhere"}):
        config = types.SimpleNamespace(reward_normalization=measured, reward_mean=0.0, reward_std=1.0)
        ppo.check_normalization(config, "identity", ppo.Args())
        policy = measured.get("policy") if isinstance(measured, dict) else None
        assert "were measured on other responses: --actor-model-name-or-path 'checkpoints/sft' (measured on " \
               f"{policy!r}); --temperature 1.0 (measured with None)" in capsys.readouterr().out


def test_a_model_folder_written_while_the_run_loads_stops_it(tmp_path, monkeypatch):
    """sft.py writing the SFT folder while ppo.py starts from it: the model folders are fingerprinted before anything
    loads (start_run) and again once all has loaded (start_logging), and a change stops the run with one line before
    it logs, instead of training from a model its record does not name."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    monkeypatch.setattr(plumbing.checkpoints, "start_tensorboard", lambda *_, **__: NO_TENSORBOARD)
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.json").write_text("{}")
    (sft / "model.safetensors").write_bytes(b"1" * 1000)
    args = ppo.Args(output_dir=str(tmp_path / "out"), exp_name="test_changed", world_size=1, batch_size=64,
                    actor_model_name_or_path=str(sft))
    run = ppo.new_or_resumed_run(args)
    (sft / "model.safetensors").write_bytes(b"2" * 1000)  # sft.py's save, as the models load
    check_stops([(lambda: plumbing.start_logging(run, 0, args, []), f"--actor-model-name-or-path '{sft}' changed "
                  "while this run loaded it (is a run writing into it?); run again once the folder is written")])
    assert "run_name" not in plumbing.read_record(str(tmp_path / "out"))  # nothing of the run written
    shutil.rmtree(os.path.join("runs", run["run_name"]))


def test_resume_knows_the_models_by_their_content_not_their_paths(tmp_path, monkeypatch):
    """--resume finds the run's models moved or named another way, and refuses a model put in the place of one (the
    reference and the reward model are read from their folders again)."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    monkeypatch.setattr(plumbing.checkpoints, "start_tensorboard", lambda *_, **__: NO_TENSORBOARD)
    for name in ["sft", "rm"]:  # model folders as far as identity goes: a config and a weights file
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(os.urandom(3 * 2**20))
    out = tmp_path / "out"
    args = ppo.Args(output_dir=str(out), exp_name="test_identity", world_size=1, batch_size=64,
                    actor_model_name_or_path=str(tmp_path / "sft"), reward_model_name_or_path=str(tmp_path / "rm"))
    run = ppo.new_or_resumed_run(args)
    plumbing.start_logging(run, 0, args, [])[1].close()
    made_up_checkpoint(out, run["run_name"], args)

    def resume(**changes):
        (out / ".lock").unlink(missing_ok=True)  # the lock of the run before, which has ended
        return ppo.new_or_resumed_run(dataclasses.replace(args, resume=True, **changes))

    os.rename(tmp_path / "sft", tmp_path / "moved")
    runs = os.path.abspath(os.path.join("runs", run["run_name"]))
    monkeypatch.chdir(tmp_path)  # the same folders named by relative paths
    assert resume(actor_model_name_or_path="moved", reward_model_name_or_path="rm")["run_name"] == run["run_name"]
    weights = (tmp_path / "rm" / "model.safetensors").read_bytes()
    middle = len(weights) // 2  # one byte changed, 1.5 MiB from either end of the file
    (tmp_path / "rm" / "model.safetensors").write_bytes(weights[:middle] + bytes([weights[middle] ^ 1]) +
                                                        weights[middle + 1:])
    check_stops([(lambda: resume(actor_model_name_or_path=str(tmp_path / "moved")),
                  "--resume: --reward-model-name-or-path")])
    (tmp_path / "rm" / "model.safetensors").write_bytes(os.urandom(2**10) + weights[2**10:])  # another model there
    check_stops([(lambda: resume(actor_model_name_or_path=str(tmp_path / "moved")),
                  f"--resume: --reward-model-name-or-path '{tmp_path / 'rm'}' does not hold the model the run started "
                  "from (its files differ); name that model, wherever it is now")])
    shutil.rmtree(runs)


def test_a_moved_or_copied_run_logs_to_its_own_runs_folder(tmp_path, monkeypatch, capsys):
    """A run's logs are runs/RUN_NAME/ of the working folder, where tensorboard's are: a project folder moved (or
    copied) resumes in its new place, its metrics continuing in its own runs/RUN_NAME/metrics.jsonl, and a data set
    given by path is known there by its content, as the models are. A copy of the output folder beside the original,
    whose run logs to the same runs/RUN_NAME, is refused in one line while the original holds the run, and never writes
    into the original's logs; the copy resumes once the original has gone (then it owns the logs). runs/RUN_NAME
    replaced by a link to a user's folder is never written through."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    monkeypatch.setattr(plumbing.checkpoints, "start_tensorboard", lambda *_, **__: NO_TENSORBOARD)
    project = tmp_path / "project"
    shutil.copytree(TOY_DATA, project / "data")
    monkeypatch.chdir(project)  # the output folder named as a user names it, from the project folder
    args = ppo.Args(output_dir="out", dataset=str(project / "data"), exp_name="test_moved", save_every=2,
                    world_size=1, batch_size=64)

    def start(output_dir="out", **changes):
        for lock in glob.glob("**/.lock", recursive=True):  # the lock of the run before, which has ended
            os.remove(lock)
        return ppo.new_or_resumed_run(dataclasses.replace(args, output_dir=output_dir, **changes))

    def resume(output_dir="out", **changes):  # a resumed run, up to its first log line
        run = start(output_dir, resume=True, **changes)
        _, metrics_file = plumbing.start_logging(run, 2, dataclasses.replace(args, output_dir=output_dir, resume=True,
                                                                             **changes), [])
        plumbing.append_line(metrics_file, json.dumps({"iteration": 3, "from": output_dir}))
        metrics_file.close()
        return run

    first = start()
    _, metrics_file = plumbing.start_logging(first, 0, args, [])
    for iteration in (1, 2):
        plumbing.append_line(metrics_file, json.dumps({"iteration": iteration}))
    metrics_file.close()
    made_up_checkpoint(project / "out", first["run_name"], args)
    logs = os.path.join("runs", first["run_name"])
    shutil.copytree(project / "out", project / "copy")  # a copy of the output folder beside the original
    shutil.copytree(project, tmp_path / "project_copy")  # a copy of the whole project
    check_stops([(lambda: start("copy", resume=True), f"--resume: 'copy' is a copy of 'out', whose run "
                  f"{first['run_name']} logs to {logs} in this folder: the copy would write into the original's logs. "
                  "Move the original away (the copy then continues the run), or resume the copy from another working "
                  "folder (it then logs to that folder's runs/)")])
    monkeypatch.chdir(tmp_path)
    shutil.move(project, tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    moved = resume(dataset=str(tmp_path / "moved" / "data"))
    assert moved["run_name"] == first["run_name"]
    assert moved["metrics_file"] == str(tmp_path / "moved" / logs / "metrics.jsonl")
    assert [json.loads(line)["iteration"] for line in open(moved["metrics_file"])] == [1, 2, 3]
    shutil.rmtree("out")  # the original gone: its copy continues the run, and now owns its logs
    resume("copy", dataset=str(tmp_path / "moved" / "data"))
    assert [json.loads(line).get("from") for line in open(moved["metrics_file"])] == [None, None, "copy"]
    monkeypatch.chdir(tmp_path)  # resumed from another working folder: it logs there, and says where it logged before
    capsys.readouterr()
    resume("moved/copy", dataset=TOY_DATA)
    assert f"the run's metrics up to its checkpoint are in {moved['metrics_file']}; from here on it logs to " \
           f"{tmp_path / logs / 'metrics.jsonl'}" in capsys.readouterr().out
    # The project's copy: its own runs/, unchanged by the runs above; its data set changed is another one.
    monkeypatch.chdir(tmp_path / "project_copy")
    assert [json.loads(line)["iteration"] for line in open(os.path.join(logs, "metrics.jsonl"))] == [1, 2]
    (tmp_path / "project_copy" / "data" / "test.jsonl").write_text('{"prompt": "Another film"}\n')
    check_stops([(lambda: start(resume=True, dataset=str(tmp_path / "project_copy" / "data")),
                  f"--resume: --dataset '{tmp_path / 'project_copy' / 'data'}' does not hold the data set the run "
                  "started from (its files differ); name that data set, wherever it is now")])
    shutil.rmtree(logs)
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "metrics.jsonl").write_text("the user's\n")
    os.symlink(tmp_path / "users", logs)
    check_stops([(lambda: start(resume=True, dataset=TOY_DATA), f"{logs} is a link, where the run keeps its logs in "
                                                                "a folder of its own: move it away, then run again")])
    assert (tmp_path / "users" / "metrics.jsonl").read_text() == "the user's\n"


def test_a_fifo_in_the_output_folder_stops_a_run_in_one_line(tmp_path, monkeypatch):
    """A FIFO where a run reads (here resume/latest, and the metrics file) stops it in one line instead of keeping it
    waiting for a writer forever: a new run, even with --overwrite, and a resumed one."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    monkeypatch.setattr(plumbing.checkpoints, "start_tensorboard", lambda *_, **__: NO_TENSORBOARD)
    out = tmp_path / "out"
    args = ppo.Args(output_dir=str(out), exp_name="test_fifo", save_every=2, world_size=1, batch_size=64)
    run = ppo.new_or_resumed_run(args)
    plumbing.start_logging(run, 0, args, [])[1].close()
    made_up_checkpoint(out, run["run_name"], args)
    os.mkfifo(out / "resume" / "latest")
    os.remove(out / ".lock")
    with never_waits_on(out / "resume" / "latest"):
        check_stops([(lambda: ppo.new_or_resumed_run(dataclasses.replace(args, overwrite=True)),
                      f"'{out / 'resume' / 'latest'}' is not what a run leaves in --output-dir (a file or a folder, "
                      "not a FIFO, a socket or a device): move it away, or name another --output-dir")])
    os.remove(out / "resume" / "latest")
    os.remove(run["metrics_file"])
    os.mkfifo(run["metrics_file"])
    with never_waits_on(run["metrics_file"]):
        resumed = ppo.new_or_resumed_run(dataclasses.replace(args, resume=True))
        check_stops([(lambda: plumbing.start_logging(resumed, 2, dataclasses.replace(args, resume=True), []),
                      f"cannot continue '{run['metrics_file']}' (not a regular file); it is no file of the run's own")])
    shutil.rmtree(os.path.dirname(run["metrics_file"]))


def test_logits_that_are_not_finite_stop_sampling_with_one_line(stages, tmp_path, monkeypatch):
    """Logits that are not finite (a model broken by its weights or its precision, a temperature near 0), even one
    of them in one row at one step, stop sampling with a ValueError naming the cause, before torch.multinomial fails
    with a message that names none; ppo.py's loop turns it into its one line. Any other error (a rank that lost its
    peer fails inside sampling too) goes on as it is."""
    model, tokenizer = AutoModelForCausalLM.from_pretrained(stages[1]), AutoTokenizer.from_pretrained(stages[1])
    prompt = torch.tensor([tokenizer("The story").input_ids] * 3)
    config = ppo.sampling_config(tokenizer, 4, 1.0)
    config.eos_token_id = None  # all 4 steps
    message = "the policy's next-token logits are not finite (inf or nan) while sampling"
    forward = model.forward
    for bad in [float("nan"), float("inf")]:
        def one_bad_logit(bad=bad, **kwargs):  # at the third step, row 1 (not the first), token 5: one logit
            out = forward(**kwargs)
            if kwargs["input_ids"].shape[1] == 1 and kwargs["position_ids"][0, 0] == prompt.shape[1] + 1:
                out.logits[1, -1, 5] = bad
            return out
        model.forward = one_bad_logit
        with pytest.raises(ValueError, match=re.escape(message)):
            ppo.sample(model, prompt, torch.ones_like(prompt), config)

    def lost_peer(**_):  # gloo's error, as a killed peer of a ZeRO-3 generation produced it
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:2237. This is typically caused by a "
                           "remote worker crashing.")
    model.forward = lost_peer
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # left to one_line_for_a_lost_rank
        ppo.sample(model, prompt, torch.ones_like(prompt), config)
    # The loop, sampling from an actor whose output layer broke: the run's one line.
    sample = ppo.sample

    def broken(model, *args):
        with torch.no_grad():
            model.get_output_embeddings().weight.fill_(float("nan"))
        return sample(model, *args)
    monkeypatch.setattr(ppo, "sample", broken)
    assert ppo_error(stages, tmp_path / "out", "--total-episodes", "16").endswith(message + ": check the model and "
                                                                                   "--temperature, or lower the "
                                                                                   "learning rates")


def test_sample_draws_generates_tokens_or_refuses_the_config(stages):
    """ppo.sample, the function a reader copies, against model.generate with the same config and seed: the same
    tokens, pad after each EOS and to max_new_tokens, for every kind of config it accepts: transformers' defaults
    (greedy, the model's generation_config filling what is unset), plain sampling at a temperature, do_sample=False,
    a list of EOS ids (Llama 3's form), no EOS at all, settings taken from the model's generation_config, suppressed
    tokens. Every config it does not follow raises a ValueError with one line, whatever the model."""
    model = AutoModelForCausalLM.from_pretrained(stages[1]).eval()
    tokenizer = AutoTokenizer.from_pretrained(stages[1], padding_side="left")
    prompts = tokenizer(["The story", "I watched this film last night and", "We"], padding=True, return_tensors="pt")
    eos, pad, own = tokenizer.eos_token_id, tokenizer.pad_token_id, model.generation_config
    assert own.eos_token_id == eos and own.pad_token_id == pad and own.do_sample is None  # the SFT folder's
    common = tokenizer(" the", add_special_tokens=False).input_ids[0]  # a token the toy model samples often
    plain = dict(do_sample=True, top_k=0, max_new_tokens=16)
    accepted = [(GenerationConfig(max_new_tokens=16), own),  # greedy; EOS and pad from the model's config
                (GenerationConfig(**plain, temperature=0.7, eos_token_id=eos, pad_token_id=pad), own),
                (GenerationConfig(do_sample=False, temperature=0.7, max_new_tokens=16), own),
                (GenerationConfig(**plain, eos_token_id=[eos, common], pad_token_id=pad), own),
                (GenerationConfig(**plain, pad_token_id=pad), GenerationConfig()),  # no EOS: runs to the limit
                (GenerationConfig(max_new_tokens=16), GenerationConfig(do_sample=True, top_k=0, temperature=1.5,
                                                                        eos_token_id=eos, pad_token_id=pad)),
                (GenerationConfig(**plain, suppress_tokens=[eos, common], pad_token_id=pad), own)]
    for seed, (config, model_config) in enumerate(accepted):
        model.generation_config = model_config
        with torch.no_grad():
            torch.manual_seed(seed)
            expected = model.generate(**prompts, generation_config=config)[:, prompts["input_ids"].shape[1]:]
            torch.manual_seed(seed)
            responses = ppo.sample(model, prompts["input_ids"], prompts["attention_mask"], config)
        L = expected.shape[1]
        assert responses.shape == (3, 16) and torch.equal(responses[:, :L], expected), config
        assert (responses[:, L:] == (pad if config.pad_token_id is None else config.pad_token_id)).all()
    greedy, stops = (ppo.sample(model, prompts["input_ids"], prompts["attention_mask"], config)
                     for config in [accepted[0][0], accepted[3][0]])
    model.generation_config = own
    assert torch.equal(greedy, ppo.sample(model, prompts["input_ids"], prompts["attention_mask"], accepted[0][0]))
    assert ((stops == common) | (stops == eos)).any(dim=1).all()  # the list's second id ended some responses

    refused = [(GenerationConfig(), own, "nor the model's sets max_new_tokens, which sample needs"),
               (GenerationConfig(max_new_tokens=4), GenerationConfig(eos_token_id=eos), "sets pad_token_id"),
               (GenerationConfig(do_sample=True, max_new_tokens=4), own, "generate would use top_k=50 (from"),
               (GenerationConfig(max_new_tokens=4), GenerationConfig(do_sample=True, pad_token_id=pad), "top_k=50")]
    refused += [(GenerationConfig(**{**plain, field: value}), own, f"use {field}={value!r}") for field, value in [
        ("top_k", 5), ("top_p", 0.9), ("min_new_tokens", 3), ("num_beams", 2), ("no_repeat_ngram_size", 2),
        ("bad_words_ids", [[common]]), ("repetition_penalty", 1.2), ("min_p", 0.1)]]
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None  # sampling_config of a tokenizer without a pad token, the model's config without one too
    refused.append((ppo.sampling_config(no_pad, 4, 1.0), GenerationConfig(eos_token_id=eos), "sets pad_token_id"))
    for config, model_config, message in refused:
        model.generation_config = model_config
        with pytest.raises(ValueError, match=re.escape(message)) as refusal:
            ppo.sample(model, prompts["input_ids"], prompts["attention_mask"], config)
        assert "\n" not in str(refusal.value)
    # A model that returns no key-value cache (custom code that ignores `cache`) would go on from the last token alone.
    model.generation_config = own
    forward = model.forward
    model.forward = lambda **kwargs: forward(**{**kwargs, "use_cache": False})
    with pytest.raises(ValueError, match="returns no key-value cache for transformers 5.24's `cache` argument"):
        ppo.sample(model, prompts["input_ids"], prompts["attention_mask"], accepted[1][0])


def test_a_checkpoint_on_a_full_disk_keeps_the_one_before(stages, tmp_path, monkeypatch, capsys):
    """The disk fills after the first checkpoint: the second stops the run with one line naming the checkpoint that
    --resume continues from, and leaves no partial folder; that checkpoint still resumes."""
    commit = plumbing.checkpoints.commit_checkpoint

    def commit_then_fill_the_disk(path, run_name):
        commit(path, run_name)
        monkeypatch.setattr(plumbing.checkpoints, "commit_checkpoint", commit)
        stack.enter_context(full_disk())

    with contextlib.ExitStack() as stack:
        monkeypatch.setattr(plumbing.checkpoints, "commit_checkpoint", commit_then_fill_the_disk)
        error = ppo_error(stages, tmp_path / "out", "--total-episodes", "24", "--save-every", "1")
    resume = tmp_path / "out" / "resume"
    assert f"cannot write the checkpoint '{resume / 'iteration_2'}' (Error while serializing: I/O error: File too " \
        f"large (os error 27)); the " in error and f"--resume continues from '{resume / 'iteration_1'}'" in error
    assert sorted(os.listdir(resume)) == ["iteration_1", "latest"]
    (tmp_path / "out" / ".lock").unlink()  # the lock of the run that stopped (in this process, which lives on)
    error = ppo_error(stages, tmp_path / "out", "--total-episodes", "24", "--save-every", "1", "--resume",
                      "--seed", "7")  # found the checkpoint: read its settings
    assert "--resume: the run was started with other settings: --seed" in error and "(now 7)" in error
    # A state.json is untrusted too: an iteration past the run's end, an optimizer state that is not this run's, a
    # value of another type are each a checkpoint that cannot continue the run.
    state_file = resume / "iteration_1" / "state.json"
    state = json.loads(state_file.read_text())
    actor_state = {**state["actor"], "scheduler": {**state["actor"]["scheduler"], "last_epoch": "1"}}
    for changed, problem in [({"iteration": 9}, "its iteration 9 is not one of the run's 1 to 3"),
                             ({"actor": actor_state}, "its state.json's 'actor' is not the optimizer and scheduler "
                                                      "state of this run's actor")]:
        plumbing.write_json(str(state_file), {**state, **changed})
        (tmp_path / "out" / ".lock").unlink()
        capsys.readouterr()
        error = ppo_error(stages, tmp_path / "out", "--total-episodes", "24", "--save-every", "1", "--resume")
        assert f"cannot resume from {resume / 'iteration_1'} ({problem}); trying the checkpoint before it" in \
            capsys.readouterr().out and f"--resume: no checkpoint in {resume} reads whole" in error
    plumbing.write_json(str(state_file), {**state, "kl_coef": "0.1"})
    (tmp_path / "out" / ".lock").unlink()
    error = ppo_error(stages, tmp_path / "out", "--total-episodes", "24", "--save-every", "1", "--resume")
    assert f"--resume: the state.json of every checkpoint in {resume} is missing or damaged" in error


def test_resume_reuses_the_checkpointed_last_valid_batch(stages, tmp_path, monkeypatch, capsys):
    """An iteration whose responses are all invalid trains on the rank's last valid batch again (DeepSpeed-Chat's
    fallback). Right after --resume that batch comes from the checkpoint: the resumed run repeats what the
    uninterrupted one did, instead of stopping for want of a batch."""
    mask_from_stop = rlhf_math.response_mask_from_stop

    def run_where(second_iteration, out, *flags):  # the second iteration's responses: all invalid, or a kill
        calls = []

        def response_mask(responses, stop_token_id):
            calls.append(None)
            if len(calls) == 1 and "--resume" not in flags:
                return mask_from_stop(responses, stop_token_id)
            if second_iteration == "kill":
                raise SystemExit("killed after the checkpoint of iteration 1")
            return torch.zeros_like(mask_from_stop(responses, stop_token_id))  # no real token: invalid

        monkeypatch.setattr(rlhf_math, "response_mask_from_stop", response_mask)
        argv = [*stages, *FEW_ITERATIONS, "--total-episodes", "8", "--per-device-rollout-batch-size", "4",
                "--num-ppo-epochs", "1", "--max-new-tokens", "6", "--save-every", "1", "--sample-every", "0",
                "--output-dir", str(out), "--exp-name", "test_reuse", *flags]
        return run_in_process("ppo.py", argv, must_stop=second_iteration == "kill")

    run_where("invalid", tmp_path / "straight")
    assert run_where("kill", tmp_path / "killed") == "killed after the checkpoint of iteration 1"
    (tmp_path / "killed" / ".lock").unlink()  # the lock of the run that stopped (in this process, which lives on)
    capsys.readouterr()
    assert run_where("invalid", tmp_path / "killed", "--resume") is None
    assert "every response is invalid; reusing the last valid batch" in capsys.readouterr().out
    straight, resumed = run_metrics(tmp_path / "straight"), run_metrics(tmp_path / "killed")
    for name in ["loss/policy_avg", "loss/value_avg", "val/ratio", "val/num_invalid"]:
        assert resumed[1][name] == pytest.approx(straight[1][name], rel=1e-5, abs=1e-6), name
    for folder in ["actor", "critic"]:
        for name, weight in saved_weights(tmp_path / "straight" / folder).items():
            torch.testing.assert_close(saved_weights(tmp_path / "killed" / folder)[name], weight, rtol=0, atol=1e-6)
    read_metrics("test_reuse")


def test_first_ratio_check_catches_dropout(stages, tmp_path):
    # The SFT model with attention dropout 0.3: kept on (--no-disable-dropout), the update's log-probs no longer
    # match the rollout's, and the run stops at the first mini-batch instead of training on a wrong ratio.
    model_dir = tmp_path / "with_dropout"
    shutil.copytree(stages[1], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    # (With dropout disabled, as by default, every fp32 run of this file passes the same check.)
    error = ppo_error(stages, tmp_path / "dropout", "--total-episodes", "16", "--actor-model-name-or-path",
                      str(model_dir), "--no-disable-dropout")
    assert "iteration 0: before the first optimizer step the PPO ratio is not exactly 1" in error


def write_surprising_generation_config(folder):
    """A generation_config.json of the kind hub models carry: with it, transformers would sample at least 12 new
    tokens (no EOS before), penalise repeated tokens and forbid repeated bigrams."""
    (folder / "generation_config.json").write_text(json.dumps({
        "min_new_tokens": 12, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "top_k": 5}))


def test_an_actor_folder_in_half_precision_with_its_own_generation_config(stages, tmp_path):
    # transformers keeps a checkpoint's own dtype by default; --dtype fp32 (the default) must still train in fp32.
    half = tmp_path / "sft_fp16"
    AutoModelForCausalLM.from_pretrained(stages[1], dtype=torch.float16).save_pretrained(half)
    AutoTokenizer.from_pretrained(stages[1]).save_pretrained(half)
    # ppo.py samples exactly its configured distribution: the folder's generation config is replaced by
    # ppo.sampling_config's (saved with the actor), whose min_new_tokens would have suppressed EOS.
    write_surprising_generation_config(half)
    _, exp_name = run_ppo(stages, tmp_path / "out", "--total-episodes", "16", "--actor-model-name-or-path", str(half),
                          here=True)
    check_metrics(read_metrics(exp_name), 2)
    saved = GenerationConfig.from_pretrained(tmp_path / "out" / "actor").to_dict()
    assert saved == ppo.sampling_config(AutoTokenizer.from_pretrained(half), 12, 1.0).to_dict(), saved
    assert {w.dtype for w in saved_weights(tmp_path / "out" / "actor").values()} == {torch.float32}


def test_invalid_rows_in_the_first_micro_batch_pass_the_ratio_check(stages, tmp_path, monkeypatch):
    """Micro-batches of one response, the first too short to train on: a first micro-batch that holds only an invalid
    row has no token to check, and the exact first-ratio check looks at the in-mask tokens only (it once read the
    empty mean, 0, as the ratio and stopped a valid run). Made so, whatever the model samples: the update takes the
    rows in order (torch.randperm gives 0, 1, ...), and each rollout's first response is cut to 2 tokens while the
    others keep all 24 (--min-response-tokens 17)."""
    mask_from_stop = rlhf_math.response_mask_from_stop

    def response_mask(responses, stop_token_id):
        mask = torch.ones_like(mask_from_stop(responses, stop_token_id))
        mask[0, 2:] = 0
        return mask

    monkeypatch.setattr(rlhf_math, "response_mask_from_stop", response_mask)
    monkeypatch.setattr(torch, "randperm", lambda n, **kwargs: torch.arange(n, device=kwargs.get("device")))
    result, exp_name = run_ppo(stages, tmp_path, "--total-episodes", "32", "--num-mini-batches", "1",
                               "--per-device-train-batch-size", "1", "--num-ppo-epochs", "1",
                               "--max-new-tokens", "24", "--min-response-tokens", "17", here=True)
    metrics = read_metrics(exp_name)
    check_metrics(metrics, 4)
    assert all(m["val/num_invalid"] == 1 for m in metrics)


def test_a_record_gone_during_the_run_is_written_again(stages, tmp_path, monkeypatch):
    """The output folder's record is read back at the end to mark the run finished: one that is gone by then (or no
    longer reads) is written again from the run's own name, instead of a TypeError after the whole run."""
    save_engine_folder = plumbing.save_engine_folder

    def save_then_lose_the_record(engine, tokenizer, output_dir, record, merge_lora=False):
        save_engine_folder(engine, tokenizer, output_dir, record, merge_lora)
        (tmp_path / "out" / plumbing.RECORD).write_text("{not json")

    monkeypatch.setattr(plumbing, "save_engine_folder", save_then_lose_the_record)
    _, exp_name = run_ppo(stages, tmp_path / "out", "--total-episodes", "8", here=True)
    record = plumbing.read_record(str(tmp_path / "out"))
    assert record["finished"] and record["script"] == "ppo.py" and record["run_name"].startswith(exp_name)
    read_metrics(exp_name)


def test_a_non_finite_loss_stops_the_run(stages, tmp_path):
    error = ppo_error(stages, tmp_path / "out", "--total-episodes", "16", "--actor-learning-rate", "1e30",
                      "--critic-learning-rate", "1e30")
    assert "_avg is nan; lower the learning rates" in error


@pytest.fixture(scope="module")
def wrong(stages, tmp_path_factory):
    """Model folders and data that are wrong in the ways a user meets them, built from the stages' models."""
    root, sft_path, rm_path = tmp_path_factory.mktemp("wrong"), stages[1], stages[3]
    shutil.copytree(rm_path, root / "two_labels")  # a classifier of two labels, with the reward model's tokenizer
    AutoModelForSequenceClassification.from_pretrained(sft_path, num_labels=2).save_pretrained(root / "two_labels")
    shutil.copytree(root / "two_labels", root / "one_label_config")  # its config says 1 label, its head has 2 rows
    config = json.loads((root / "one_label_config" / "config.json").read_text())
    (root / "one_label_config" / "config.json").write_text(json.dumps({**config, "num_labels": 1}))
    shutil.copytree(rm_path, root / "zero_std")  # a reward model whose stored normalization divides by 0
    config = json.loads((root / "zero_std" / "config.json").read_text())
    (root / "zero_std" / "config.json").write_text(json.dumps({**config, "reward_std": 0.0}))
    shutil.copytree(sft_path, root / "added_tokens")  # chat tokens added to the tokenizer, the embeddings not resized
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    tokenizer.add_tokens(["<|user|>", "<|assistant|>"], special_tokens=True)
    tokenizer.save_pretrained(root / "added_tokens")
    shutil.copytree(rm_path, root / "no_pad_reward")  # a reward model reading other tokens, its tokenizer with no pad
    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    tokenizer.add_tokens(["<|other|>"])
    tokenizer.pad_token = None
    tokenizer.save_pretrained(root / "no_pad_reward")
    (root / "blank.txt").write_text("\n  \n\n")
    write_jsonl(root / "hh.jsonl", [HH_ROW] * 8)
    shutil.copytree(TOY_DATA, root / "data")
    shutil.copytree(TOY_DATA, root / "scripted")
    (root / "scripted" / "scripted.py").write_text("import datasets  # a loading script\n")
    os.symlink(root / "nowhere", root / "dangling")
    shutil.copytree(rm_path, root / "critic")  # a critic saved by ppo.py: it loads as a reward model would
    plumbing.write_json(str(root / "critic" / plumbing.RECORD), {"script": "ppo.py", "run_name": "ppo__1__1",
                                                                  "finished": True})
    shutil.copytree(rm_path, root / "lone_std")  # a normalization with its standard deviation but no mean
    config = json.loads((root / "lone_std" / "config.json").read_text())
    (root / "lone_std" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "reward_mean"}))
    wide = AutoModelForCausalLM.from_pretrained(sft_path)  # an actor with 8 rows more than the reward model embeds
    wide.resize_token_embeddings(wide.config.vocab_size + 8)
    wide.save_pretrained(root / "wide_actor")
    AutoTokenizer.from_pretrained(sft_path).save_pretrained(root / "wide_actor")
    (root / "linked_out").mkdir()  # an output folder whose actor/ is a link to the SFT model that the run reads
    os.symlink(os.path.abspath(sft_path), root / "linked_out" / "actor")
    shutil.copytree(sft_path, root / "no_eos")  # an actor whose tokenizer has no EOS: no response could ever stop
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(root / "no_eos")
    shutil.copytree(rm_path, root / "no_labels")  # a reward model whose config.json names no labels: 2, to transformers
    config = json.loads((root / "no_labels" / "config.json").read_text())
    (root / "no_labels" / "config.json").write_text(json.dumps({key: value for key, value in config.items()
                                                                 if key not in ("num_labels", "id2label", "label2id")}))
    return root


def test_ppo_bad_input(stages, bad, wrong, tmp_path, capsys):
    shutil.copytree(stages[3], bad / "nan_weights_rm", dirs_exist_ok=True)  # a reward model with a NaN weight
    weights = safetensors.torch.load_file(bad / "nan_weights_rm" / "model.safetensors")
    weights["score.weight"].view(-1)[0] = float("nan")
    safetensors.torch.save_file(weights, bad / "nan_weights_rm" / "model.safetensors", metadata={"format": "pt"})
    check_stops([(lambda overrides=overrides: ppo.check_args(ppo.Args(**overrides)), message) for overrides, message in [
        ({"total_episodes": 0}, "--total-episodes must be at least 1, not 0"),
        ({"num_mini_batches": 0}, "--num-mini-batches must be at least 1, not 0"),
        ({"num_ppo_epochs": 0}, "--num-ppo-epochs must be at least 1, not 0"),
        ({"target_kl": 0.0}, "--target-kl must be positive, not 0.0"),
        ({"target_kl": 0.1, "kl_coef": 0.0}, "never moves it off --kl-coef 0: give --kl-coef a positive start"),
        ({"kl_coef": -0.1}, "--kl-coef must not be negative, not -0.1"),
        ({"gamma": 2.0}, "--gamma must be between 0 and 1, not 2.0"),
        ({"missing_eos_penalty": 10.0}, "--missing-eos-penalty 10.0 must be in (0, --clip-score 5.0]"),
        ({"ema_decay": 1.5}, "--ema-decay must be between 0 and 1, not 1.5"),
        ({"only_optimize_lora": True}, "--only-optimize-lora needs the actor's adapters"),
        ({"align_overflow": True}, "--align-overflow is for --dtype fp16"),
        ({"sampler": "static", "actor_lora_dim": 4}, "--sampler static samples from a plain copy of the actor, without "
                                                     "its LoRA adapters (--actor-lora-dim): use --sampler eager"),
        ({"sampler": "static", "actor_zero_stage": 3, "gather_weights_for_rollout": False},
         "--sampler static keeps a whole copy of the actor on each device, more than "
         "--no-gather-weights-for-rollout allows: use --sampler eager"),
        ({"offload": True, "actor_zero_stage": 2}, "--offload needs --critic-zero-stage 1, 2 or 3"),
    ]])
    # (A wrong data file or model folder alone, through plumbing's load_split and check_model_folder: test_plumbing.py.)
    cases = [
        (["--total-episodes", "20"], "--total-episodes / (rollout batch x ranks): 20 is not divisible by 8"),
        (["--max-new-tokens", "200"], "--max-new-tokens 200 is longer than the model's 128 positions"),
        (["--dataset", str(bad / "empty_prompt.jsonl")], "row 1 of split 'train', column 'prompt': empty text"),
        (["--max-prompt-len", "2"], "no prompt of split 'train' fits --max-prompt-len 2; raise it"),
        (["--critic-model-name-or-path", str(bad / "no_weights")],
         "has no model weights (model.safetensors); run reward_model.py first or check --critic-model-name-or-path"),
        (["--resume"], "--resume: no run of ppo.py in"),
        (["--output-dir", stages[3]], "is or holds --reward-model-name-or-path"),
        (["--output-dir", str(bad / "a_file")], "a_file' is a file; name a folder"),
        (["--reward-model-name-or-path", str(bad / "nan_weights_rm")], "has weights that are not finite (inf or nan)"),
        (["--actor-lora-dim", "4", "--lora-target-modules", "nothing_matches"],
         "--lora-target-modules 'nothing_matches'"),
        (["--min-response-tokens", "1000"], "iteration 0: no response has --min-response-tokens 1000 real tokens"),
        # A causal LM is no reward model (only the critic may start with a fresh head), nor is a 2-label classifier.
        (["--reward-model-name-or-path", stages[1]], f"{stages[1]!r} is a causal language model, not a 1-label "
                                                     "sequence classifier: its score head would start random; check "
                                                     "--reward-model-name-or-path"),
        (["--reward-model-name-or-path", str(wrong / "two_labels")], "must be a 1-label "
         "AutoModelForSequenceClassification (its config.json has 2 labels); check --reward-model-name-or-path"),
        (["--reward-model-name-or-path", str(wrong / "no_labels")], "(its config.json has 2 labels); check "
                                                                    "--reward-model-name-or-path"),
        (["--reward-model-name-or-path", str(wrong / "one_label_config")],  # the critic, starting from it, loads first
         "do not fit its config.json: score.weight is [2, 128] there, [1, 128] by the config (another vocabulary "
         "size, or number of labels); check --reward-model-name-or-path"),
        (["--reward-model-name-or-path", str(wrong / "zero_std")], "reward_std 0.0, must be numbers with reward_std > 0"),
        (["--actor-model-name-or-path", str(wrong / "added_tokens")], "tokens were added to it without "
         "model.resize_token_embeddings(len(tokenizer)); resize the model's embeddings and save it with its tokenizer, "
         "or check --actor-model-name-or-path"),
        (["--reward-model-name-or-path", str(wrong / "no_pad_reward")], "needs an EOS and a pad token"),
        (["--actor-lora-dim", "4", "--lora-target-modules", "("], "give 'all-linear', or a regular expression"),
        (["--unsup-dataset", str(wrong / "blank.txt")], "holds no text, only blank lines or empty cells"),
        (["--dataset", str(wrong / "hh.jsonl"), "--prompt-column", "chosen"],
         "column 'chosen' of '" + str(wrong / "hh.jsonl") + "' holds whole conversations, answers included (the "
         "hh-rlhf layout); pass --split-conversations"),
        (["--dataset", str(wrong / "scripted")], "comes with a loading script (scripted.py): code, which is never run here"),
        (["--dataset", str(wrong / "data"), "--output-dir", str(wrong / "data" / "ppo")],
         "is inside --dataset '" + str(wrong / "data") + "', which this run reads"),
        (["--output-dir", str(wrong / "dangling")], "is a link to '" + str(wrong / "nowhere") + "', which does not"),
        # A critic is no reward model (its record says who saved it); a normalization needs its mean and its std.
        (["--reward-model-name-or-path", str(wrong / "critic")], f"--reward-model-name-or-path '{wrong / 'critic'}' "
         "was saved by ppo.py (a trained actor or critic, says its training_run.json), not by reward_model.py"),
        (["--reward-model-name-or-path", str(wrong / "lone_std")],
         "config.json has reward_std but no reward_mean: the scores would be normalized by half a rule"),
        (["--actor-model-name-or-path", str(wrong / "wide_actor")],
         f"--actor-model-name-or-path '{wrong / 'wide_actor'}' samples token ids from 1001 rows, but "
         f"--reward-model-name-or-path '{stages[3]}' embeds only 993: an id past them would stop the run"),
        (["--dataset", str(bad / "two_formats")], "holds data files of 2 formats (test.jsonl, test.parquet)"),
        (["--unsup-dataset", TOY_DATA], "; --unsup-dataset is plain text to learn from: a .txt file, or a "
                                               "data set whose column of text --unsup-text-column names"),
        (["--output-dir", str(wrong / "linked_out"), "--overwrite"],
         f"--output-dir '{wrong / 'linked_out' / 'actor'}' is or holds --actor-model-name-or-path '{stages[1]}'"),
        (["--exp-name", "nested/name"], "--exp-name 'nested/name' must be a plain name (no '/')"),
        (["--actor-model-name-or-path", str(wrong / "no_eos")], f"the tokenizer of '{wrong / 'no_eos'}' needs an EOS "
         "token (a response ends with it) and a pad token distinct from it, as a model saved by sft.py has; check "
         "--actor-model-name-or-path"),
    ]
    check_errors("ppo.py", [*stages, *FEW_ITERATIONS, "--total-episodes", "16"], cases, tmp_path)
    # The models' checks stop a run before it claims its output folder (check_errors gives case i tmp_path/case_i).
    refused_models = [i for i, (flags, _) in enumerate(cases) if {"no_eos", "two_labels", "no_labels"} &
                      {os.path.basename(flag) for flag in flags}]
    assert len(refused_models) == 3 and not any((tmp_path / f"case_{i}").exists() for i in refused_models)
    assert sorted(os.listdir(wrong / "data")) == ["test.jsonl", "train.jsonl"]  # nothing written into the data
    with pytest.raises(SystemExit):
        tyro.cli(ppo.Args, args=["--actor-zero-stage", "4"])
    assert "invalid choice '4' for argument '--actor-zero-stage'" in capsys.readouterr().err


def test_text_in_square_brackets_is_printed_as_text(stages, tmp_path):
    """Prompts in Llama 2's chat form, "[INST] ... [/INST]", and a response that spells rich's markup: ppo.py's
    samples table and evaluate.py's tables print them as they are (rich would read them as its markup and stop)."""
    rows = [json.loads(line) for line in open(os.path.join(plumbing.TOY_TASK, "data", "test.jsonl"))][:8]
    write_jsonl(tmp_path / "inst.jsonl", [{**row, "prompt": f"[INST] {row['prompt']} [/INST]"} for row in rows])
    flags = ["--dataset", str(tmp_path / "inst.jsonl"), "--max-prompt-len", "48"]
    result, exp_name = run_ppo(stages, tmp_path / "ppo", "--total-episodes", "8", *flags, here=True)
    assert "[INST]" in result.stdout and "[/INST]" in result.stdout  # in the samples table, (wrapped) as they are
    read_metrics(exp_name)
    result = run("evaluate.py", "--sft-model", stages[1], "--ppo-model", str(tmp_path / "ppo" / "actor"),
                 "--reward-model", stages[3], *flags, "--split", "train", "--batch-size", "8", "--max-new-tokens", "12",
                 "--output-dir", str(tmp_path / "eval"), here=True)
    assert "[INST]" in result.stdout and "[/INST]" in result.stdout
    assert "samples [reward-model score | gold score]" in result.stdout and "(train)" in result.stdout


def test_evaluate(stages, wrong, tmp_path, monkeypatch):
    """evaluate.py compares the SFT and PPO policies on held-out prompts, by the reward model and by the gold rule,
    and draws the training curves and, from the run's snapshots, the over-optimisation picture."""
    out = tmp_path / "ppo"
    _, exp_name = run_ppo(stages, out, "--total-episodes", "16", "--snapshot-every", "1", here=True)
    assert sorted(os.listdir(out / "snapshots")) == ["iteration_1", "iteration_2"]
    metrics_file = plumbing.read_record(str(out / "actor"))["metrics_file"]  # the run that trained this actor
    sft = tmp_path / "sft"  # the SFT model, with a generation config that evaluate.py must not apply
    shutil.copytree(stages[1], sft)
    write_surprising_generation_config(sft)
    flags = ["--sft-model", str(sft), "--ppo-model", str(out / "actor"), "--reward-model", stages[3],
             "--split", "test[:40]", "--batch-size", "16", "--max-new-tokens", "12", "--temperature", "0.7",
             "--seed", "5", "--snapshot-prompts", "16", "--output-dir", str(tmp_path / "eval")]
    # What evaluate.py passes to ppo's helpers and gets back, recorded through evaluate's own names for them (it
    # imports them from ppo; its main calls them by those names): the sampling config and seed of every batch, the
    # reward model's scores, and the log-probs behind the KL to the SFT policy.
    calls, sample, reward_scores, response_logprobs = {"sample": [], "scores": [], "kl": []}, evaluate.sample, \
        evaluate.reward_scores, evaluate.response_logprobs

    def recorded(name, function, value=lambda result, *args: result):
        def call(*args, **kwargs):
            result = function(*args, **kwargs)
            calls[name].append(value(result, *args, **kwargs))
            return result
        return call

    monkeypatch.setattr(evaluate, "sample", recorded("sample", sample, lambda _, model, ids, mask, config, synced: (
        config.to_dict(), torch.initial_seed())))
    monkeypatch.setattr(evaluate, "reward_scores", recorded("scores", reward_scores))
    monkeypatch.setattr(evaluate, "response_logprobs", recorded("kl", response_logprobs, lambda logprobs, model,
                        sequences, mask, P, temperature: (torch.where(mask[:, P:].bool(), logprobs, 0.0).sum(dim=1),
                                                          temperature, model.name_or_path)))
    shutil.copytree(out / "snapshots" / "iteration_2", out / "snapshots" / "iteration_3")  # another run's snapshot
    plumbing.write_json(str(out / "snapshots" / "iteration_3" / plumbing.RECORD), {
        **plumbing.read_record(str(out / "snapshots" / "iteration_3")), "run_name": "another__1__1"})
    result = run("evaluate.py", *flags, here=True)
    assert f"left out 1 snapshots in {out / 'snapshots'} that another run saved than --ppo-model's " \
           f"({plumbing.read_record(str(out / 'actor'))['run_name']}): iteration_3" in result.stdout
    assert "win rate of PPO over SFT, by the gold rule" in result.stdout
    assert f"ppo_training.png (from {metrics_file})" in result.stdout  # found through the actor's training_run.json
    summary = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert summary["prompts"] == 40
    for name in ["win_rate", "gold_win_rate"]:
        assert 0 <= summary["ppo"][name] <= 1
    for policy in ["sft", "ppo"]:
        assert 0 <= summary[policy]["parse_rate"] <= 1 and math.isfinite(summary[policy]["mean_score"])
        assert 1 <= summary[policy]["mean_length"] <= 12  # --max-new-tokens
    # Every policy samples with ppo.sampling_config at --temperature (the SFT folder's min_new_tokens 12, top_k 5 are
    # not applied), each batch from --seed + its first prompt's index; the figures are those of the scores and
    # log-probs the helpers returned: the first 3 batches are the SFT policy's answers, the next 3 the PPO policy's,
    # each scored by the log-probs of both policies (named by their folders).
    expected = ppo.sampling_config(AutoTokenizer.from_pretrained(sft), 12, 0.7).to_dict()
    assert all(config == expected for config, _ in calls["sample"])
    assert [seed for _, seed in calls["sample"][:6]] == [5, 21, 37] * 2
    sft_scores, ppo_scores = (torch.cat(calls["scores"][i : i + 3]).tolist() for i in (0, 3))
    logprobs = {folder: torch.cat([total for total, _, name in calls["kl"][:6] if name == folder])
                for folder in (str(out / "actor"), str(sft))}
    kl = logprobs[str(out / "actor")] - logprobs[str(sft)]
    assert {temperature for _, temperature, _ in calls["kl"]} == {0.7}
    assert summary["ppo"]["win_rate"] == pytest.approx(evaluate.win_rate(ppo_scores, sft_scores))
    assert summary["ppo"]["mean_score"] == pytest.approx(sum(ppo_scores) / 40)
    assert summary["ppo"]["mean_kl_to_sft"] == pytest.approx(kl.mean().item())
    assert [p["label"] for p in summary["overoptimization"]] == ["SFT", "it 1", "it 2"]
    for picture in ["ppo_training.png", "overoptimization.png"]:
        assert (tmp_path / "eval" / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    flags[flags.index("--ppo-model") + 1] = str(tmp_path / "missing")
    error = run_in_process("evaluate.py", flags)
    assert "no model folder at" in error and "--ppo-model" in error
    # The reward model is checked as ppo.py checks it.
    flags[flags.index("--ppo-model") + 1] = str(out / "actor")
    for folder, message in [("no_pad_reward", "needs an EOS and a pad token; set them and save it, or check "
                                              "--reward-model"),
                            ("two_labels", "(its config.json has 2 labels); check --reward-model"),
                            ("zero_std", "reward_std 0.0, must be numbers with reward_std > 0"),
                            ("critic", "was saved by ppo.py (a trained actor or critic, says its training_run.json)")]:
        flags[flags.index("--reward-model") + 1] = str(wrong / folder)
        assert message in run_in_process("evaluate.py", flags)
    flags[flags.index("--reward-model") + 1], flags[flags.index("--max-new-tokens") + 1] = stages[3], "200"
    assert "--max-prompt-len 32 + --max-new-tokens 200 is longer than the model's 128 positions; lower them" in \
        run_in_process("evaluate.py", flags)
    read_metrics(exp_name)


def test_benchmark(tmp_path):
    """benchmark.py runs ppo.py (ppo.main, in a fresh process) and the limit taking turns, and its table's ratios are
    the medians of their paired iterations; the profile in one process times every phase of both, and the GPU preset
    (Pythia-1B's shape, bf16) applies where no flag says otherwise; both print generation in ms a token beside its
    floor and the iteration beside the hardware bound, with their arithmetic. A tiny shape, to run here."""
    small = ["--hidden-size", "64", "--num-layers", "1", "--intermediate-size", "128", "--vocab-size", "512",
             "--prompt-len", "8", "--response-len", "8", "--episodes", "8"]
    output = tmp_path / "benchmark.json"
    table = run("benchmark.py", *small, "--warmup-iterations", "1", "--iterations", "2", "--repeats", "1",
                "--output-json", str(output)).stdout
    result = json.loads(output.read_text())
    [row] = result["rows"]
    assert row["config"] == "1 rank, actor ZeRO-0" and row["rollout_s"] > 0 and row["update_limit_s"] > 0, row
    assert row["gpu_max_allocated_gb"] > 0  # ppo.py's peak memory, on a CPU its resident memory
    # ppo.py and the limit took turns, one iteration each; each ratio is a median of paired iterations.
    assert "Each ratio is the median over 2 pairs of an iteration of ppo.py and the limit's" in table
    assert len(result["pairs"]) == 2 and row["iteration_ratio"] == statistics.median(
        ppo_s / limit_s for ppo_s, limit_s in result["pairs"])
    assert set(result["profile"]["ppo.py"]["phases"]) == set(benchmark.PHASES) and "| phase |" in table
    # The profile in one process: ppo.py and the limit took turns, one iteration each (profile_in_turns).
    assert len(result["profile"]["ppo.py"]["timed"]) == len(result["profile"]["limit"]["timed"]) == 2
    assert "ppo.py's iteration over the limit's just before it, in this process: the median over 2 pairs" in table
    # --profile: every phase of ppo.py's iteration is found and timed (a phase at 0 would mean ppo.py no longer
    # calls the function the profile wraps for it), and the limit's phases too (it does no checks or logging).
    profile = run("benchmark.py", "--preset", "pythia-1b", "--profile", *small, "--warmup-iterations", "1",
                  "--iterations", "1", "--output-json", str(tmp_path / "profile.json")).stdout
    assert json.loads((tmp_path / "profile.json").read_text())["rows"] == []  # the profile, the bound: no table
    assert "shape: 8 episodes of 8 + 8 tokens, 1 layers of width 64 (8 heads, MLP 128), vocabulary 512, bf16;" in profile
    rows = {line.split(" | ")[0].strip("| "): [float(x) for x in line.split(" | ")[1:3]]
            for line in profile.splitlines() if line.startswith("| ") and not line.startswith("| phase")}
    assert set(rows) == {*benchmark.PHASES, "other", "iteration"}, profile
    for name in benchmark.PHASES:
        ours, limit = rows[name]
        assert ours > 0 and (limit > 0) == (name != "checks, statistics and logging"), (name, profile)
    # Generation in ms a token beside its floor, the iteration beside the hardware bound, their arithmetic printed and
    # written. The actor's weights that multiply each token: 4 x 64^2 + 3 x 64 x 128 (attention, MLP) + 3 x 64 (norms)
    # + 513 x 64 (the output layer; the input embedding's lookup multiplies nothing) = 73,984; the critic's and reward
    # model's 41,216 (a score head of 64, not 32,832): 2 x 8 x 16 tokens x (2 x 73,984 + 2 x 41,216 (the rollout) +
    # 3 x 2 epochs x (73,984 + 41,216)) = 235,929,600 FLOPs; a decode step reads 4 x 73,984 bytes of weights and
    # 8 x 1 layer x 2 x 16 positions x 64 x 4 = 65,536 of cache.
    bound, ms = result["bound"], result["generation_ms_per_token"]
    assert (bound["flops"], bound["weight_bytes"], bound["cache_bytes"]) == (235_929_600, 4 * 73_984, 65_536), bound
    assert ms == pytest.approx({"floor": 1e3 * bound["floor_s"], **{side: 1e3 * result["profile"][side]["phases"][
        "generation"] / 8 for side in ["ppo.py", "limit"]}})
    expected = re.escape(  # each # a number, each ? a unit's prefix
        "\ngeneration: ppo.py # ms a token, the limit #; floor # ms = (# kB weights + # kB cache) / # ?B/s measured\n"
        "hardware bound of an iteration: # s = forward and backward # s (# ?FLOP / # ?FLOP/s measured) + generation "
        "# s (8 tokens at the floor) + optimizer steps # s (# MB / # ?B/s); ppo.py's iteration # times it, the "
        "limit's #\n"
        "optimizer steps: ppo.py # s an iteration, the limit #, the bound #\n").replace("\\#", r"[\d.e+-]+").replace(
        "\\?", "[kMGT]")
    for output in [table, profile]:
        assert re.search(expected, output), output


def test_the_limit_runs_at_ppos_settings_from_its_flags(tmp_path, monkeypatch):
    """benchmark.limit_iteration does what ppo.py run with the same flags must do: its models (the critic's own folder
    when one is named), its sampling temperature, its learning rates, and gradient clipping only where ppo.py clips
    (TRL's settings, in the comparison with TRL, clip none)."""
    args = benchmark.Args(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=64, prompt_len=4,
                          response_len=4, episodes=4)
    benchmark.build_models(args, str(tmp_path))
    seen = {"temperature": [], "clip": [], "lr": [], "critic": []}
    sampling_config, adamw, from_pretrained = ppo.sampling_config, torch.optim.AdamW, \
        benchmark.AutoModelForSequenceClassification.from_pretrained
    monkeypatch.setattr(ppo, "sampling_config", lambda tokenizer, length, temperature: (
        seen["temperature"].append(temperature), sampling_config(tokenizer, length, temperature))[1])
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: seen["clip"].append(max_norm))
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, **k: (seen["lr"].append(lr), adamw(params, lr, **k))[1])
    monkeypatch.setattr(benchmark.AutoModelForSequenceClassification, "from_pretrained", lambda path, **k: (
        seen["critic"].append(path), from_pretrained(path, **k))[1])
    flags = benchmark.ppo_flags(args, str(tmp_path), "limit", 1)
    benchmark.limit_iteration(args, flags)(lambda name: contextlib.nullcontext())
    defaults = ppo.Args()
    reward = str(tmp_path / "reward_model")
    steps = 2 * args.num_ppo_epochs * args.num_mini_batches  # actor and critic, each mini-batch of each epoch
    assert seen == {"temperature": [defaults.temperature], "clip": [defaults.gradient_clipping] * steps,
                    "lr": [defaults.actor_learning_rate, defaults.critic_learning_rate], "critic": [reward, reward]}
    seen = {name: [] for name in seen}
    critic = str(shutil.copytree(reward, tmp_path / "critic"))  # a critic of its own
    benchmark.limit_iteration(args, [*flags, "--temperature", "0.7", "--gradient-clipping", "0", "--actor-learning-rate",
                                     "3e-6", "--critic-learning-rate", "2e-6", "--critic-model-name-or-path", critic]
                              )(lambda name: contextlib.nullcontext())
    assert seen == {"temperature": [0.7], "clip": [], "lr": [3e-6, 2e-6], "critic": [critic, reward]}
    # With --trl-python, ppo.py (and so the limit) runs at TRL's settings, on TRL's value model as its critic.
    trl_flags = tyro.cli(ppo.Args, args=benchmark.ppo_flags(dataclasses.replace(args, trl_python="python"),
                                                           str(tmp_path), "limit", 1))
    assert (trl_flags.temperature, trl_flags.kl_coef, trl_flags.gradient_clipping, trl_flags.actor_learning_rate,
            trl_flags.critic_model_name_or_path) == (0.7, 0.05, 0.0, 3e-6, str(tmp_path / "value_model"))


def test_the_limit_samples_as_ppo_does_at_its_flags(tmp_path, monkeypatch):
    """benchmark.limit_iteration samples with the sampler that ppo.py takes at the same flags: with --sampler static,
    one static sampler of the limit's actor, built before any iteration, its cache as long as the prompts (ppo_flags'
    --max-prompt-len) and the responses, and sample_static from it in each iteration; with the defaults (--sampler
    eager), ppo.sample. torch.compile stands aside here (seconds): test_fast_sampling.py compiles the step."""
    args = benchmark.Args(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=64, prompt_len=4,
                          response_len=4, episodes=4)
    benchmark.build_models(args, str(tmp_path))
    calls, sample = [], ppo.sample
    static_sampler, sample_static = fast_sampling.static_sampler, fast_sampling.sample_static

    def built(actor, config, is_main, settings, device):
        sampler = static_sampler(actor, config, is_main, settings, device)
        calls.append(("static_sampler", actor.module, sampler, sampler["cache"].get_max_length()))
        return sampler
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    monkeypatch.setattr(fast_sampling, "static_sampler", built)
    monkeypatch.setattr(fast_sampling, "sample_static", lambda sampler, model, *a: (
        calls.append(("sample_static", model, sampler)), sample_static(sampler, model, *a))[1])
    monkeypatch.setattr(ppo, "sample", lambda model, *a, **k: (calls.append(("sample", model)),
                                                               sample(model, *a, **k))[1])
    flags = benchmark.ppo_flags(args, str(tmp_path), "limit", 1)
    for sampler_flag in [["--sampler", "static"], []]:
        one_iteration = benchmark.limit_iteration(args, [*flags, *sampler_flag])
        built_before = list(calls)
        for _ in range(2):
            one_iteration(lambda name: contextlib.nullcontext())
        if sampler_flag:
            [(_, actor, sampler, length)] = built_before
            assert length == args.prompt_len + args.response_len
            assert calls == [built_before[0], ("sample_static", actor, sampler), ("sample_static", actor, sampler)]
        else:
            assert built_before == [] and [name for name, *_ in calls] == ["sample", "sample"]
        calls.clear()


def test_the_hardware_bound_is_its_arithmetic():
    """benchmark.hardware_bound, worked by hand: 4 episodes of 3 + 5 tokens (32 tokens), 2 layers of width 8, 2 PPO
    epochs of 2 mini-batches; actor and reference 1,000 parameters, critic and reward model 600, each with an input
    embedding of 200 (so 800, 800, 400 and 400 that multiply each token); 1 GB/s and 10 GFLOP/s measured.
    - forward and backward: 2 x 32 x (2,400 (the rollout) + 3 x 2 epochs x (800 + 400)) = 614,400 FLOPs: 61.44 us.
    - generation, in fp32: (800 x 4 = 3,200 bytes of weights + 32 x 2 layers x 2 x 8 x 4 = 4,096 bytes of cache)
      / 1 GB/s = 7.296 us a token, 36.48 us for 5 tokens; in bf16, 1,600 and 2,048 bytes.
    - optimizer steps: 2 x 2 steps x (1,000 + 600) x 28 bytes = 179,200 bytes: 179.2 us, in bf16 too.
    In all 277.12 us in fp32."""
    args = benchmark.Args(episodes=4, prompt_len=3, response_len=5, num_layers=2, hidden_size=8, num_ppo_epochs=2,
                          num_mini_batches=2)
    parameters = {"actor": 1000, "reference": 1000, "critic": 600, "reward": 600}
    bound = benchmark.hardware_bound(args, parameters, dict.fromkeys(parameters, 200), 1e9, 1e10)
    assert bound == pytest.approx({
        "bandwidth": 1e9, "matmul_flops": 1e10, "flops": 614_400, "weight_bytes": 3_200, "cache_bytes": 4_096,
        "floor_s": 7.296e-6, "optimizer_bytes": 179_200, "forward_and_backward_s": 61.44e-6, "generation_s": 36.48e-6,
        "optimizer_steps_s": 179.2e-6, "iteration_s": 277.12e-6})
    bf16 = benchmark.hardware_bound(dataclasses.replace(args, dtype="bf16"), parameters,
                                    dict.fromkeys(parameters, 200), 1e9, 1e10)
    assert (bf16["weight_bytes"], bf16["cache_bytes"], bf16["optimizer_bytes"]) == (1_600, 2_048, 179_200)


def test_each_models_zero_stage_and_who_asks_for_one_openmp_thread_under_zero3(monkeypatch):
    """ppo.zero_stages: the reference is ZeRO-3 with the actor or with its own offload, the reward model with the critic
    or its own offload, else plain (DeepSpeed-Chat's rule). Each stage asks plumbing.init_distributed for one OpenMP
    thread in gloo's threads when one of its models is under ZeRO-3 (test_plumbing checks what init_distributed does)."""
    def stages(**flags):
        return [ppo.zero_stages(ppo.Args(**flags))[model] for model in ["actor", "reference", "critic", "reward"]]
    assert stages() == [0, 0, 0, 0]
    assert stages(actor_zero_stage=2, critic_zero_stage=1) == [2, 0, 1, 0]
    assert stages(actor_zero_stage=3) == [3, 3, 0, 0]
    assert stages(critic_zero_stage=3) == [0, 0, 3, 3]
    assert stages(offload_reference_model=True) == [0, 3, 0, 0]
    assert stages(offload_reward_model=True) == [0, 0, 0, 3]
    # What each stage's main passes to init_distributed, its first call after the flags' checks (stopped there).
    asked = []

    def init_distributed(args, zero3):
        asked.append(zero3)
        raise InterruptedError

    monkeypatch.setattr(plumbing, "init_distributed", init_distributed)
    for script, flags, zero3 in [(ppo, {}, False), (ppo, {"actor_zero_stage": 2, "critic_zero_stage": 2}, False),
                                 (ppo, {"actor_zero_stage": 3}, True), (ppo, {"critic_zero_stage": 3}, True),
                                 (ppo, {"offload_reference_model": True}, True),
                                 (ppo, {"offload_reward_model": True}, True), (sft, {}, False),
                                 (sft, {"zero_stage": 3}, True), (reward_model, {}, False),
                                 (reward_model, {"zero_stage": 3}, True)]:
        with pytest.raises(InterruptedError):
            script.main(script.Args(**flags))
        assert asked.pop() is zero3, (script.__name__, flags)


def test_processes_take_turns(tmp_path):
    """benchmark.in_turns, as the benchmark runs ppo.py beside the limit (and beside TRL): each side, a fresh process
    that stops itself where an iteration starts (SIGSTOP, in TRL's process too), runs one iteration in its turn,
    never two sides at once, the order turning by one each iteration; the turns are timed from
    outside; one that ends early, or fails in its last turn, stops the benchmark with its output."""
    log = tmp_path / "log"
    code = ("import os, signal, sys, time\n"
            "for iteration in range(4):\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "    if sys.argv[1] == 'fails' and iteration == int(sys.argv[3]):\n"
            "        sys.exit(f'fails at iteration {iteration}')\n"
            "    start = time.time(); time.sleep(0.05)\n"
            "    with open(sys.argv[2], 'a') as f:\n"
            "        f.write(f'{sys.argv[1][0]}{iteration} {start} {time.time()}\\n')\n"
            "print('{\"done\": true}')\n")

    def side(name, fails_at=-1):
        return [sys.executable, "-c", code, name, str(log), str(fails_at)]

    lines, turns = benchmark.in_turns({"a": side("a"), "b": side("b"), "c": side("c")}, 4)
    order = [(name, float(begin), float(end)) for name, begin, end in
             sorted((line.split() for line in log.read_text().splitlines()), key=lambda line: float(line[1]))]
    assert [name for name, _, _ in order] == ["a0", "b0", "c0", "b1", "c1", "a1", "c2", "a2", "b2", "a3", "b3", "c3"]
    assert all(end <= later_begin for i, (_, _, end) in enumerate(order) for _, later_begin, _ in order[i + 1:])
    assert lines == {"a": '{"done": true}', "b": '{"done": true}', "c": '{"done": true}'}
    assert all(len(seconds) == 4 and min(seconds) >= 0.05 for seconds in turns.values()), turns
    # TRL's script in TRL's Python (here a stand-in and ours) stops for its turn where its trainer calls batch_generation.
    baseline = tmp_path / "baseline.py"
    baseline.write_text("import json, time, types\nppo_trainer = types.SimpleNamespace(batch_generation=time.sleep)\n"
                        "def import_trl_ppo():\n    return None, None, ppo_trainer\n"
                        "def main(argv):\n    for _ in range(4):\n        ppo_trainer.batch_generation(0.05)\n"
                        "    print(json.dumps(argv))\n")
    lines, turns = benchmark.in_turns({"a": side("a"), "trl": [sys.executable, "-c", benchmark.TRL_IN_TURNS,
                                                               str(baseline), "--iterations", "4"]}, 4)
    assert lines["trl"] == '["--iterations", "4"]' and len(turns["trl"]) == 4 and min(turns["trl"]) >= 0.05
    for fails_at, says in [(1, "did not stop for its next turn"), (3, "did not end")]:
        with pytest.raises(SystemExit, match=f"(?s)b {says} \\(exit status 1\\):.*fails at iteration {fails_at}"):
            benchmark.in_turns({"a": side("a"), "b": side("fails", fails_at)}, 4)


@pytest.mark.parametrize("apart", [False, True])
def test_benchmark_profile_takes_turns_with_the_limit(apart, monkeypatch, capsys):
    """--profile in one process (profile_in_turns): an iteration of the limit where each of ppo.py's starts, none at the
    last start (which only ends ppo.py's timed iterations), outside ppo.py's time and phases; each of ppo.py's timed
    iterations over the limit's just before it. With --profile-limit-apart all the limit's iterations come first, and
    the same figures. A fake clock: the limit's k-th iteration takes k + 1 s of generation and 0.25 s in
    ppo.response_logprobs inside it; ppo.py's k-th, 2 (k + 1) s of generation and 0.25 s of actor log-probs."""
    clock, events = [0.0], []

    def spend(seconds):
        clock[0] += seconds

    def limit_iteration(args, flags):
        def one_iteration(phase):
            k = events.count("limit")
            events.append("limit")
            with phase("generation"):
                spend(k + 1)
                ppo.response_logprobs(types.SimpleNamespace(training=False))  # the limit's, not ppo.py's, phase
            return {"rollout": k + 1.0, "update": 0.25}
        return one_iteration

    def run_ppo(flags, replacements):  # ppo.py's loop: the iteration's start, generation, the actor's log-probs
        with benchmark.contextlib.ExitStack() as patches:
            for (owner, name), function in replacements.items():
                patches.enter_context(benchmark.mock.patch.object(owner, name, function))
            for iteration in range(args.warmup_iterations + args.iterations + 1):
                ppo.prompts_of_iteration([], iteration, 0, None)
                events.append("ppo")
                ppo.sample()
                ppo.response_logprobs(types.SimpleNamespace(training=True))

    monkeypatch.setattr(benchmark, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(benchmark, "limit_iteration", limit_iteration)
    monkeypatch.setattr(benchmark, "run_ppo", run_ppo)
    monkeypatch.setattr(ppo, "prompts_of_iteration", lambda *a, **k: [])
    monkeypatch.setattr(ppo, "sample", lambda *a, **k: spend(2.0 * events.count("ppo")))
    monkeypatch.setattr(ppo, "response_logprobs", lambda *a, **k: spend(0.25))
    args = benchmark.Args(warmup_iterations=1, iterations=3, profile_limit_apart=apart)
    ppo_profile, limit = benchmark.profile_in_turns(args, "folder")
    assert events == (["limit"] * 4 + ["ppo"] * 5 if apart else ["limit", "ppo"] * 4 + ["ppo"])
    assert ppo_profile["timed"] == [4.25, 6.25, 8.25] and limit["timed"] == [2.25, 3.25, 4.25]  # no warm-up's
    assert ppo_profile["phases"] == {**dict.fromkeys(benchmark.PHASES, 0.0), "generation": 6.0, "actor log-probs": 0.25}
    assert limit["phases"] == {**dict.fromkeys(benchmark.PHASES, 0.0), "generation": 3.25}
    benchmark.print_profile(ppo_profile, limit)  # 4.25 / 2.25, 6.25 / 3.25, 8.25 / 4.25: the median 6.25 / 3.25
    assert "ppo.py's iteration over the limit's just before it, in this process: the median over 3 pairs 1.923" in \
        capsys.readouterr().out


def test_the_benchmark_runs_ppo_main_with_its_helpers_replaced_and_set_back():
    """benchmark.run_ppo runs ppo.main as `python ppo.py FLAGS` would (its messages named ppo.py), with module
    attributes replaced while it runs, and sets every one back as it was when the run stops."""
    originals, seen = (ppo.sample, ppo.check_args, sys.argv), []

    def stand_in(*a, **k):
        raise AssertionError("not reached: the run stops at its argument checks")

    def checked(args):  # where ppo.main starts: the replacements are in place, the run named ppo.py
        seen.append((ppo.sample is stand_in, sys.argv[0]))
        originals[1](args)

    with pytest.raises(SystemExit, match="^ppo.py: error: --total-episodes must be at least 1"):
        benchmark.run_ppo(["--total-episodes", "0"], {(ppo, "sample"): stand_in, (ppo, "check_args"): checked})
    assert seen == [(True, "ppo.py")] and (ppo.sample, ppo.check_args, sys.argv) == originals


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed-Chat's extras: EMA, LoRA, the pretraining mix, fp16 overflow alignment
# ---------------------------------------------------------------------------------------------------------------------
def saved_weights(folder):
    return safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))


def check_ema(out, stages, metrics, decay):
    """A run of one actor step per iteration, with an EMA, the pretraining mix and actor LoRA under ZeRO-3 on 2 ranks:
    the saved EMA is w0 averaged with the actor's weights w1, ..., wn after each step (its snapshots), e <- d e +
    (1 - d) w, each LoRA adapter merged into its layer (the average of the merged weights, not the product of the
    averaged factors)."""
    assert all(math.isfinite(m["loss/unsup_avg"]) and m["loss/unsup_avg"] > 0 for m in metrics)
    # Actor and reference, each gathered whole from its ZeRO-3 shards by plumbing.gathered, start as the same model.
    assert metrics[0]["objective/kl"] == 0.0
    history = [saved_weights(stages[1])] + [saved_weights(out / "snapshots" / f"iteration_{m['iteration']}")
                                            for m in metrics]
    ema, expected = saved_weights(out / "actor_ema"), dict(history[0])
    assert ema.keys() == history[-1].keys()
    assert all(torch.equal(weight, history[-1][name]) for name, weight in saved_weights(out / "actor").items())
    for weights in history[1:]:
        expected = {name: decay * expected[name] + (1 - decay) * weights[name] for name in expected}
    for name in ema:
        torch.testing.assert_close(ema[name], expected[name], rtol=0, atol=1e-6)
    # Not trivially true: the actor moved at each step, so the average differs from each of the weights it averages.
    for w in history:
        assert max((ema[name] - w[name]).abs().max().item() for name in ema) > 1e-5


def test_lora_trains_only_the_adapters(stages, tmp_path):
    """On 2 ranks, the actor under ZeRO-3 and the critic under ZeRO-0, with --only-optimize-lora: the saved (merged)
    models differ from where they started only by a rank-r update of the adapted layers, and the reference is the
    actor with its adapters off (the KL is exactly 0 before the first update, not after). The actor's weights are not
    gathered for the rollout, and its responses stop (EOS) at different tokens on the two ranks: ppo.sample steps on
    until both ranks' have stopped (synced), or the ranks' all-gathers would not match."""
    out = tmp_path / "lora"
    _, exp_name = run_ppo(stages, out, "--total-episodes", "32", "--actor-lora-dim", "4", "--critic-lora-dim", "4",
                          "--only-optimize-lora", "--actor-zero-stage", "3", "--no-gather-weights-for-rollout",
                          "--max-new-tokens", "40", ranks=2)
    metrics = read_metrics(exp_name)
    check_metrics(metrics, 2)
    assert metrics[0]["objective/kl"] == 0.0 and metrics[1]["objective/kl"] != 0.0
    for saved, start in [(out / "actor", stages[1]), (out / "critic", stages[3])]:
        trained, original = saved_weights(saved), saved_weights(start)
        assert trained.keys() == original.keys()  # a plain model: adapters merged, no lora_ names
        adapted = [name for name in trained if name.endswith("proj.weight")]
        assert len(adapted) == 7 * 4  # all-linear: q, k, v, o, gate, up, down in each of 4 layers
        for name in trained:
            delta = trained[name] - original[name]
            if name in adapted:
                assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta) <= 4, name
            else:  # embeddings, norms, the value head: untouched
                assert torch.equal(trained[name], original[name]), name


def test_lora_merged_save_gives_the_adapter_model_log_probs(stages, tmp_path):
    """plumbing.whole_state_dict(merge_lora=True) folds the adapters in: the saved folder loads with from_pretrained,
    without peft, and gives the log-probs of the model with adapters."""
    tokenizer = AutoTokenizer.from_pretrained(stages[1])
    model = plumbing.add_lora(AutoModelForCausalLM.from_pretrained(stages[1]), 4, ppo.Args())
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at 0; training makes it non-zero
                param.normal_(std=0.05)
    batch = tokenizer(["I watched this film last night and the story was", "We saw this"], return_tensors="pt",
                      padding=True)
    tokens = batch["input_ids"][:, 1:]

    def logprobs(m):
        with torch.no_grad():
            return rlhf_math.logprobs_from_logits(m(**batch).logits[:, :-1], tokens)

    adapter_logprobs = logprobs(model)
    with plumbing.adapters_disabled(model):
        assert not torch.allclose(logprobs(model), adapter_logprobs)  # the adapters do change the model
    plumbing.save_model_folder(model, tokenizer, str(tmp_path / "merged"), {"script": "ppo.py"},
                               plumbing.whole_state_dict(model, zero3=False, is_main=True, merge_lora=True))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logprobs(merged), adapter_logprobs, rtol=1e-5, atol=1e-5)  # float rounding


# Checks of what ppo.py and plumbing take from DeepSpeed's internals, in one process of their own (deepspeed_internals):
# DeepSpeed refuses fp16 on a CPU, and its fp16 code paths (loss scaling, overflow checks) run here once told otherwise.
SET_UP = """
import json, os, sys, torch, deepspeed, safetensors.torch
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM
import plumbing, ppo
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as plumbing.init_distributed on a CPU
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
accelerator = get_accelerator()
accelerator.is_fp16_supported = lambda: True
accelerator.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
"""

ALIGN_OVERFLOW_SCRIPT = """
for mode, stage in [(mode, stage) for mode in ("on", "off") for stage in (0, 1, 2, 3)]:
    def engine(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": stage}, "fp16": {"enabled": True, "initial_scale_power": 8},
                  "zero_allow_untested_optimizer": True}
        return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    actor, critic = engine(0), engine(1)
    for micro_step in range(8):  # 4 optimizer steps; the critic overflows in the 2nd, the actor in the 4th
        x = torch.randn(2, 8, dtype=torch.half)
        actor_loss, critic_loss = actor(x).float().mean(), critic(x).float().mean()
        if micro_step == 3:
            critic_loss = critic_loss * float("inf")
        if micro_step == 6:
            actor_loss = actor_loss * float("inf")
        actor.backward(actor_loss)
        critic.backward(critic_loss)
        with plumbing.aligned_overflow([actor, critic], enabled=mode == "on"):
            actor.step()
            critic.step()
    print(f"align {mode}, zero {stage}: actor skipped {actor.skipped_steps}, critic skipped {critic.skipped_steps}")
"""

MIXED_PRECISION_RESUME_SCRIPT = """
ids = torch.tensor([[5, 6, 7, 8]])
# LoRA's adapters trained beside the whole model (two parameter groups), or alone (--only-optimize-lora: the rest frozen)
for dtype, only_lora in [("fp16", False), ("bf16", False), ("bf16", True)]:
    args = ppo.Args(per_device_train_batch_size=1, num_iterations=1, dtype=dtype, only_optimize_lora=only_lora)
    args.gradient_accumulation_steps = 1
    for stage in (0, 2, 3):
        def engine():
            config = ppo.deepspeed_config(stage, True, False, args)
            config["fp16"]["initial_scale_power"] = 8
            return ppo.init_engine(AutoModelForCausalLM, "toy_task/base_model", "the toy model", config, args, 1e-3,
                                   lora_dim=2, lora_learning_rate=1e-3)
        trained = engine()
        for step in range(3):  # in fp16 the second step overflows: the scale halves, and the count restarts
            overflow = dtype == "fp16" and step == 1
            trained.backward(trained(input_ids=ids, labels=ids).loss * (float("inf") if overflow else 1.0))
            trained.step()
        folder = os.path.join(sys.argv[2], dtype, str(only_lora), str(stage))
        saved = json.loads(json.dumps(plumbing.save_training_state(trained, folder, True)))  # as state.json keeps it
        resumed = engine()
        plumbing.load_training_state(resumed, folder, saved, torch.device("cpu"))
        same_weights = all(torch.equal(plumbing.master_weight(trained, p), plumbing.master_weight(resumed, q))
                           for p, q in zip(trained.module.parameters(), resumed.module.parameters()))
        plumbing.save_training_state(resumed, folder + "_resumed", True)  # Adam's moments, as the resumed run has them
        moments = [safetensors.torch.load_file(os.path.join(f, "adam.safetensors"))
                   for f in (folder, folder + "_resumed")]
        adapted = [name for name in moments[0] if "lora_" in name]  # the frozen weights have none
        same_moments = moments[0].keys() == moments[1].keys() and adapted and (adapted == list(moments[0])) == only_lora \
            and all(torch.equal(moments[0][n], moments[1][n]) and moments[0][n].abs().sum() > 0 for n in moments[0])
        print(json.dumps({"dtype": dtype, "only_lora": only_lora, "stage": stage,
                          "trained": plumbing.loss_scale(trained), "resumed": plumbing.loss_scale(resumed),
                          "new": plumbing.loss_scale(engine()), "same_weights": same_weights,
                          "same_moments": bool(same_moments)}))
"""


@pytest.fixture(scope="module")
def deepspeed_internals(tmp_path_factory):
    """What ALIGN_OVERFLOW_SCRIPT, MIXED_PRECISION_RESUME_SCRIPT, GATHERED_SCRIPT and SAVE_SCRIPT print, run in this
    order in one process after SET_UP."""
    folder = tmp_path_factory.mktemp("internals")
    script = folder / "deepspeed_internals.py"
    script.write_text(SET_UP + ALIGN_OVERFLOW_SCRIPT + MIXED_PRECISION_RESUME_SCRIPT + GATHERED_SCRIPT + SAVE_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(free_port()), str(folder)], capture_output=True,
                            text=True, env={**ENV, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_align_overflow_skips_both_steps(deepspeed_internals):
    """fp16: with --align-overflow, when one model's gradients overflow both skip that step, on every ZeRO stage;
    without it, each skips only its own."""
    lines = [line for line in deepspeed_internals.splitlines() if line.startswith("align ")]
    assert lines == [f"align {mode}, zero {stage}: {skipped}" for mode, skipped in
                     [("on", "actor skipped 2, critic skipped 2"), ("off", "actor skipped 1, critic skipped 1")]
                     for stage in range(4)], deepspeed_internals[-2000:]


def test_mixed_precision_resume_keeps_master_weights_and_scale(deepspeed_internals):
    """fp16 and bf16 at ZeRO 0, 2 and 3, with LoRA (a second parameter group): a checkpoint keeps the fp32 master
    weights (at ZeRO-0 DeepSpeed's fp32 copies) and every group's Adam moments, and in fp16 DeepSpeed's dynamic loss
    scale after an overflow (the scale halved at ZeRO-0, the hysteresis spent at ZeRO 2 and 3, the steps since the
    overflow counted); --resume restores them all instead of starting over. With --only-optimize-lora (bf16) the
    frozen weights are kept as they are, and only the adapters have moments."""
    states = [json.loads(line) for line in deepspeed_internals.splitlines() if line.startswith('{"dtype"')]
    assert [(state["dtype"], state["only_lora"], state["stage"]) for state in states] == \
        [(d, only, s) for d, only in [("fp16", False), ("bf16", False), ("bf16", True)] for s in (0, 2, 3)]
    for state in states:
        assert state["same_weights"] and state["same_moments"], state
        if state["dtype"] == "fp16":
            assert state["trained"]["last_overflow_iter"] == 1 and state["trained"]["cur_iter"] == 3, state
            assert state["resumed"] == state["trained"] != state["new"], state
        else:
            assert state["trained"] is None and state["resumed"] is None, state


GATHERED_SCRIPT = """
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
args = ppo.Args(per_device_train_batch_size=2, num_iterations=1)
args.gradient_accumulation_steps = 1
ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])


def engine(trained, stage=3):
    torch.manual_seed(0)
    return ppo.init_engine(AutoModelForCausalLM, "toy_task/base_model", "the toy model",
                           ppo.deepspeed_config(stage, trained, False, args), args, 1e-2 if trained else None)


def logits(model):
    with torch.no_grad():
        return model(input_ids=ids).logits


for trained in (False, True):
    model = engine(trained)
    coordinator = getattr(model.optimizer, "parameter_offload", model.optimizer).get_param_coordinator()
    before = logits(model)
    assert torch.equal(logits(model), before)  # after two forward passes DeepSpeed has traced the module order
    partitioned = [p for p in model.module.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    assert partitioned and coordinator.is_complete_trace()
    with plumbing.gathered(model, True):
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE and p.numel() == p.ds_numel
                   for p in model.module.parameters()), "not every weight is whole"
        inside = logits(model)
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in model.module.parameters()), "a hook released one"
    assert torch.equal(inside, before), "a forward pass on the gathered weights differs"
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in partitioned), "not back to the shards"
    assert coordinator.is_complete_trace(), "DeepSpeed forgot the module order it traced"
    assert torch.equal(logits(model), before), "the hooks did not come back"  # the shards need them
    if trained:  # an optimizer step after a gathered rollout is the step without one, and ZeRO-0's
        others = [engine(True), engine(True, stage=0)]
        for m in (model, *others):
            m.backward(m(input_ids=ids, labels=ids).loss)
            m.step()
        assert torch.equal(logits(others[0]), logits(model)), "the update after gathering differs"
        torch.testing.assert_close(logits(others[1]), logits(model), rtol=0, atol=1e-5)
    print(f"trained={trained}: ok")
"""


def test_gathered_rollout_weights_are_whole_and_hooks_come_back(deepspeed_internals):
    """plumbing.gathered, which reaches into DeepSpeed's private ZeRO-3 hooks: inside it every weight of a frozen and of a
    trained ZeRO-3 engine is whole and stays whole through a forward pass (no hook partitions it again), with the
    same outputs; after it the weights are back in their shards, the hooks are back and DeepSpeed still has the
    module order it traced (it would trace it again, without prefetching, if the hooks were registered anew), and an
    optimizer step gives what it gives without the gathering, and under ZeRO-0 (no parameter kept whole under ZeRO-3).
    A DeepSpeed release that renames those attributes fails here."""
    assert [line for line in deepspeed_internals.splitlines() if line.startswith("trained=")] == \
        ["trained=False: ok", "trained=True: ok"], deepspeed_internals


SAVE_SCRIPT = """
import filecmp, peft
from transformers import AutoTokenizer
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
tokenizer = AutoTokenizer.from_pretrained("toy_task/base_model")
gathered_enter = GatheredParameters.__enter__


def whole_at_once(model, merge_lora):
    # The state dict the saves wrote before whole_state_dict, from a model whose weights are all gathered at once.
    if not merge_lora:
        return None  # save_pretrained's own: model.state_dict()
    state = {name.replace(".base_layer.", "."): value for name, value in model.state_dict().items()
             if "lora_" not in name}
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            state[f"{name}.weight"] = state[f"{name}.weight"] + module.get_delta_weight("default")
    return state


for stage, lora in [(3, 0), (3, 2), (0, 2)]:
    torch.manual_seed(0)
    model = ppo.init_engine(AutoModelForCausalLM, "toy_task/base_model", "the toy model",
                            ppo.deepspeed_config(stage, True, False, args), args, 1e-2, lora_dim=lora,
                            lora_learning_rate=1e-2)
    model.backward(model(input_ids=ids, labels=ids).loss)
    model.step()  # the weights, and the adapters' B, move from where they started
    params = list(model.module.parameters())
    peak = [0]  # the most elements whole at once on this rank, at the start of any gathering

    def counting_enter(self):
        gathered_enter(self)
        whole = [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
        peak[0] = max(peak[0], sum(p.ds_numel for p in whole))

    GatheredParameters.__enter__ = counting_enter
    folder = os.path.join(sys.argv[2], f"save_{stage}_{lora}")
    record = {"script": "ppo.py", "finished": True}
    plumbing.save_engine_folder(model, tokenizer, os.path.join(folder, "layer_by_layer"), record, merge_lora=True)
    GatheredParameters.__enter__ = gathered_enter
    with GatheredParameters(params, enabled=stage == 3):
        plumbing.save_model_folder(model.module, tokenizer, os.path.join(folder, "at_once"), record,
                                   whole_at_once(model.module, merge_lora=bool(lora)))
    names = sorted(os.listdir(os.path.join(folder, "at_once")))
    same = names == sorted(os.listdir(os.path.join(folder, "layer_by_layer"))) and all(filecmp.cmp(
        os.path.join(folder, "at_once", name), os.path.join(folder, "layer_by_layer", name), shallow=False)
        for name in names)
    # One layer: a module's own weights, or a LoRA layer's with its adapters
    layers = [m.parameters() if isinstance(m, peft.tuners.lora.LoraLayer) else m.parameters(recurse=False)
              for m in model.module.modules()]
    print(json.dumps({"save": [stage, lora], "same_bytes": same, "files": names, "peak": peak[0],
                      "largest_layer": max(sum(getattr(p, "ds_numel", p.numel()) for p in layer) for layer in layers),
                      "model": sum(getattr(p, "ds_numel", p.numel()) for p in params)}))
"""


def test_saves_gather_one_layer_at_a_time_and_write_the_same_folder(deepspeed_internals):
    """plumbing.save_engine_folder (the final models, the snapshots, sft.py and reward_model.py): under ZeRO-3 no
    more than one layer's weights are whole at once on a rank (a model that fits a GPU only in shards would not fit
    gathered whole), LoRA adapters folded in layer by layer; and the folder is byte for byte the one written from the
    whole model gathered at once, with and without adapters, under ZeRO-3 and ZeRO-0 (tied embeddings included: the
    toy model's output layer is its embedding)."""
    saves = [json.loads(line) for line in deepspeed_internals.splitlines() if line.startswith('{"save"')]
    assert [save["save"] for save in saves] == [[3, 0], [3, 2], [0, 2]], deepspeed_internals[-2000:]
    for save in saves:
        assert save["same_bytes"] and "model.safetensors" in save["files"], save
        assert 0 < save["peak"] <= save["largest_layer"] < save["model"] / 5 if save["save"][0] == 3 else \
            save["peak"] == 0, save
