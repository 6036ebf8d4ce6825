"""Stage 3 runs for real, for a few iterations, on the bundled toy task: on 2 ranks with the actor under ZeRO-3 and
with ZeRO-0, with the k3 KL estimator and the EOS trick, and killed then resumed. The stage-1 and stage-2 checkpoints
it starts from are trained here for a few steps first.
"""

import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlhf_math
from ppo import response_logits
from test_sft_and_reward_model import ENV, FEW_STEPS, bad, check_errors, error_of, run  # noqa: F401 (bad is a fixture)

# 2 iterations of 8 prompts per rank; PPO splits each rank's 8 into 2 mini-batches of 2 forward passes of 2.
FEW_ITERATIONS = ["--per-device-rollout-batch-size", "8", "--num-mini-batches", "2",
                  "--per-device-train-batch-size", "2", "--num-ppo-epochs", "2", "--max-new-tokens", "12",
                  "--sample-every", "1"]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """SFT and reward model checkpoints, a few steps each."""
    root = tmp_path_factory.mktemp("stages")
    run("sft.py", *FEW_STEPS, "--output-dir", str(root / "sft"))
    run("reward_model.py", *FEW_STEPS, "--model-name-or-path", str(root / "sft"), "--output-dir", str(root / "rm"))
    return ["--actor-model-name-or-path", str(root / "sft"), "--reward-model-name-or-path", str(root / "rm")]


def run_ppo(stages, out, *flags, ranks=None, check=True):
    exp_name = f"test_{os.path.basename(out)}"
    for old in glob.glob(f"runs/{exp_name}__*"):
        shutil.rmtree(old)
    result = run("ppo.py", *stages, *FEW_ITERATIONS, "--output-dir", str(out), "--exp-name", exp_name, *flags,
                 ranks=ranks, check=check)
    return result, exp_name


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


def test_generation_and_forward_log_probs_agree():
    """The log-probs ppo.py computes by a forward pass over prompt + response are those of the distribution the
    response was sampled from: same positions (left padding, the shift by one), same temperature."""
    tokenizer = AutoTokenizer.from_pretrained("toy_task/base_model", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained("toy_task/base_model")
    prompts = tokenizer(["I watched this film last night and", "We saw it"], padding=True, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**prompts, do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=8,
                         min_new_tokens=8, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tokenizer.pad_token_id)
    P = prompts["input_ids"].shape[1]
    responses = out.sequences[:, P:]
    sampled_logprobs = rlhf_math.logprobs_from_logits(torch.stack(out.logits, dim=1), responses, temperature=0.7)
    attention_mask = torch.cat([prompts["attention_mask"], torch.ones_like(responses)], dim=1)
    with torch.no_grad():
        logits = response_logits(model, out.sequences, attention_mask, P)
    forward_logprobs = rlhf_math.logprobs_from_logits(logits, responses, temperature=0.7)
    torch.testing.assert_close(forward_logprobs, sampled_logprobs, atol=1e-4, rtol=1e-4)


def test_two_ranks_zero0(stages, tmp_path):
    out = tmp_path / "z0"
    result, exp_name = run_ppo(stages, out, "--total-episodes", "32", ranks=2)
    check_metrics(read_metrics(exp_name), 2)
    check_actor_trained(out, stages)


def test_k3_estimator(stages, tmp_path):
    result, exp_name = run_ppo(stages, tmp_path / "k3", "--total-episodes", "16", "--kl-estimator", "k3")
    metrics = read_metrics(exp_name)
    check_metrics(metrics, 2)
    assert all(m["objective/kl"] >= 0 for m in metrics)  # k3 is never negative, per token


def test_missing_eos_penalty(stages, tmp_path):
    # With 2 new tokens almost no response reaches EOS; those score -1 in place of the reward model's score.
    result, exp_name = run_ppo(stages, tmp_path / "eos", "--total-episodes", "16", "--max-new-tokens", "2",
                               "--missing-eos-penalty", "1.0")
    for m in read_metrics(exp_name):
        if m["val/num_eos_tokens"] == 0:
            assert m["objective/scores"] == pytest.approx(-1.0)


def test_offload_bf16_and_gradient_checkpointing(stages, tmp_path):
    # --offload puts actor and critic optimizer states in CPU memory (DeepSpeedCPUAdam, compiled on first use);
    # the frozen models' own offload runs them under ZeRO-3 with their parameters in CPU memory.
    result, exp_name = run_ppo(stages, tmp_path / "offload", "--total-episodes", "16", "--offload",
                               "--offload-reference-model", "--offload-reward-model", "--dtype", "bf16",
                               "--actor-gradient-checkpointing", "--critic-gradient-checkpointing")
    check_metrics(read_metrics(exp_name), 2)
    check_actor_trained(tmp_path / "offload", stages)


def kill_after_checkpoint(stages, out, exp_name, flags, ranks, sig):
    """Start ppo.py (with --resume when a checkpoint exists), wait until it has completed a checkpoint of its own,
    then send `sig` to its whole process group (the launcher and its ranks, as a cluster scheduler would). Returns
    the iteration of the checkpoint and the iterations it logged."""
    marker = out / "resume" / "latest"
    before = marker.read_text() if marker.exists() else None
    command = [sys.executable, "ppo.py", *stages, *FEW_ITERATIONS, *flags, "--output-dir", str(out),
               "--exp-name", exp_name] + (["--resume"] if before else [])
    if ranks:
        command[1:2] = ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "ppo.py"]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    deadline = time.time() + 300
    while (not marker.exists() or marker.read_text() == before) and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(process.pid, sig)
    stderr = process.communicate()[1].decode()
    assert marker.exists() and marker.read_text() != before, stderr[-3000:]
    assert not (out / "actor").exists(), "the run finished before it could be killed"
    return int(marker.read_text().removeprefix("iteration_")), [m["iteration"] for m in read_metrics(exp_name)]


