"""Benchmark: ppo.py (ppo.main) against the limit of its own model calls (limit_iteration), on random models whose EOS
is too rare to stop all responses early, and both against the device's hardware bound (hardware_bound). A shared CPU's
speed drifts by tens of percent within seconds, so the two take turns, one iteration each: in fresh processes for the
table (in_turns), in this one for the profile (profile_in_turns).

    python benchmark.py                       # the table, then the profile (75 s on 2 cores)
    python benchmark.py --profile             # where one iteration's time goes, phase by phase, against the limit
    python benchmark.py --preset pythia-1b    # a GPU shape like Pythia-1B, in bf16
    python benchmark.py --trl-python trl-venv/bin/python   # ppo.py against TRL 1.12's PPOTrainer
"""

import contextlib
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from typing import Literal
from unittest import mock

import torch
import tyro
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          LlamaConfig, PreTrainedTokenizerFast)
from transformers.utils import logging

import fast_sampling
import plumbing
import ppo
import rlhf_math

logging.disable_progress_bar()

PRESETS = {"pythia-1b": dict(hidden_size=2048, num_layers=16, num_heads=8, intermediate_size=8192, vocab_size=50304,
                             dtype="bf16", prompt_len=64, response_len=64, episodes=64)}


@dataclass
class Args:
    preset: Literal["cpu", "pythia-1b"] = "cpu"
    """the default CPU shape, or a preset of PRESETS (for a GPU) whose shape becomes the defaults: a flag given wins"""
    vocab_size: int = 1024
    """vocabulary of the random models"""
    hidden_size: int = 128
    """model width"""
    num_layers: int = 2
    """transformer blocks"""
    num_heads: int = 4
    """attention heads"""
    intermediate_size: int = 256
    """width of the MLP"""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """precision of the four models"""
    sampler: Literal["eager", "static"] = "eager"
    """ppo.py's --sampler (and the limit's)"""
    prompt_len: int = 16
    """tokens per prompt"""
    response_len: int = 32
    """tokens per response: generation runs this long while any response is open"""
    episodes: int = 32
    """episodes per iteration"""
    num_ppo_epochs: int = 2
    """PPO epochs per iteration"""
    num_mini_batches: int = 2
    """mini-batches per PPO epoch, one forward pass each"""
    warmup_iterations: int = 2
    """iterations run but not timed"""
    iterations: int = 10
    """iterations timed"""
    repeats: int = 5
    """rounds of fresh processes taking turns; the table's figures are medians over all rounds"""
    output_json: str = "benchmark.json"
    """where the table, the profile and the hardware bound are written"""
    profile: bool = False
    """only the profile: where one iteration's time goes, phase by phase, in ppo.py and the limit, in this process"""
    profile_limit_apart: bool = False
    """the profile's limit timed before ppo.py loads, not beside it (--preset pythia-1b's 8 models overfill 80 GB)"""
    trl_python: str | None = None
    """a Python with trl==1.12.0 (not ours): ppo.py and the limit on TRL's models at its settings, TRL in the turns"""
    trl_script: str = "../shared/peers/trl_ppo_baseline.py"
    """the script that builds TRL's models and runs its PPOTrainer (--trl-python)"""


def main(args: Args) -> None:
    print(f"shape: {args.episodes} episodes of {args.prompt_len} + {args.response_len} tokens, {args.num_layers} layers"
          f" of width {args.hidden_size} ({args.num_heads} heads, MLP {args.intermediate_size}), vocabulary "
          f"{args.vocab_size}, {args.dtype}; on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'},"
          f" {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f}", flush=True)
    rates = measured_rates(args)  # before any model is on the device; its tensors' memory given back
    get_accelerator().empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        build_models(args, folder)
        bound = hardware_bound(args, *parameter_counts(ppo_flags(args, folder, "bound", 1)), **rates)
        pairs = [] if args.profile else table_pairs(args, folder)  # --profile: no table
        print("the profile: ppo.py and the limit in this process, phase by phase ...", flush=True)
        ppo_profile, limit_profile = profile_in_turns(args, folder)

    rows = [table_row(args, pairs)] if pairs else []
    for r in rows:
        print(f"\n| config | rollout s (limit, ratio) | update s (limit, ratio) | iteration s (ratio) | episodes/s | "
              f"gen tokens/s | gen share | peak memory GB (allocated / reserved) |\n"
              f"|---|---|---|---|---|---|---|---|\n| {r['config']} | {r['rollout_s']:.3f} ({r['rollout_limit_s']:.3f}, "
              f"{r['rollout_ratio']:.2f}) | "
              f"{r['update_s']:.3f} ({r['update_limit_s']:.3f}, {r['update_ratio']:.2f}) | {r['iteration_s']:.3f} "
              f"({r['iteration_ratio']:.2f}) | {r['episodes_per_s']:.1f} | {r['generated_tokens_per_s']:.0f} | "
              f"{r['generation_share']:.0%} | {r['gpu_max_allocated_gb']:.2f} / {r['gpu_max_reserved_gb']:.2f} |")
        print(f"\nEach ratio is the median over {len(pairs)} pairs of an iteration of ppo.py and the limit's next to "
              f"it in time; load average now {os.getloadavg()[0]:.2f}.\n\nWhere the time of an iteration goes, in one "
              "process:")
    print_profile(ppo_profile, limit_profile)
    generation_ms = print_bound(args, bound, ppo_profile, limit_profile)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.output_json, "w") as f:
        json.dump({"commit": commit, "args": asdict(args), "rows": rows,
                   "pairs": [(seconds(ours), seconds(limit)) for ours, limit in pairs],
                   "profile": {"ppo.py": ppo_profile, "limit": limit_profile},
                   "generation_ms_per_token": generation_ms, "bound": bound}, f, indent=2)
    print(f"wrote {args.output_json}")


