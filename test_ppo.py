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
import types

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppo
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
    (None, [signal.SIGTERM, signal.SIGKILL], ["--enable-ema", "--actor-lora-dim", "4", "--critic-lora-dim", "4"]),
    (2, [signal.SIGKILL], ["--actor-zero-stage", "3", "--critic-zero-stage", "2", "--dtype", "bf16", "--enable-ema"]),
])
def test_killed_run_resumes_to_the_same_metrics(stages, tmp_path, ranks, sigs, flags):
    """Killed after a checkpoint, a run loses at most --save-every iterations, and --resume repeats exactly what the
    uninterrupted run did: optimizer moments and step counts, learning rates and the KL coefficient included, and
    the EMA and LoRA adapters (on one rank) or the EMA under ZeRO-3 in bf16 (on two) end where they would have."""
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
    # Checkpoints are safetensors and JSON, nothing pickled. A kill can land after `latest` names the new checkpoint
    # and before the older ones are deleted: those may remain until the next checkpoint, never a newer or partial one.
    files = sorted(str(p.relative_to(out / "resume")) for p in (out / "resume").rglob("*") if p.is_file())
    assert {os.path.splitext(f)[1] for f in files} <= {".safetensors", ".json", ""}, files
    folders = {f.split(os.sep)[0] for f in files} - {"latest"}
    assert f"iteration_{done}" in folders and all(int(f.removeprefix("iteration_")) <= done for f in folders), files

    run("ppo.py", *stages, *FEW_ITERATIONS, *flags, "--output-dir", str(out), "--exp-name", exp_name, "--resume",
        ranks=ranks)
    resumed = read_metrics(exp_name)
    assert [m["iteration"] for m in resumed] == list(range(done + 1, 9))
    # Only the latest complete checkpoint is kept once a run has saved one.
    assert sorted(os.listdir(out / "resume")) == ["iteration_8", "latest"]
    for after in resumed:
        before = uninterrupted[after["iteration"] - 1]
        for name in ["objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "lr"]:
            assert after[name] == pytest.approx(before[name], rel=1e-5, abs=1e-6), (after["iteration"], name)
    for folder in ["actor", "actor_ema"]:
        straight, resumed = saved_weights(tmp_path / "straight" / folder), saved_weights(out / folder)
        for name in straight:
            torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-5)


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


def test_a_half_precision_checkpoint_trains_in_fp32(stages, tmp_path):
    # transformers keeps a checkpoint's own dtype by default; --dtype fp32 (the default) must still train in fp32.
    half = tmp_path / "sft_fp16"
    AutoModelForCausalLM.from_pretrained(stages[1], dtype=torch.float16).save_pretrained(half)
    AutoTokenizer.from_pretrained(stages[1]).save_pretrained(half)
    _, exp_name = run_ppo(stages, tmp_path / "out", "--total-episodes", "16", "--actor-model-name-or-path", str(half))
    read_metrics(exp_name)
    assert {w.dtype for w in saved_weights(tmp_path / "out" / "actor").values()} == {torch.float32}


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
        (["--ema-decay", "1.5"], "--ema-decay must be between 0 and 1, not 1.5"),
        (["--only-optimize-lora"], "--only-optimize-lora needs the actor's adapters"),
        (["--actor-lora-dim", "4", "--lora-target-modules", "nothing_matches"],
         "--lora-target-modules 'nothing_matches'"),
        (["--unsup-dataset", str(tmp_path / "missing.txt")], "no data set at"),
        (["--unsup-dataset", "toy_task/data/test.jsonl"], "has no column 'text'; its columns are"),
        (["--unsup-dataset", str(bad / "data.csv")], "is not a .txt, .json, .jsonl or .parquet file"),
        (["--align-overflow"], "--align-overflow is for --dtype fp16"),
        (["--enable-hybrid-engine"], "--enable-hybrid-engine needs a GPU"),
        (["--inference-tp-size", "2"], "--inference-tp-size above 1 needs --enable-hybrid-engine"),
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


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed-Chat's extras: EMA, LoRA, the pretraining mix, fp16 overflow alignment
# ---------------------------------------------------------------------------------------------------------------------
# One actor optimizer step per iteration and a constant learning rate, so that the first iterations of a longer run
# are exactly a shorter run: the saved actors of runs of 1, 2, ... iterations are the actor's weight history.
ONE_STEP_PER_ITERATION = ["--num-mini-batches", "1", "--num-ppo-epochs", "1", "--lr-scheduler-type", "constant"]


def saved_weights(folder):
    return safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))