@pytest.mark.parametrize("ranks, sigs, flags", [
    (None, [signal.SIGTERM, signal.SIGKILL], []),
    (2, [signal.SIGKILL], ["--actor-zero-stage", "3", "--critic-zero-stage", "2", "--dtype", "bf16"]),
])
def test_killed_run_resumes_to_the_same_metrics(stages, tmp_path, ranks, sigs, flags):
    """Killed after a checkpoint, a run loses at most --save-every iterations, and --resume repeats exactly what the
    uninterrupted run did: optimizer moments and step counts, learning rates and the KL coefficient included."""
    flags = ["--total-episodes", str(64 * (ranks or 1)), "--save-every", "2", "--sample-every", "0", *flags]
    out = tmp_path / "straight"
    _, exp_name = run_ppo(stages, out, *flags, ranks=ranks)
    uninterrupted = read_metrics(exp_name)
    check_metrics(uninterrupted, 8)
    check_actor_trained(out, stages)

    out, exp_name, done = tmp_path / "killed", f"test_killed_{ranks}", 0
    for sig in sigs:
        checkpoint, logged = kill_after_checkpoint(stages, out, exp_name, flags, ranks, sig)
        assert logged[0] == done + 1 and checkpoint <= logged[-1] < checkpoint + 2  # lost < --save-every iterations
        done = checkpoint
    # Checkpoints are safetensors and JSON, nothing pickled; only the latest complete one is kept.
    files = sorted(str(p.relative_to(out / "resume")) for p in (out / "resume").rglob("*") if p.is_file())
    assert {os.path.splitext(f)[1] for f in files} <= {".safetensors", ".json", ""}, files
    assert {f.split(os.sep)[0] for f in files} == {"latest", f"iteration_{done}"}, files

    run("ppo.py", *stages, *FEW_ITERATIONS, *flags, "--output-dir", str(out), "--exp-name", exp_name, "--resume",
        ranks=ranks)
    resumed = read_metrics(exp_name)
    assert [m["iteration"] for m in resumed] == list(range(done + 1, 9))
    for after in resumed:
        before = uninterrupted[after["iteration"] - 1]
        for name in ["objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "lr"]:
            assert after[name] == pytest.approx(before[name], rel=1e-5, abs=1e-6), (after["iteration"], name)


def test_first_ratio_check_catches_dropout(stages, tmp_path):
    # The SFT model with attention dropout 0.3: kept on (--no-disable-dropout), the update's log-probs no longer
    # match the rollout's, and the run stops at the first mini-batch instead of training on a wrong ratio.
    model_dir = tmp_path / "with_dropout"
    shutil.copytree(stages[1], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    flags = ["--total-episodes", "16", "--actor-model-name-or-path", str(model_dir)]
    result, _ = run_ppo(stages, tmp_path / "dropout", *flags, "--no-disable-dropout", check=False)
    assert "iteration 0: the first PPO ratio is" in error_of(result)
    run_ppo(stages, tmp_path / "no_dropout", *flags)  # dropout disabled, as by default: the ratio is exactly 1


def test_a_batch_of_invalid_generations_with_nothing_to_reuse(stages, tmp_path):
    result, _ = run_ppo(stages, tmp_path, "--total-episodes", "16", "--min-response-tokens", "1000", check=False)
    assert "iteration 0: no response has --min-response-tokens 1000 real tokens" in error_of(result)


def test_a_non_finite_loss_stops_the_run(stages, tmp_path):
    result, _ = run_ppo(stages, tmp_path, "--total-episodes", "16", "--actor-learning-rate", "1e30",
                        "--critic-learning-rate", "1e30", check=False)
    assert "_avg is nan; lower the learning rates" in error_of(result)


def test_ppo_bad_input(stages, bad, tmp_path):
    check_errors("ppo.py", [*stages, *FEW_ITERATIONS, "--total-episodes", "16", "--output-dir", str(tmp_path)], [
        (["--total-episodes", "20"], "--total-episodes / (rollout batch x ranks): 20 is not divisible by 8"),
        (["--per-device-train-batch-size", "3"], "--per-device-train-batch-size: 4 is not divisible by 3"),
        (["--total-episodes", "0"], "--total-episodes must be at least 1, not 0"),
        (["--num-mini-batches", "0"], "--num-mini-batches must be at least 1, not 0"),
        (["--num-ppo-epochs", "0"], "--num-ppo-epochs must be at least 1, not 0"),
        (["--temperature", "0"], "--temperature must be positive, not 0.0"),
        (["--target-kl", "0"], "--target-kl must be positive, not 0.0"),
        (["--kl-coef", "-0.1"], "--kl-coef must not be negative, not -0.1"),
        (["--gamma", "2"], "--gamma must be between 0 and 1, not 2.0"),
        (["--missing-eos-penalty", "10"], "--missing-eos-penalty 10.0 must be in (0, --clip-score 5.0]"),
        (["--max-new-tokens", "200"], "--max-new-tokens 200 is longer than the model's 128 positions"),
        (["--output-dir", str(bad / "a_file")], "a_file' is a file; name a folder"),
        (["--dtype", "fp16"], "--dtype fp16 needs a GPU"),
        (["--prompt-column", "promt"], "has no column 'promt'; its columns are ['prompt', 'chosen', 'rejected', 'kind']"),
        (["--dataset", str(bad / "data.csv")], "data.csv' is not a .json, .jsonl or .parquet file"),
        (["--train-split", "validation"], "cannot load split 'validation' of data set 'toy_task/data' (Unknown split"),
        (["--dataset", str(bad / "empty_prompt.jsonl")], "row 1 of split 'train' has an empty 'prompt'"),
        (["--max-prompt-len", "2"], "no prompt of split 'train' fits --max-prompt-len 2; raise it"),
        (["--actor-model-name-or-path", str(bad / "empty_folder")],
         "holds no model (no config.json); run sft.py first or check --actor-model-name-or-path"),
        (["--actor-model-name-or-path", str(bad / "pickle_only")],
         "has no model.safetensors; only safetensors weights are loaded (no pickle)"),
        (["--reward-model-name-or-path", str(bad / "pickle_only")], "has no model.safetensors"),
        (["--reward-model-name-or-path", str(tmp_path / "missing")], "no model folder at"),
        (["--critic-model-name-or-path", str(bad / "no_weights")],
         "has no model weights (model.safetensors); run reward_model.py first or check --critic-model-name-or-path"),
        (["--resume"], "--resume: no complete checkpoint"),
    ])
    result = run("ppo.py", "--actor-zero-stage", "4", check=False)
    assert "invalid choice '4' for argument '--actor-zero-stage'" in result.stderr


def test_reward_model_with_another_tokenizer(stages, tmp_path):
    other = tmp_path / "other_rm"
    shutil.copytree(stages[3], other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<|a token the actor does not have|>"])
    tokenizer.save_pretrained(other)
    result, _ = run_ppo(stages, tmp_path, "--total-episodes", "16", "--reward-model-name-or-path", str(other),
                        check=False)
    assert "has another tokenizer than the actor" in error_of(result)


def test_evaluate(stages, tmp_path):
    """evaluate.py compares the SFT and PPO policies on held-out prompts and draws the training curves."""
    out = tmp_path / "ppo"
    _, exp_name = run_ppo(stages, out, "--total-episodes", "16")
    metrics_file = glob.glob(f"runs/{exp_name}__*/metrics.jsonl")[0]
    flags = ["--sft-model", stages[1], "--ppo-model", str(out / "actor"), "--reward-model", stages[3],
             "--split", "test[:40]", "--batch-size", "16", "--max-new-tokens", "12", "--metrics-file", metrics_file,
             "--output-dir", str(tmp_path / "eval")]
    result = run("evaluate.py", *flags)
    assert "win rate vs SFT" in result.stdout
    summary = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert summary["prompts"] == 40 and 0 <= summary["win_rate_ppo_over_sft"] <= 1
    for policy in ["sft", "ppo"]:
        assert all(math.isfinite(value) for value in summary[policy].values())
        assert 1 <= summary[policy]["mean_length"] <= 12  # --max-new-tokens of FEW_ITERATIONS
    assert (tmp_path / "eval" / "ppo_training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    flags[flags.index("--ppo-model") + 1] = str(tmp_path / "missing")
    result = run("evaluate.py", *flags, check=False)
    assert "no model.safetensors in" in error_of(result) and "--ppo-model" in error_of(result)
    read_metrics(exp_name)


def test_benchmark(tmp_path):
    """benchmark.py runs ppo.py (here also on 2 ranks with the actor under ZeRO-3 in fp32, where the first PPO ratio
    must be exactly 1) and the bare calls, and its figures show no gradients or optimizer state for frozen models."""
    output = tmp_path / "benchmark.json"
    run("benchmark.py", "--warmup-iterations", "0", "--iterations", "1", "--two-rank-stages", "3",
        "--output-json", str(output))
    result = json.loads(output.read_text())
    assert [r["config"] for r in result["rows"]] == ["1 rank, actor ZeRO-0", "2 ranks, actor ZeRO-3"]
    assert all(r["rollout_s"] > 0 and r["rollout_limit_s"] > 0 and r["update_limit_s"] > 0 for r in result["rows"])
    memory = {m["model"]: m for m in result["memory"]}
    for frozen in ["reference", "reward"]:
        assert memory[frozen]["gradients_mb"] == 0 and memory[frozen]["optimizer_state_mb"] == 0
    for trained in ["actor", "critic"]:  # AdamW: two moments per parameter
        assert memory[trained]["optimizer_state_mb"] >= 2 * memory[trained]["parameters_mb"] > 0

    # The GPU preset (Pythia-1B's shape, bf16), shrunk to run here.
    small = ["--hidden-size", "64", "--num-layers", "1", "--intermediate-size", "128", "--vocab-size", "512",
             "--prompt-len", "8", "--response-len", "8", "--episodes", "8"]
    run("benchmark.py", "--preset", "pythia-1b", *small, "--warmup-iterations", "0", "--iterations", "1",
        "--output-json", str(output))
    result = json.loads(output.read_text())
    assert result["args"]["dtype"] == "bf16" and result["args"]["num_heads"] == 8 and result["args"]["hidden_size"] == 64
    assert [r["config"] for r in result["rows"]] == ["1 rank, actor ZeRO-0"]