def build_models(args: Args, folder: str) -> None:
    """In folder, a random policy and reward model with a word-level tokenizer whose EOS, id vocab_size, has the models'
    last embedding row (ppo.py needs one), or with --trl-python TRL's, and a value model; their prompts as text."""
    if args.trl_python:
        subprocess.run([args.trl_python, *trl_command(args, folder, 1, False)], check=True, stdout=subprocess.DEVNULL)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
        with open(os.path.join(folder, "prompts.jsonl")) as f:
            prompts = [tokenizer.decode(json.loads(line)["input_ids"]) for line in f]
    else:
        words = ["<pad>"] + [f"w{i}" for i in range(1, args.vocab_size)]
        tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.add_special_tokens(["<pad>", "<eos>"])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
        config = LlamaConfig(vocab_size=args.vocab_size + 1, hidden_size=args.hidden_size,
                             num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
                             intermediate_size=args.intermediate_size, pad_token_id=0, num_labels=1,
                             max_position_embeddings=args.prompt_len + args.response_len, tie_word_embeddings=False)
        torch.manual_seed(0)
        for name, model_class in [("policy", AutoModelForCausalLM),
                                  ("reward_model", AutoModelForSequenceClassification)]:
            model_class.from_config(config).save_pretrained(os.path.join(folder, name))
            tokenizer.save_pretrained(os.path.join(folder, name))
        ids = torch.randint(1, args.vocab_size, (args.episodes * (args.warmup_iterations + args.iterations + 1),
                                                 args.prompt_len), generator=torch.Generator().manual_seed(0))
        prompts = [" ".join(f"w{i}" for i in row) for row in ids.tolist()]
    with open(os.path.join(folder, "prompts_text.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts)

def ppo_flags(args: Args, folder: str, exp_name: str, iterations: int) -> list[str]:
    """ppo.py's flags for the models of build_models, their prompts and the shape, on one rank; with --trl-python, at
    TRL's settings where ppo.py's defaults differ (TRL's PPOTrainer clips no gradient); ppo.py's defaults otherwise."""
    trl = ["--critic-model-name-or-path", os.path.join(folder, "value_model"), "--temperature", "0.7", "--kl-coef",
           "0.05", "--actor-learning-rate", "3e-6", "--critic-learning-rate", "3e-6", "--gradient-clipping", "0"]
    return ["--actor-model-name-or-path", os.path.join(folder, "policy"), "--reward-model-name-or-path",
            os.path.join(folder, "reward_model"), "--dataset", os.path.join(folder, "prompts_text.jsonl"),
            "--max-prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.response_len),
            "--total-episodes", str(args.episodes * iterations), "--per-device-rollout-batch-size", str(args.episodes),
            "--num-ppo-epochs", str(args.num_ppo_epochs), "--num-mini-batches", str(args.num_mini_batches),
            "--per-device-train-batch-size", str(args.episodes // args.num_mini_batches), "--dtype", args.dtype,
            "--sampler", args.sampler,
            "--sample-every", "0", "--exp-name", exp_name, "--output-dir", os.path.join(folder, exp_name),
            *(trl if args.trl_python else [])]


# --- Turns: fresh processes, one iteration each, the others stopped (ppo.py, the limit, TRL), and the table. ---
def table_pairs(args: Args, folder: str) -> list[tuple[dict, dict]]:
    """The table's rounds: ppo.py and the limit (with --trl-python TRL's two variants too) in fresh processes taking
    turns, one iteration each; each timed iteration of ppo.py paired with the limit's next to it. With --trl-python,
    ppo.py's and the limit's episodes per second over TRL's are printed."""
    turns_per_round = args.warmup_iterations + args.iterations + 1  # the last ends each process: not timed
    flags = ppo_flags(args, folder, "benchmark", turns_per_round)
    sides = {"ppo.py": benchmark_call("ppo_in_turns", args, flags),
             "limit": benchmark_call("limit_in_turns", args, flags)}
    for name, gc_freeze in [("TRL with gc.freeze()", True), ("TRL as shipped", False)] if args.trl_python else []:
        sides[name] = [args.trl_python, "-c", TRL_IN_TURNS, *trl_command(  # TRL builds the same models again
            args, os.path.join(folder, f"trl_{gc_freeze}"), turns_per_round, gc_freeze)]
    pairs, turns = [], {name: [] for name in sides}
    for round_number in range(1, args.repeats + 1):
        print(f"round {round_number}/{args.repeats}: {', '.join(sides)}, taking turns ...", flush=True)
        lines, seconds_of = in_turns(sides, turns_per_round)
        pairs += zip(json.loads(lines["ppo.py"]), json.loads(lines["limit"]))
        for name in sides:
            turns[name] += seconds_of[name][args.warmup_iterations:-1]
    for ours in ["ppo.py", "limit"] if args.trl_python else []:  # a turn: an iteration, its logging included
        over = [statistics.median(t / o for t, o in zip(turns[name], turns[ours])) for name in list(sides)[2:]]
        print(f"{ours}'s episodes per second over TRL's (median of {len(turns[ours])} pairs of iterations next to "
              f"each other): over TRL with gc.freeze() {over[0]:.2f}, over TRL as shipped {over[1]:.2f}")
    return pairs

def in_turns(commands: dict[str, list[str]], iterations: int) -> tuple[dict[str, str], dict[str, list[float]]]:
    """Sides that take turns, one iteration each, in an order turning by one each iteration: commands in fresh
    processes that stop themselves (SIGSTOP) where each iteration starts, and end in their last turn; in a
    side's turn the others are stopped, their OpenMP workers too. Returns each side's last line and turns' seconds."""
    processes, outputs, turns = {}, {}, {name: [] for name in commands}
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore"}

    def output_of(name: str) -> str:
        outputs[name].seek(0)
        return outputs[name].read().strip()

    def until_stopped(name: str, last: bool) -> None:  # stopped for its next turn, or in its last turn ended
        _, status = os.waitpid(processes[name].pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            processes[name].returncode = os.waitstatus_to_exitcode(status)
        if not (processes[name].returncode == 0 if last else os.WIFSTOPPED(status)):
            raise SystemExit(f"benchmark.py: {name} did not {'end' if last else 'stop for its next turn'} (exit "
                             f"status {processes[name].returncode}):\n{output_of(name)[-3000:]}")
    try:
        for name, command in commands.items():
            outputs[name] = tempfile.TemporaryFile("w+")
            processes[name] = subprocess.Popen(command, env=env, stdout=outputs[name], stderr=subprocess.STDOUT)
        for name in commands:  # each loads its models, then stops before its first iteration
            until_stopped(name, last=False)
        for iteration in range(iterations):
            for name in list(commands)[iteration % len(commands):] + list(commands)[:iteration % len(commands)]:
                begin = time.perf_counter()
                os.kill(processes[name].pid, signal.SIGCONT)
                until_stopped(name, last=iteration == iterations - 1)
                turns[name].append(time.perf_counter() - begin)
        return {name: output_of(name).splitlines()[-1] for name in commands}, turns
    finally:
        for name, process in processes.items():
            if process.returncode is None:
                process.kill()
                process.wait()
            outputs[name].close()

def benchmark_call(function: str, args: Args, flags: list[str]) -> list[str]:
    """The command of benchmark.FUNCTION(args, flags) in a new Python process, as ppo.py's runs are."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import benchmark; "
            "getattr(benchmark, sys.argv[2])(benchmark.Args(**json.loads(sys.argv[3])), json.loads(sys.argv[4]))")
    return [sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), function,
            json.dumps(asdict(args)), json.dumps(flags)]

def ppo_in_turns(args: Args, flags: list[str]) -> None:
    """ppo.py (run_ppo), waiting for its turn before each iteration, outside its timings; then its timed metrics."""
    timed, prompts_of_iteration, log_iteration = [], ppo.prompts_of_iteration, ppo.log_iteration

    def in_turn(*a, **k):
        os.kill(os.getpid(), signal.SIGSTOP)  # until in_turns continues this process for its turn
        return prompts_of_iteration(*a, **k)

    def kept(metrics, *a, **k):
        timed.append({"rollout": metrics["time/rollout"], "update": metrics["time/update"], **metrics})
        return log_iteration(metrics, *a, **k)
    run_ppo(flags, {(ppo, "prompts_of_iteration"): in_turn, (ppo, "log_iteration"): kept})
    print(json.dumps(timed[args.warmup_iterations:][:args.iterations]))

def limit_in_turns(args: Args, flags: list[str]) -> None:
    """The limit of ppo.py with these flags, waiting for its turn before each iteration; then the timed ones as JSON."""
    one_iteration, timed = limit_iteration(args, flags), []
    for _ in range(args.warmup_iterations + args.iterations):
        os.kill(os.getpid(), signal.SIGSTOP)
        timed.append(one_iteration(lambda name: contextlib.nullcontext()))
    os.kill(os.getpid(), signal.SIGSTOP)  # the last turn, in which the other sides end
    print(json.dumps(timed[args.warmup_iterations:]))

def run_ppo(flags: list[str], replacements: dict) -> None:
    """ppo.py in this process as `python ppo.py FLAGS` runs it (ppo.main), with module attributes replaced while it
    runs, (owner, name) -> what stands in: ppo.main looks each helper up in ppo's globals when it calls it."""
    with contextlib.ExitStack() as patches:  # each attribute set back as it was when the run ends or stops
        for (owner, name), value in {(sys, "argv"): ["ppo.py", *flags], **replacements}.items():
            patches.enter_context(mock.patch.object(owner, name, value))
        ppo.main(tyro.cli(ppo.Args, args=flags))

def seconds(times: dict) -> float:
    return times["rollout"] + times["update"]

def table_row(args: Args, pairs: list[tuple[dict, dict]]) -> dict:
    """Median times and ratios of pairs of ppo.py's iteration (its metrics) and the limit's, throughput, peak memory."""
    metrics = [m for m, _ in pairs]
    if any(m["val/response_length"] < 0.9 * args.response_len for m in metrics):  # a random model rarely samples EOS
        raise SystemExit("benchmark.py: responses stopped early; the timings would not compare")
    ours, limit = ({key: statistics.median(t[key] for t in side) for key in ["rollout", "update"]}
                   for side in zip(*pairs))
    ratios = {key: statistics.median(o[key] / l[key] for o, l in pairs) for key in ["rollout", "update"]}
    ratios["iteration"] = statistics.median(seconds(o) / seconds(l) for o, l in pairs)
    generation = statistics.median(m["time/generation"] for m in metrics)
    return {"config": "1 rank, actor ZeRO-0", "rollout_s": ours["rollout"], "rollout_limit_s": limit["rollout"],
            "update_s": ours["update"], "update_limit_s": limit["update"], "iteration_s": seconds(ours),
            "iteration_limit_s": seconds(limit), **{f"{key}_ratio": value for key, value in ratios.items()},
            "generation_share": generation / seconds(ours), "episodes_per_s": args.episodes / seconds(ours),
            "generated_tokens_per_s": args.episodes * args.response_len / generation,
            **{f"gpu_{name}": max(m[f"memory/{name}"] for m in metrics)
               for name in ["max_allocated_gb", "max_reserved_gb"]}}


# --- The limit, and phases: where an iteration's time goes. ---
PHASES = ["generation", "actor log-probs", "reference log-probs", "critic values", "reward scores",
          "rewards, GAE and whitening", "actor forward and loss", "critic forward and loss", "actor backward",
          "critic backward", "optimizer steps", "checks, statistics and logging"]

def limit_iteration(args: Args, flags: list[str]):
    """The least ppo.py run with `flags` must do in an iteration: its model calls, through its own helpers on plain
    torch models at its settings, and a fused AdamW: no DeepSpeed, checks, statistics, logging or learning-rate
    schedule. Returns one_iteration(phase) -> its rollout and update seconds, each phase in `with phase(name)`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        plumbing.keep_freed_memory()  # as plumbing.init_distributed sets up a rank of ppo.py on a CPU
    dtype = plumbing.TORCH_DTYPES[args.dtype]
    settings = tyro.cli(ppo.Args, args=flags)  # ppo.py's arguments: the flags, and its defaults for the rest
    tokenizer = AutoTokenizer.from_pretrained(settings.actor_model_name_or_path)
    actor, reference, critic, reward = (
        model_class.from_pretrained(path, dtype=dtype).to(device).train(trained).requires_grad_(trained)
        for (model_class, path), trained in zip(models_of(settings).values(), [True, False, True, False]))
    # In bf16, AdamW steps fp32 copies of the weights, as DeepSpeed's mixed precision does for ppo.py.
    trained = [list(model.parameters()) for model in (actor, critic)]
    masters = [[p.detach().float() for p in params] if dtype != torch.float32 else params for params in trained]
    optimizers = [torch.optim.AdamW(master, lr=lr, weight_decay=0.0, fused=True)
                  for master, lr in zip(masters, [settings.actor_learning_rate, settings.critic_learning_rate])]
    mini = args.episodes // args.num_mini_batches  # one forward pass per mini-batch, as ppo_flags gives ppo.py
    prompts = torch.randint(1, args.vocab_size, (args.episodes, args.prompt_len), device=device)
    prompt_mask = torch.ones_like(prompts)
    generation_config = ppo.sampling_config(tokenizer, args.response_len, settings.temperature)
    # ppo.main's sampler; the static one, as ppo.py's, built (its decode step compiled) before any iteration.
    sample = ppo.sample if settings.sampler == "eager" else fast_sampling.sampler(
        types.SimpleNamespace(module=actor), generation_config, False, settings, device)
    P, T = args.prompt_len, settings.temperature

    def one_iteration(phase) -> dict:
        get_accelerator().synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            with phase("generation"):
                actor.eval()
                responses = sample(actor, prompts, prompt_mask, generation_config, False)
                actor.train()
            sequences = torch.cat([prompts, responses], dim=1)
            mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
            attention = torch.cat([prompt_mask, mask], dim=1)
            with phase("actor log-probs"):
                logprobs = ppo.in_micro_batches(ppo.response_logprobs, mini, actor, sequences, attention, P, T)
            with phase("reference log-probs"):
                ref_logprobs = ppo.in_micro_batches(ppo.response_logprobs, mini, reference, sequences, attention, P, T)
            with phase("critic values"):
                values = ppo.in_micro_batches(ppo.critic_values, mini, critic, sequences, attention, P, 0.0, 1.0)
            with phase("reward scores"):
                scores = ppo.in_micro_batches(ppo.reward_scores, mini, reward, sequences, attention, P, 0.0, 1.0)
            with phase("rewards, GAE and whitening"):
                rewards, _ = rlhf_math.per_token_rewards(scores, logprobs, ref_logprobs, mask, settings.kl_coef,
                                                         settings.clip_score, settings.kl_estimator)
                advantages, returns = rlhf_math.gae_advantages_and_returns(rewards, values, mask, settings.gamma,
                                                                           settings.lam)
                advantages = rlhf_math.masked_whiten(advantages, mask)
        get_accelerator().synchronize()
        rollout_end = time.perf_counter()
        for epoch in range(args.num_ppo_epochs):
            for i in torch.randperm(args.episodes, device=device).split(mini):
                with phase("actor forward and loss"):
                    new_logprobs = ppo.response_logprobs(actor, sequences[i], attention[i], P, T)
                    pg_loss, _ = rlhf_math.policy_loss(new_logprobs, logprobs[i], advantages[i], mask[i],
                                                       settings.cliprange)
                with phase("critic forward and loss"):
                    new_values = ppo.critic_values(critic, sequences[i], attention[i], P, 0.0, 1.0)
                    vf_loss, _ = rlhf_math.value_loss(new_values, values[i], returns[i], mask[i],
                                                      settings.cliprange_value)
                with phase("actor backward"):
                    pg_loss.backward()
                with phase("critic backward"):
                    vf_loss.backward()
                with phase("optimizer steps"):
                    for params, master, optimizer in zip(trained, masters, optimizers):
                        if master is not params:  # bf16: the gradients to the fp32 copy
                            for m, p in zip(master, params):
                                m.grad, p.grad = p.grad.float(), None
                        if settings.gradient_clipping > 0:  # 0: none (TRL's trainer clips none)
                            torch.nn.utils.clip_grad_norm_(master, settings.gradient_clipping)
                        optimizer.step()
                        optimizer.zero_grad()
                        if master is not params:  # bf16: the updated weights back to the model
                            with torch.no_grad():
                                torch._foreach_copy_(params, master)
        get_accelerator().synchronize()
        return {"rollout": rollout_end - start, "update": time.perf_counter() - rollout_end}
    return one_iteration

def models_of(settings: ppo.Args) -> dict:
    """ppo.py's four models at these settings, name -> (class, folder); the critic's: its own, or the reward model's."""
    actor = AutoModelForCausalLM, settings.actor_model_name_or_path
    reward = AutoModelForSequenceClassification, settings.reward_model_name_or_path
    return {"actor": actor, "reference": actor, "critic": (reward[0], settings.critic_model_name_or_path or reward[1]),
            "reward": reward}

def phase_timer():
    """(totals, phase): `with phase(name):` adds its time, the accelerator synced, to totals[name] (if outermost)."""
    totals, open_phases = dict.fromkeys(PHASES, 0.0), []

    @contextlib.contextmanager
    def phase(name: str):
        get_accelerator().synchronize()
        start = time.perf_counter()
        open_phases.append(name)
        try:
            yield
        finally:
            open_phases.pop()
            get_accelerator().synchronize()
            if not open_phases:
                totals[name] += time.perf_counter() - start
    return totals, phase


# --- The profile: ppo.py's iteration phase by phase, in this process, taking turns with the limit's. ---
# (owner, name) -> a call's phase in ppo.main: a name, (with gradients, without) or f(its arguments); None: its caller's
PHASE_OF = {
    (ppo, "sample"): "generation", (fast_sampling, "sample_static"): "generation",
    (ppo, "response_logprobs"): lambda model, *a, **k: "actor log-probs" if model.training else "reference log-probs",
    (ppo, "critic_values"): ("critic forward and loss", "critic values"),
    (ppo, "reward_scores"): "reward scores",
    **{(owner, name): "rewards, GAE and whitening" for owner, name in [
        (ppo, "batch_mean_var"), (rlhf_math, "per_token_rewards"), (rlhf_math, "gae_advantages_and_returns"),
        (rlhf_math, "masked_whiten")]},
    (ppo, "response_logits"): ("actor forward and loss", None), (rlhf_math, "policy_loss"): "actor forward and loss",
    (rlhf_math, "logprobs_from_logits"): ("actor forward and loss", None),
    (rlhf_math, "value_loss"): "critic forward and loss", (DeepSpeedEngine, "step"): "optimizer steps",
    (DeepSpeedEngine, "backward"): lambda engine, *a, **k: "critic backward" if hasattr(engine.module, "score")
    else "actor backward",
    **{(ppo, name): "checks, statistics and logging" for name in [
        "check_finite_rollout", "check_update", "new_update_sums", "add_update_sums", "iteration_metrics",
        "log_iteration"]},
}

def profile_in_turns(args: Args, folder: str) -> tuple[dict, dict]:
    """ppo.main in this process (run_ppo), the functions of PHASE_OF timed, and an iteration of the limit where each
    of ppo.py's starts, outside its time. Returns ppo.py's profile and the limit's: mean phases and iteration, and
    each timed iteration (ppo.py's from one start to the next, the logging included)."""
    last = args.warmup_iterations + args.iterations  # ppo.py's extra iteration: its start ends the timed ones
    flags = ppo_flags(args, folder, f"benchmark_profile_{args.sampler}", last + 1)  # gpu_check.sh reads its metrics
    limit_one_iteration, (limit_totals, limit_phase), limit_timed = limit_iteration(args, flags), phase_timer(), []
    if args.profile_limit_apart:  # all the limit's iterations first; its models go before ppo.py's engines load
        for i in range(last):
            limit_totals.update(dict.fromkeys(PHASES, 0.0) if i == args.warmup_iterations else {})
            limit_timed.append(seconds(limit_one_iteration(limit_phase)))
        limit_one_iteration = None
        gc.collect()
        get_accelerator().empty_cache()
    (totals, phase), timed_totals = phase_timer(), {}  # the totals when the timed iterations end
    starts, ends = [], []  # where each iteration of ppo.py starts, and where each start finds the one before it ending
    limit_running = [False]  # the limit calls ppo.py's helpers too: not ppo.py's phases

    def iteration_start(prompts, iteration, *a, **k):
        ends.append(time.perf_counter())
        if iteration == args.warmup_iterations:  # the phases of the timed iterations only
            for phase_totals in [totals] + ([] if args.profile_limit_apart else [limit_totals]):
                phase_totals.update(dict.fromkeys(PHASES, 0.0))
        if iteration < last and limit_one_iteration is not None:
            limit_running[0] = True
            limit_timed.append(seconds(limit_one_iteration(limit_phase)))
            limit_running[0] = False
        starts.append(time.perf_counter())
        if iteration == last:
            timed_totals.update(totals)
        return prompts_of_iteration(prompts, iteration, *a, **k)

    def timed(function, name_of):
        def wrapper(*a, **k):  # a few microseconds, a few dozen calls an iteration
            name = (name_of(*a, **k) if callable(name_of) else name_of[not torch.is_grad_enabled()]
                    if isinstance(name_of, tuple) else name_of)
            if name is None or limit_running[0]:
                return function(*a, **k)
            with phase(name):
                return function(*a, **k)
        return wrapper
    prompts_of_iteration = ppo.prompts_of_iteration
    run_ppo(flags, {(ppo, "prompts_of_iteration"): iteration_start,
                    **{key: timed(getattr(*key), name_of) for key, name_of in PHASE_OF.items()}})
    ppo_timed = [ends[i + 1] - starts[i] for i in range(args.warmup_iterations, last)]
    return [{"phases": {name: total / args.iterations for name, total in phase_totals.items()},
             "mean_iteration": statistics.mean(iterations), "timed": iterations}
            for phase_totals, iterations in [(timed_totals, ppo_timed), (limit_totals, limit_timed[-args.iterations:])]]

def print_profile(ppo_profile: dict, limit: dict) -> None:
    """ppo.py's phases beside the limit's, in seconds per iteration ("other": outside every phase), and the ratio."""
    print("\n| phase | ppo.py s | limit s | ppo.py - limit s |\n|---|---|---|---|")
    ours, limit_rows = ({**p["phases"], "other": p["mean_iteration"] - sum(p["phases"].values()),
                         "iteration": p["mean_iteration"]} for p in [ppo_profile, limit])
    for name, ours_s in ours.items():
        print(f"| {name} | {ours_s:.4f} | {limit_rows[name]:.4f} | {ours_s - limit_rows[name]:+.4f} |")
    ratio = statistics.median(p / l for p, l in zip(ppo_profile["timed"], limit["timed"]))
    print(f"ppo.py's iteration over the limit's just before it, in this process: the median over "
          f"{len(limit['timed'])} pairs {ratio:.3f}")


# --- The hardware bound: the least time the device could take for an iteration's work, from measured rates. ---
def measured_rates(args: Args) -> dict[str, float]:
    """The device's memory bandwidth, bytes/s (a copy of 1 GiB on CUDA, 256 MiB on a CPU: each byte read and written),
    and matmul rate, FLOP/s (n x n by n x n in the models' dtype, 2 n^3 FLOPs; n 8192 on CUDA, 1024 on a CPU); each
    the best of 5 runs."""
    def seconds_of(work, *inputs) -> float:
        get_accelerator().synchronize()
        start = time.perf_counter()
        work(*inputs)
        get_accelerator().synchronize()
        return time.perf_counter() - start
    cuda = torch.cuda.is_available()
    source = torch.ones(2 ** (30 if cuda else 28), dtype=torch.uint8, device="cuda" if cuda else "cpu")
    target, n = torch.empty_like(source), 8192 if cuda else 1024
    matrix = torch.randn(n, n, dtype=plumbing.TORCH_DTYPES[args.dtype], device=source.device)
    return {"bandwidth": 2 * source.numel() / min(seconds_of(target.copy_, source) for _ in range(5)),
            "matmul_flops": 2 * n**3 / min(seconds_of(torch.matmul, matrix, matrix) for _ in range(5))}

def parameter_counts(flags: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """The parameters of each of ppo.py's four models (run with these flags), and of its input embedding, counted on
    torch's meta device: nothing allocated."""
    with torch.device("meta"):
        models = {name: model_class.from_config(AutoConfig.from_pretrained(path))
                  for name, (model_class, path) in models_of(tyro.cli(ppo.Args, args=flags)).items()}
    return ({name: sum(p.numel() for p in model.parameters()) for name, model in models.items()},
            {name: model.get_input_embeddings().weight.numel() for name, model in models.items()})

def hardware_bound(args: Args, parameters: dict[str, int], embeddings: dict[str, int], bandwidth: float,
                   matmul_flops: float) -> dict[str, float]:
    """The least time an iteration at args' shape takes on a device of this bandwidth (bytes/s) and matmul rate
    (FLOP/s), term by term, from the parameters of the actor, reference, critic and reward model and of their input
    embeddings (a lookup: it multiplies nothing, and a decode step reads B of its rows). B episodes of P + R tokens,
    e bytes an element (4 in fp32, 2 in bf16):
    - forward and backward: 2 FLOPs a weight a token forward, twice that backward, over B (P + R) tokens: the
      rollout's four forward passes, then in each PPO epoch the actor's and critic's forward and backward. Left out:
      attention's own products; counted at every position: the output layer (the log-probs keep R + 1).
    - generation: R decode steps at the floor, each reading the actor's weights and a static key-value cache whole,
      B x layers x 2 (K and V) x (P + R) x hidden_size (as many key-value heads as heads, as build_models's) x e.
    - optimizer steps: AdamW on fp32 master weights, 28 bytes a trained parameter a step: master weight and two
      moments read and written (24), then in bf16 the gradient read and the weight written (2 + 2), in fp32 the
      gradient read (4; the master is the weight); actor and critic, num_ppo_epochs x num_mini_batches steps each."""
    e, tokens = plumbing.TORCH_DTYPES[args.dtype].itemsize, args.episodes * (args.prompt_len + args.response_len)
    weights = {name: parameters[name] - embeddings[name] for name in parameters}  # those that multiply each token
    flops = 2 * tokens * (sum(weights.values()) + 3 * args.num_ppo_epochs * (weights["actor"] + weights["critic"]))
    weight_bytes, cache_bytes = weights["actor"] * e, tokens * args.num_layers * 2 * args.hidden_size * e
    floor_s = (weight_bytes + cache_bytes) / bandwidth
    optimizer_bytes = args.num_ppo_epochs * args.num_mini_batches * (parameters["actor"] + parameters["critic"]) * 28
    terms = {"forward_and_backward_s": flops / matmul_flops, "generation_s": args.response_len * floor_s,
             "optimizer_steps_s": optimizer_bytes / bandwidth}
    return {"bandwidth": bandwidth, "matmul_flops": matmul_flops, "flops": flops, "weight_bytes": weight_bytes,
            "cache_bytes": cache_bytes, "floor_s": floor_s, "optimizer_bytes": optimizer_bytes, **terms,
            "iteration_s": sum(terms.values())}

def print_bound(args: Args, b: dict, ppo_profile: dict, limit: dict) -> dict[str, float]:
    """The profile's generation in ms a token beside the floor, its iteration and optimizer steps beside the bound b,
    with b's arithmetic. Returns the ms a token of ppo.py, the limit and the floor."""
    ms = {"ppo.py": 1e3 * ppo_profile["phases"]["generation"] / args.response_len,
          "limit": 1e3 * limit["phases"]["generation"] / args.response_len, "floor": 1e3 * b["floor_s"]}
    bandwidth = f"{si(b['bandwidth'])}B/s"
    print(f"\ngeneration: ppo.py {ms['ppo.py']:.3g} ms a token, the limit {ms['limit']:.3g}; floor {ms['floor']:.3g} "
          f"ms = ({si(b['weight_bytes'])}B weights + {si(b['cache_bytes'])}B cache) / {bandwidth} measured\n"
          f"hardware bound of an iteration: {b['iteration_s']:.3g} s = forward and backward "
          f"{b['forward_and_backward_s']:.3g} s ({si(b['flops'])}FLOP / {si(b['matmul_flops'])}FLOP/s measured) + "
          f"generation {b['generation_s']:.3g} s ({args.response_len} tokens at the floor) + optimizer steps "
          f"{b['optimizer_steps_s']:.3g} s ({si(b['optimizer_bytes'])}B / {bandwidth}); ppo.py's iteration "
          f"{ppo_profile['mean_iteration'] / b['iteration_s']:.1f} times it, the limit's "
          f"{limit['mean_iteration'] / b['iteration_s']:.1f}\noptimizer steps: ppo.py "
          f"{ppo_profile['phases']['optimizer steps']:.3g} s an iteration, the limit "
          f"{limit['phases']['optimizer steps']:.3g}, the bound {b['optimizer_steps_s']:.3g}")
    return ms

def si(value: float) -> str:
    """value and a k, M, G or T prefix, 3 significant digits: si(2.85e12) + "B/s" is "2.85 TB/s"."""
    power = min(max(int(math.log10(float(f"{value:.3g}")) // 3), 0), 4) if value > 0 else 0
    return f"{value / 1000**power:.3g} {' kMGT'[power].strip()}"


# --- TRL 1.12's PPOTrainer (--trl-python), in its own virtual environment: its script builds its models. ---
def trl_command(args: Args, work_dir: str, iterations: int, gc_freeze: bool) -> list[str]:
    """TRL's script, to build TRL's models and prompts in work_dir and train on them, at the benchmark's shape."""
    return [args.trl_script, "--work-dir", work_dir, "--iterations", str(iterations), "--quiet", "--batch-size",
            str(args.episodes), "--prompt-length", str(args.prompt_len), "--response-length", str(args.response_len),
            "--vocab-size", str(args.vocab_size), "--hidden-size", str(args.hidden_size), "--num-layers",
            str(args.num_layers), "--num-heads", str(args.num_heads), "--intermediate-size",
            str(args.intermediate_size), "--ppo-epochs", str(args.num_ppo_epochs), "--mini-batches",
            str(args.num_mini_batches), *(["--gc-freeze"] if gc_freeze else [])]

# TRL's script in turns (argv: it, its arguments): its batch_generation, where an iteration starts, waits for the turn.
TRL_IN_TURNS = """
import importlib, os, signal, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
baseline = importlib.import_module(os.path.basename(sys.argv[1]).removesuffix(".py"))  # sets TRL's environment
_, _, trainer = baseline.import_trl_ppo()
batch_generation = trainer.batch_generation
def in_turn(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSTOP)
    return batch_generation(*args, **kwargs)
trainer.batch_generation = in_turn
baseline.main(sys.argv[2:])
"""


if __name__ == "__main__":
    preset = tyro.cli(Args).preset  # its shape becomes the defaults, so that a flag given wins over it
    main(tyro.cli(Args, default=Args(preset=preset, **PRESETS.get(preset, {}))))