def test_ema_is_the_decayed_average_of_the_actor_weights(stages, tmp_path):
    """On 2 ranks, actor and critic under ZeRO-3 (with the pretraining mix and the critic's LoRA on too): after two
    actor steps, the saved EMA is d^2 w0 + (1 - d)(d w1 + w2) of the actor's weights w0 (SFT), w1, w2."""
    decay = 0.5
    history = [saved_weights(stages[1])]
    for iterations in (1, 2):
        out = tmp_path / f"iterations_{iterations}"
        _, exp_name = run_ppo(stages, out, "--total-episodes", str(16 * iterations), *ONE_STEP_PER_ITERATION,
                              "--enable-ema", "--ema-decay", str(decay), "--actor-zero-stage", "3",
                              "--critic-zero-stage", "3", "--unsup-dataset", "toy_task/pretrain.txt",
                              "--critic-lora-dim", "4", ranks=2)
        history.append(saved_weights(out / "actor"))
        metrics = read_metrics(exp_name)
        check_metrics(metrics, iterations)
        assert all(math.isfinite(m["loss/unsup_avg"]) and m["loss/unsup_avg"] > 0 for m in metrics)
        # Actor and reference, each gathered whole from its ZeRO-3 shards by ppo.gathered, start as the same model.
        assert metrics[0]["objective/kl"] == 0.0
    w0, w1, w2 = history
    ema = saved_weights(out / "actor_ema")
    assert ema.keys() == w2.keys()
    for name in ema:
        expected = decay**2 * w0[name] + (1 - decay) * (decay * w1[name] + w2[name])
        torch.testing.assert_close(ema[name], expected, rtol=0, atol=1e-6)
    # Not trivially true: the actor moved at each step, so the average differs from each of the weights it averages.
    for w in history:
        assert max((ema[name] - w[name]).abs().max().item() for name in ema) > 1e-5


def test_lora_trains_only_the_adapters(stages, tmp_path):
    """On 2 ranks, the actor under ZeRO-3 and the critic under ZeRO-0, with --only-optimize-lora: the saved (merged)
    models differ from where they started only by a rank-r update of the adapted layers, and the reference is the
    actor with its adapters off (the KL is exactly 0 before the first update, not after)."""
    out = tmp_path / "lora"
    _, exp_name = run_ppo(stages, out, "--total-episodes", "32", "--actor-lora-dim", "4", "--critic-lora-dim", "4",
                          "--only-optimize-lora", "--actor-zero-stage", "3", ranks=2)
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
    """ppo.save_hf_folder folds the adapters in: the saved folder loads with from_pretrained, without peft, and gives
    the log-probs of the model with adapters."""
    tokenizer = AutoTokenizer.from_pretrained(stages[1])
    model = ppo.add_lora(AutoModelForCausalLM.from_pretrained(stages[1]), 4, ppo.Args())
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
    with ppo.adapters_disabled(model):
        assert not torch.allclose(logprobs(model), adapter_logprobs)  # the adapters do change the model
    ppo.save_hf_folder(types.SimpleNamespace(module=model, zero_optimization_stage=lambda: 0), tokenizer,
                       str(tmp_path / "merged"), True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logprobs(merged), adapter_logprobs, rtol=1e-5, atol=1e-5)  # float rounding


def test_pretraining_mix_lowers_the_language_modelling_loss(stages, tmp_path):
    """The same PPO run with and without --unsup-dataset: the actor trained with the mix has the lower loss on the
    plain text."""
    tokenizer = AutoTokenizer.from_pretrained(stages[1])
    lines = open("toy_task/pretrain.txt").read().splitlines()[:200]
    losses = {}
    for mix in (False, True):
        out = tmp_path / f"mix_{mix}"
        flags = ["--unsup-dataset", "toy_task/pretrain.txt"] if mix else []
        _, exp_name = run_ppo(stages, out, "--total-episodes", "16", *flags)
        read_metrics(exp_name)
        actor = AutoModelForCausalLM.from_pretrained(out / "actor")
        with torch.no_grad():
            losses[mix] = sum(actor(**tokenizer(line, return_tensors="pt"),
                                    labels=tokenizer(line, return_tensors="pt")["input_ids"]).loss.item()
                              for line in lines) / len(lines)
    assert losses[True] < losses[False], losses


ALIGN_OVERFLOW_SCRIPT = """
import os, sys, torch, deepspeed
from deepspeed.accelerator import get_accelerator
import ppo
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
# DeepSpeed refuses fp16 on a CPU; its fp16 code paths (loss scaling, overflow checks) run here once told otherwise.
accelerator = get_accelerator()
accelerator.is_fp16_supported = lambda: True
accelerator.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
for stage in (0, 1, 2, 3):
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
        with ppo.aligned_overflow(actor, critic, enabled=sys.argv[2] == "on"):
            actor.step()
            critic.step()
    print(f"zero {stage}: actor skipped {actor.skipped_steps}, critic skipped {critic.skipped_steps}")
"""


def test_align_overflow_skips_both_steps(tmp_path):
    """fp16 (made to run on this CPU): with --align-overflow, when one model's gradients overflow both skip that
    step, on every ZeRO stage; without it, each skips only its own."""
    script = tmp_path / "align_overflow.py"
    script.write_text(ALIGN_OVERFLOW_SCRIPT)
    for mode, skipped in [("on", "actor skipped 2, critic skipped 2"), ("off", "actor skipped 1, critic skipped 1")]:
        result = subprocess.run([sys.executable, str(script), str(29600 + len(mode)), mode], capture_output=True,
                                text=True, env={**ENV, "PYTHONPATH": os.getcwd()}, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [line for line in result.stdout.splitlines() if line.startswith("zero ")]
        assert lines == [f"zero {stage}: {skipped}" for stage in range(4)], result.stdout[-2000:]
