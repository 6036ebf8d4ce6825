"""Benchmark: ppo.py against the limit of its own model calls.

For one shape, this script builds random-init models in a temporary folder and times ppo.py on them against the limit:
the least work an iteration of ppo.py needs, done through ppo.py's own helpers on plain torch models, at the settings of
ppo.py's own flags (limit_iteration): ppo.sample's sampling with the KV cache and the same stopping, the no-gradient
forward passes of actor, reference, critic and reward in the same micro-batches, the rewards, GAE and whitening, and for
each mini-batch the forward, backward, gradient clipping (where ppo.py clips) and fused AdamW step of actor and critic
(in bf16 on fp32 copies of their weights, as ppo.py's mixed precision does). It has no DeepSpeed, no checks, no
statistics, no logging and no learning-rate schedule: less work than ppo.py's iteration. Every iteration does the same
work: generation runs to full length while any response is open, and a random model samples the EOS, one token in
vocab_size + 1, too rarely to close all.

A shared CPU's speed drifts by tens of percent within seconds (other machines' work on the same host), so ppo.py and
the limit run in fresh processes that take turns, iteration by iteration, the ones waiting frozen (SIGSTOP): each
iteration of ppo.py is compared with the limit's iteration next to it in time (in_turns). On one rank, ppo.py and the
limit (run_in_turns); on 2 ranks, a run of ppo.py at each actor ZeRO stage (two processes each) and the limit of one
rank's work (two_ranks_in_turns). Two limits taking turns in the same way show how far apart two processes doing the
same work come out (--null-rounds). The profile (--profile) takes turns too, in one process: an iteration of the limit
where each of ppo.py's starts (profile_in_turns).

    python benchmark.py                       # the default CPU shape (10 to 15 minutes on 2 cores)
    python benchmark.py --profile             # where one iteration's time goes, phase by phase, against the limit
    python benchmark.py --preset pythia-1b    # a GPU shape like Pythia-1B, in bf16
    python benchmark.py --trl-python trl-venv/bin/python   # ppo.py and its limit against TRL 1.12's PPOTrainer

Prints one table and writes it as JSON (--output-json) for comparison across commits.
"""

import ast
import contextlib
import functools
import gc
import inspect
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import deepspeed
import torch
import tyro
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging

import plumbing
import ppo
import rlhf_math

logging.disable_progress_bar()

# Shapes that replace the defaults below: Pythia-1B's width and depth, for a GPU.
PRESETS = {
    "pythia-1b": dict(hidden_size=2048, num_layers=16, num_heads=8, intermediate_size=8192, vocab_size=50304,
                      dtype="bf16", prompt_len=64, response_len=64, episodes=64, two_rank_stages=[]),
}


@dataclass
class Args:
    preset: Literal["cpu", "pythia-1b"] = "cpu"
    """the default CPU shape, or a preset from PRESETS that replaces the shape fields left at their defaults"""
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
    prompt_len: int = 16
    """tokens per prompt"""
    response_len: int = 32
    """tokens per response: generation runs this long while any response is open (a random model samples the EOS
    too rarely to close all, but a few responses stop early)"""
    episodes: int = 32
    """episodes per iteration, over all ranks"""
    num_ppo_epochs: int = 2
    """PPO epochs per iteration"""
    num_mini_batches: int = 2
    """mini-batches per PPO epoch"""
    micro_batches_per_mini_batch: int = 1
    """forward passes per mini-batch (gradient accumulation)"""
    warmup_iterations: int = 2
    """iterations run but not timed"""
    iterations: int = 10
    """iterations timed"""
    repeats: int = 5
    """rounds, each with fresh processes: on one rank, ppo.py and the limit taking turns (run_in_turns); on 2 ranks,
    a run of ppo.py at each actor ZeRO stage and the limit taking turns (two_ranks_in_turns). The table shows medians
    over all rounds"""
    null_rounds: int = 2
    """rounds of the limit against a second limit on one rank, taking turns as ppo.py and the limit do: two processes
    doing the same work, whose ratios are the noise of the 1-rank ratios; 0 to skip"""
    two_rank_stages: list[int] = field(default_factory=lambda: [0, 2, 3])
    """actor ZeRO stages to run on 2 ranks (the critic stays at ZeRO-0); empty to skip"""
    output_json: str = "benchmark.json"
    """where the table is written"""
    profile: bool = False
    """instead of the table: where one iteration's time goes, phase by phase, in ppo.py (one rank, in this process)
    and in the limit"""
    profile_zero_stage: int = 0
    """the actor's ZeRO stage in the profile"""
    profile_limit_apart: bool = False
    """the profile's limit timed before and after ppo.py (profile_between_limits) instead of taking turns with it in
    one process (profile_in_turns): for a GPU that cannot hold the limit's models beside ppo.py's engines"""
    trl_python: str | None = None
    """instead of the table: ppo.py and its limit against TRL 1.12's PPOTrainer (as shipped, and with its per-step
    garbage collection taken out), alternating, on TRL's own models; the Python of a virtual environment with
    trl==1.12.0 (never a dependency of this project)"""
    trl_script: str = "../shared/peers/trl_ppo_baseline.py"
    """the script that builds TRL's models and times its PPOTrainer (--trl-python)"""


def build_models(args: Args, folder: str) -> None:
    """A random policy (actor and reference) and a random reward model (critic and reward), with a word-level
    tokenizer whose EOS, id vocab_size, has the models' last embedding row (ppo.py refuses a token without one)."""
    words = ["<pad>"] + [f"w{i}" for i in range(1, args.vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<pad>", "<eos>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    config = LlamaConfig(vocab_size=args.vocab_size + 1, hidden_size=args.hidden_size,
                         num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
                         intermediate_size=args.intermediate_size,
                         max_position_embeddings=args.prompt_len + args.response_len, pad_token_id=0, num_labels=1,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    for name, model_class in [("policy", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification)]:
        model_class.from_config(config).save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))
    generator = torch.Generator().manual_seed(0)
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for _ in range(args.episodes * (args.warmup_iterations + args.iterations)):
            ids = torch.randint(1, args.vocab_size, (args.prompt_len,), generator=generator)
            f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in ids.tolist())}) + "\n")


def ppo_flags(args: Args, folder: str, ranks: int, stage: int, exp_name: str, iterations: int) -> list[str]:
    """ppo.py's flags for the benchmark's models and prompts, one rank's share of the episodes, at an actor ZeRO stage."""
    per_rank = args.episodes // ranks
    return [
        "--actor-model-name-or-path", os.path.join(folder, "policy"),
        "--reward-model-name-or-path", os.path.join(folder, "reward"), "--dataset", os.path.join(folder, "prompts.jsonl"),
        "--max-prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.response_len),
        "--total-episodes", str(args.episodes * iterations),
        "--per-device-rollout-batch-size", str(per_rank), "--num-ppo-epochs", str(args.num_ppo_epochs),
        "--num-mini-batches", str(args.num_mini_batches),
        "--per-device-train-batch-size", str(per_rank // args.num_mini_batches // args.micro_batches_per_mini_batch),
        "--actor-zero-stage", str(stage), "--dtype", args.dtype, "--sample-every", "0",
        "--exp-name", exp_name, "--output-dir", os.path.join(folder, exp_name),
    ]


def rank_env(ranks: int) -> dict:
    """The environment of a process that does one rank's work: on a CPU, each of the ranks gets its share of the
    cores through OMP_NUM_THREADS, read when torch loads (torch.set_num_threads in a running process is slower)."""
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore"}
    if ranks > 1 and not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // ranks))
    return env


def settings(args: Args) -> str:
    """The shape and precision, and the state that decides a CPU's speed (threads per rank, the machine's load): a
    drift in the figures is read here first."""
    threads = {ranks: rank_env(ranks).get("OMP_NUM_THREADS", "unset") for ranks in (1, 2)}
    return (f"shape: {args.episodes} episodes of {args.prompt_len} + {args.response_len} tokens, {args.num_layers} "
            f"layers of width {args.hidden_size} ({args.num_heads} heads, MLP {args.intermediate_size}), vocabulary "
            f"{args.vocab_size}, {args.dtype}; on {device_name()} with {os.cpu_count()} CPU cores, "
            f"this process {torch.get_num_threads()} torch threads, OMP_NUM_THREADS for 1 rank {threads[1]}, "
            f"for each of 2 ranks {threads[2]}; load average {os.getloadavg()[0]:.2f} (1 minute)")


def device_name() -> str:
    """The accelerator, with the GPU's own name (the card a figure was measured on)."""
    name = get_accelerator().device_name()
    return f"{name} ({torch.cuda.get_device_name()})" if name == "cuda" else name


def process_state() -> str:
    """What decides the speed of this process's tensor work on a CPU: torch's intra-op threads, and those of a thread
    started now (gloo's: one under ZeRO-3, plumbing.one_openmp_thread_for_new_threads), the OpenMP, MKL and glibc
    settings of the environment, the OS threads alive (threads that wake often take cores from OpenMP's), and the page
    faults so far (memory handed back to the system and faulted in again: plumbing.keep_freed_memory)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_", "GLIBC_"))}
    new_thread = []
    thread = threading.Thread(target=lambda: new_thread.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return (f"torch threads {torch.get_num_threads()} ({new_thread[0]} in a new thread), OpenMP/MKL/glibc environment "
            f"{env or 'none'}, "
            f"OS threads {len(os.listdir('/proc/self/task')) if os.path.isdir('/proc/self/task') else '?'}, "
            f"page faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt:,}")


def summary(args: Args, timed: list[dict]) -> dict:
    """The median times of ppo.py's timed iterations (its metrics) and rank 0's peak accelerator memory."""
    if any(m["val/response_length"] < 0.9 * args.response_len for m in timed):  # a random model rarely samples EOS
        raise SystemExit("benchmark.py: responses stopped early; the timings would not compare")
    result = {name: statistics.median(m[f"time/{name}"] for m in timed) for name in ["rollout", "generation", "update"]}
    for name in ["max_allocated_gb", "max_reserved_gb"]:  # rank 0's accelerator memory, as ppo.py logs it
        result[name] = max(m[f"memory/{name}"] for m in timed)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Phases: where an iteration's time goes. The limit times its phases itself; ppo.py's are timed by wrapping the
# functions it calls for each (--profile, in this process, one rank).
# ---------------------------------------------------------------------------------------------------------------
PHASES = ["generation", "actor log-probs", "reference log-probs", "critic values", "reward scores",
          "rewards, GAE and whitening", "actor forward and loss", "critic forward and loss", "actor backward",
          "critic backward", "optimizer steps", "checks, statistics and logging"]


def phase_timer(synchronize: bool):
    """(totals, phase): `with phase(name):` adds the time spent inside to totals[name], less the time of phases
    nested in it, which count for themselves. With synchronize (a GPU, --profile), every boundary waits for the
    device, so that time lands where the work is queued."""
    totals, stack = dict.fromkeys(PHASES, 0.0), []

    def now() -> float:
        if synchronize:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(name: str):
        start = now()
        if stack:  # the enclosing phase stops counting
            totals[stack[-1][0]] += start - stack[-1][1]
        stack.append([name, start])
        try:
            yield
        finally:
            end = now()
            totals[name] += end - stack.pop()[1]
            if stack:
                stack[-1][1] = end

    return totals, phase


def limit_iteration(args: Args, flags: list[str], ranks: int):
    """The least one of `ranks` ranks of ppo.py run with `flags` must do in an iteration: the same model calls with
    the same shapes on the same models, at the settings that the flags give ppo.py (temperature, KL coefficient,
    gradient clipping, learning rates), through ppo.py's own helpers on plain torch models (the calls and the math of
    PPO, nothing else: no DeepSpeed, no checks, no statistics, no logging), and a fused AdamW (in bf16 on fp32 copies
    of the weights). Loads the models and returns one_iteration(phase) -> its rollout and update seconds, each phase
    in `with phase(name)` (phase_timer). Run it in a process with the environment of such a rank (in_own_process)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        plumbing.keep_freed_memory()  # as plumbing.init_distributed sets up a rank of ppo.py on a CPU
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    settings = tyro.cli(ppo.Args, args=flags)  # ppo.py's arguments: the flags, and its defaults for the rest
    policy_path, reward_path = settings.actor_model_name_or_path, settings.reward_model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    actor = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(device).train()
    reference = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(device).requires_grad_(False)
    critic = AutoModelForSequenceClassification.from_pretrained(settings.critic_model_name_or_path or reward_path,
                                                                dtype=dtype).to(device).train()
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=dtype).to(device)
    reward.requires_grad_(False)
    # In bf16, mixed precision as in ppo.py (DeepSpeed): AdamW steps an fp32 copy of the weights, which go back to
    # bf16 after each step. AdamW on the bf16 weights themselves would be less work, and would round away updates
    # as small as lr 1e-6 times Adam's unit step.
    trained = [list(model.parameters()) for model in (actor, critic)]
    masters = [[p.detach().float() for p in params] if dtype != torch.float32 else params for params in trained]
    optimizers = [torch.optim.AdamW(master, lr=lr, weight_decay=0.0, fused=True)
                  for master, lr in zip(masters, [settings.actor_learning_rate, settings.critic_learning_rate])]
    per_rank = args.episodes // ranks
    per_mini_batch = per_rank // args.num_mini_batches
    micro = per_mini_batch // args.micro_batches_per_mini_batch
    prompts = torch.randint(1, args.vocab_size, (per_rank, args.prompt_len), device=device)
    generation_config = ppo.sampling_config(tokenizer, args.response_len, settings.temperature)
    P = args.prompt_len

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def one_iteration(phase) -> dict:
        synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            with phase("generation"):
                actor.eval()
                responses = ppo.sample(actor, prompts, torch.ones_like(prompts), generation_config, synced=False)
                actor.train()
            sequences = torch.cat([prompts, responses], dim=1)
            mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
            attention_mask = torch.cat([torch.ones_like(prompts), mask], dim=1)
            chunks = list(zip(sequences.split(micro), attention_mask.split(micro)))
            with phase("actor log-probs"):
                logprobs = torch.cat([ppo.response_logprobs(actor, s, m, P, settings.temperature)
                                      for s, m in chunks])
            with phase("reference log-probs"):
                ref_logprobs = torch.cat([ppo.response_logprobs(reference, s, m, P, settings.temperature)
                                          for s, m in chunks])
            with phase("critic values"):
                values = torch.cat([ppo.critic_values(critic, s, m, P, 0.0, 1.0) for s, m in chunks])
            with phase("reward scores"):
                scores = torch.cat([ppo.reward_scores(reward, s, m, P, 0.0, 1.0) for s, m in chunks])
            with phase("rewards, GAE and whitening"):
                rewards, _ = rlhf_math.per_token_rewards(scores, logprobs, ref_logprobs, mask, settings.kl_coef,
                                                         settings.clip_score, settings.kl_estimator)
                advantages, returns = rlhf_math.gae_advantages_and_returns(rewards, values, mask, settings.gamma,
                                                                           settings.lam)
                advantages = rlhf_math.masked_whiten(advantages, mask)
        synchronize()
        rollout_end = time.perf_counter()
        for epoch in range(args.num_ppo_epochs):
            for mini_batch in torch.randperm(per_rank, device=device).split(per_mini_batch):
                for i in mini_batch.split(micro):
                    with phase("actor forward and loss"):
                        new_logprobs = ppo.response_logprobs(actor, sequences[i], attention_mask[i], P,
                                                             settings.temperature)
                        pg_loss, _ = rlhf_math.policy_loss(new_logprobs, logprobs[i], advantages[i], mask[i],
                                                           settings.cliprange)
                    with phase("critic forward and loss"):
                        new_values = ppo.critic_values(critic, sequences[i], attention_mask[i], P, 0.0, 1.0)
                        vf_loss, _ = rlhf_math.value_loss(new_values, values[i], returns[i], mask[i],
                                                          settings.cliprange_value)
                    with phase("actor backward"):
                        (pg_loss / args.micro_batches_per_mini_batch).backward()
                    with phase("critic backward"):
                        (vf_loss / args.micro_batches_per_mini_batch).backward()
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
        synchronize()
        return {"rollout": rollout_end - start, "update": time.perf_counter() - rollout_end}

    return one_iteration


def limit_timer(args: Args, flags: list[str], ranks: int, profile: bool):
    """limit_iteration with its timing: (step, summary). step(iteration) runs one iteration, warm-up iterations
    first, untimed; with profile, phase by phase. summary() gives the timed iterations' median rollout and update,
    their phases and mean, and each of them."""
    one_iteration = limit_iteration(args, flags, ranks)
    totals, phase = phase_timer(synchronize=profile and torch.cuda.is_available())
    if not profile:
        phase = lambda name: contextlib.nullcontext()  # noqa: E731
    timed = []

    def step(iteration: int) -> None:
        if iteration == args.warmup_iterations:
            totals.update(dict.fromkeys(totals, 0.0))  # the phases of the timed iterations only
        times = one_iteration(phase)
        if iteration >= args.warmup_iterations:
            timed.append(times)

    def summary() -> dict:
        limit = {name: statistics.median(t[name] for t in timed) for name in ["rollout", "update"]}
        limit["phases"] = {name: total / args.iterations for name, total in totals.items()}
        limit["mean_iteration"] = statistics.mean(t["rollout"] + t["update"] for t in timed)
        limit["timed"] = timed
        return limit

    return step, summary


def time_limit(args: Args, flags: list[str], ranks: int, profile: bool = False, turn=None) -> dict:
    """limit_timer's iterations one after the other. turn(iteration), if given, is called before each iteration,
    outside its time."""
    step, summary = limit_timer(args, flags, ranks, profile)
    for iteration in range(args.warmup_iterations + args.iterations):
        if turn is not None:
            turn(iteration)
        step(iteration)
    return summary()


def in_own_process(function: str, args: Args, arguments: list, env: dict, output, pass_fds=()) -> subprocess.Popen:
    """benchmark.FUNCTION(args, *arguments) started in a new Python process with env, as ppo.py's runs are (a plain
    `python`, not a multiprocessing child), its output to the file `output`; it prints JSON on its last line."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import benchmark; "
            "getattr(benchmark, sys.argv[2])(benchmark.Args(**json.loads(sys.argv[3])), *json.loads(sys.argv[4]))")
    return subprocess.Popen([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), function,
                             json.dumps(asdict(args)), json.dumps(arguments)], env=env, stdout=output,
                            stderr=subprocess.STDOUT, text=True, pass_fds=pass_fds)


def last_json_line(output, what: str) -> dict:
    """The JSON a process of in_own_process printed last, from its output file."""
    output.seek(0)
    text = output.read()
    try:
        return json.loads(text.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"benchmark.py: {what} failed:\n{text[-3000:]}") from None


def run_limit(args: Args, flags: list[str], ranks: int, turns: list[int]) -> None:
    """time_limit of one of `ranks` ranks, one iteration per turn (in_turns), printed as JSON with this process's
    state."""
    print(json.dumps({**time_limit(args, flags, ranks, turn=turn_taker(turns)[0]), "state": process_state(),
                      "peak_rss_gb": plumbing.peak_resident_gb()}))


# ---------------------------------------------------------------------------------------------------------------
# Turns: fresh processes that take turns, one iteration each, the others frozen: on one rank ppo.py and the limit;
# on 2 ranks a run at each actor ZeRO stage and the limit; against TRL, ppo.py and TRL's trainer.
# ---------------------------------------------------------------------------------------------------------------
def turn_taker(turns: list[int]):
    """In a process that takes turns (in_turns): the function to call where each iteration starts, which says that
    the last one is done and waits for this one's turn, and the list of the turns' seconds, each from its start to
    its end. turns: the file descriptors (read, write) of the process's two pipes to the benchmark. It needs only os
    and time: TRL's process runs it too (TRL_IN_TURNS)."""
    seconds, started = [], []

    def turn(*_):
        if started:
            seconds.append(time.perf_counter() - started[-1])
            os.write(turns[1], b"d")
        if os.read(turns[0], 1) != b"g":  # the benchmark stopped
            os._exit(1)
        started.append(time.perf_counter())

    return turn, seconds


def in_turns(starts: dict[str, list], iterations: int) -> dict[str, list[dict]]:
    """Sides that take turns, one iteration each, the order turning by one each iteration (with two: the first one
    first in even iterations, the other in odd ones). A side is one process, or the ranks of one run, which go on and
    stop together. The sides waiting are frozen (SIGSTOP), so that nothing of them (their spinning OpenMP workers,
    their threads) runs in another's turn. starts: name -> the functions that start the side's processes, each given
    its two pipes' file descriptors (read, write) for turn_taker and its output file. Returns the JSON that each
    process printed last, by side."""
    sides = {name: [] for name in starts}

    def failed(name: str):
        for process, _, _, output in sides[name]:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a rank that outlived its peer may wait for a turn
                process.wait(timeout=2)
            if process.returncode not in (None, 0):
                output.seek(0)
                return SystemExit(f"benchmark.py: {name} failed:\n{output.read()[-3000:]}")
        return SystemExit(f"benchmark.py: {name} ended before its last turn")

    try:
        for name, side_starts in starts.items():
            for start in side_starts:
                go_read, go_write = os.pipe()
                done_read, done_write = os.pipe()
                output = tempfile.TemporaryFile("w+")
                sides[name].append((start([go_read, done_write], output), go_write, done_read, output))
                os.close(go_read), os.close(done_write)
        names = list(sides)
        for iteration in range(iterations):
            for name in names[iteration % len(names):] + names[:iteration % len(names)]:
                for process, go, _, _ in sides[name]:
                    os.kill(process.pid, signal.SIGCONT)
                    os.write(go, b"g")
                if [os.read(done, 1) for _, _, done, _ in sides[name]] != [b"d"] * len(sides[name]):
                    if iteration < iterations - 1:  # the end of an output: a process ended before its last turn
                        raise failed(name)
                    continue
                for process, _, _, _ in sides[name]:
                    os.kill(process.pid, signal.SIGSTOP)
        for name, side in sides.items():
            if any(process.wait() != 0 for process, _, _, _ in side):
                raise failed(name)
        return {name: [last_json_line(output, name) for _, _, _, output in side] for name, side in sides.items()}
    finally:
        for process, go, done, output in [entry for side in sides.values() for entry in side]:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            os.close(go), os.close(done), output.close()


def ppo_in_turns(args: Args, flags: list[str], turns: list[int]) -> None:
    """ppo.py's main block with these flags in this fresh process (exec_ppo_main), one iteration per turn: the wait
    comes where an iteration starts, before its prompts, outside ppo.py's own timings. It prints its JSON where the run
    ends (plumbing.end_run, after which a rank of several exits)."""
    turn, seconds = turn_taker(turns)
    prompts_of_iteration, end_run = ppo.prompts_of_iteration, plumbing.end_run

    def in_turn(prompts, iteration, *a, **k):
        turn()
        return prompts_of_iteration(prompts, iteration, *a, **k)

    def report_and_end_run():
        print(json.dumps({"seconds": seconds, "state": process_state(), "peak_rss_gb": plumbing.peak_resident_gb()}),
              flush=True)
        end_run()

    exec_ppo_main(flags, {(ppo, "prompts_of_iteration"): in_turn, (plumbing, "end_run"): report_and_end_run})


def run_in_turns(args: Args, folder: str, against_itself: bool = False) -> tuple[list[dict], list[dict], dict]:
    """One round on one rank: ppo.py (ppo_in_turns) and the limit (run_limit) in two fresh processes that take turns
    (in_turns), ppo.py first in even iterations and the limit first in odd ones. Returns ppo.py's timed iterations
    (its metrics), the limit's, and the processes' state and ppo.py's peak RSS. With against_itself, a second limit
    takes ppo.py's place, and its timed iterations come first."""
    exp_name, iterations = "benchmark_1rank_zero0", args.warmup_iterations + args.iterations
    flags = ppo_flags(args, folder, 1, 0, exp_name, iterations)
    first = ("second limit", "run_limit", [flags, 1]) if against_itself else ("ppo.py", "ppo_in_turns", [flags])
    results = in_turns({name: [functools.partial(start_in_own_process, function, args, arguments)]
                        for name, function, arguments in [first, ("limit", "run_limit", [flags, 1])]}, iterations)
    results = {name: result for name, [result] in results.items()}
    first_timed = results[first[0]]["timed"] if against_itself else metrics_of_run(exp_name)[args.warmup_iterations:]
    return first_timed, results["limit"]["timed"], \
        {"state": {name: result["state"] for name, result in results.items()},
         "peak_rss_gb": results[first[0]]["peak_rss_gb"]}


def two_ranks_in_turns(args: Args, folder: str) -> tuple[dict[int, list[dict]], list[dict], dict[int, float]]:
    """One round on 2 ranks: a run of ppo.py at each actor ZeRO stage of --two-rank-stages (two fresh processes
    each, one per rank, started as torchrun starts ranks) and the limit of one rank's work, taking turns (in_turns).
    Returns each stage's timed iterations (rank 0's metrics), the limit's, and each stage's peak RSS (its larger
    rank's)."""
    iterations, starts = args.warmup_iterations + args.iterations, {}
    for stage in args.two_rank_stages:
        flags = ppo_flags(args, folder, 2, stage, f"benchmark_2ranks_zero{stage}", iterations)
        port = plumbing.free_port()
        starts[stage] = [functools.partial(start_in_own_process, "ppo_in_turns", args, [flags], env={
            **rank_env(2), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port}) for rank in range(2)]
    starts["limit"] = [functools.partial(start_in_own_process, "run_limit", args,
                                         [ppo_flags(args, folder, 2, 0, "limit", iterations), 2], env=rank_env(2))]
    results = in_turns(starts, iterations)
    return ({stage: metrics_of_run(f"benchmark_2ranks_zero{stage}")[args.warmup_iterations:]
             for stage in args.two_rank_stages}, results["limit"][0]["timed"],
            {stage: max(rank["peak_rss_gb"] for rank in results[stage]) for stage in args.two_rank_stages})


def start_in_own_process(function: str, args: Args, arguments: list, turns: list[int], output,
                         env: dict | None = None) -> subprocess.Popen:
    """benchmark.FUNCTION(args, *arguments, turns) in a fresh process (in_own_process) with env, by default one rank's,
    for in_turns."""
    return in_own_process(function, args, [*arguments, turns], env or rank_env(1), output, pass_fds=tuple(turns))


def metrics_of_run(exp_name: str) -> list[dict]:
    """The metrics of the newest run of ppo.py named exp_name."""
    run_dirs = sorted(d for d in os.listdir("runs") if d.startswith(exp_name + "__"))
    with open(os.path.join("runs", run_dirs[-1], "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def profile_flags(args: Args, folder: str) -> list[str]:
    """ppo.py's flags in the profile: one rank, the actor at --profile-zero-stage, an iteration more than the
    warm-up and timed ones (the last only ends the timed ones)."""
    return ppo_flags(args, folder, 1, args.profile_zero_stage, "benchmark_profile",
                     args.warmup_iterations + args.iterations + 1)


def profile_ppo(args: Args, folder: str, between=None) -> dict:
    """ppo.py's iteration by phase: its main block run in this process (one rank, the actor at --profile-zero-stage)
    with the functions it calls for each phase wrapped in a phase timer (the wrappers cost microseconds, a few dozen
    calls an iteration). An iteration runs from one prompts_of_iteration call to the next, so it includes the
    logging. between(iteration), if given, runs where each iteration starts, outside ppo.py's time and phases."""
    totals, phase = phase_timer(synchronize=torch.cuda.is_available())
    starts, ends = [], []  # where each iteration starts, and where each start finds the one before it ending
    timed_totals = {}  # the phase totals when the timed iterations end
    running_between = [False]  # while between() runs: its calls are not ppo.py's phases

    def grad_or_not(with_grad: str | None, without_grad: str | None):
        return lambda *a, **k: with_grad if torch.is_grad_enabled() else without_grad

    def always(name: str):
        return lambda *a, **k: name

    def iteration_start(prompts, iteration, *a, **k):
        ends.append(time.perf_counter())
        if between is not None:
            running_between[0] = True
            between(iteration)
            running_between[0] = False
        starts.append(time.perf_counter())
        if iteration == args.warmup_iterations:
            totals.update(dict.fromkeys(totals, 0.0))  # the phases of the timed iterations only
        if iteration == args.warmup_iterations + args.iterations:
            timed_totals.update(totals)
        return None

    # (owner, function name) -> the phase of a call, from its arguments; None: the phase of its caller.
    phase_of = {
        (ppo, "prompts_of_iteration"): iteration_start,
        (ppo, "sample_responses"): always("generation"),
        (ppo, "response_logprobs"): lambda model, *a, **k: "actor log-probs" if model.training else "reference log-probs",
        (ppo, "critic_values"): grad_or_not("critic forward and loss", "critic values"),
        (ppo, "reward_model_inputs"): always("reward scores"),
        (ppo, "reward_scores"): always("reward scores"),
        (ppo, "batch_mean_var"): always("rewards, GAE and whitening"),
        (rlhf_math, "per_token_rewards"): always("rewards, GAE and whitening"),
        (rlhf_math, "gae_advantages_and_returns"): always("rewards, GAE and whitening"),
        (rlhf_math, "masked_whiten"): always("rewards, GAE and whitening"),
        (ppo, "response_logits"): grad_or_not("actor forward and loss", None),
        (rlhf_math, "logprobs_from_logits"): grad_or_not("actor forward and loss", None),
        (rlhf_math, "policy_loss"): always("actor forward and loss"),
        (rlhf_math, "value_loss"): always("critic forward and loss"),
        (DeepSpeedEngine, "backward"): lambda engine, *a, **k: "critic backward" if hasattr(engine.module, "score")
        else "actor backward",
        (DeepSpeedEngine, "step"): always("optimizer steps"),
        **{(ppo, name): always("checks, statistics and logging") for name in [
            "check_finite_rollout", "check_update", "new_update_sums", "add_update_sums", "iteration_metrics",
            "log_iteration"]},
    }

    def timed(function, name_of):
        @functools.wraps(function)
        def wrapper(*a, **k):
            name = None if running_between[0] else name_of(*a, **k)
            if name is None:
                return function(*a, **k)
            with phase(name):
                return function(*a, **k)
        return wrapper

    exec_ppo_main(profile_flags(args, folder), {key: timed(getattr(*key), name_of) for key, name_of in phase_of.items()})
    timed = [ends[i + 1] - starts[i] for i in range(args.warmup_iterations, args.warmup_iterations + args.iterations)]
    return {"phases": {name: total / args.iterations for name, total in timed_totals.items()},
            "mean_iteration": statistics.mean(timed), "timed": timed}


# ---------------------------------------------------------------------------------------------------------------
# Against TRL 1.12's PPOTrainer (--trl-python): TRL's own script builds its models and times its trainer; ppo.py and
# its limit run on the same models, prompts and settings. TRL stays in its own virtual environment.
# ---------------------------------------------------------------------------------------------------------------
def run_one_rank(command: list[str], what: str) -> str:
    """A command in a fresh process with one rank's environment; its standard output, or a stop with its end."""
    result = subprocess.run(command, env=rank_env(1), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"benchmark.py: {what} failed ({' '.join(command)}):\n{(result.stdout + result.stderr)[-3000:]}")
    return result.stdout


def trl_command(args: Args, work_dir: str, iterations: int, gc_freeze: bool) -> list[str]:
    """TRL's script's arguments for the benchmark's shape: it builds TRL's models and prompts in work_dir and trains."""
    return [args.trl_script, "--work-dir", work_dir, "--iterations", str(iterations), "--quiet",
            "--batch-size", str(args.episodes), "--prompt-length", str(args.prompt_len), "--response-length",
            str(args.response_len), "--vocab-size", str(args.vocab_size), "--hidden-size", str(args.hidden_size),
            "--num-layers", str(args.num_layers), "--num-heads", str(args.num_heads), "--intermediate-size",
            str(args.intermediate_size), "--ppo-epochs", str(args.num_ppo_epochs), "--mini-batches",
            str(args.num_mini_batches), *(["--gc-freeze"] if gc_freeze else [])]


# TRL's script in turns (in TRL's Python, after turn_taker's source): its own main, with TRL's batch_generation, which
# its trainer calls once where each iteration starts, waiting for the turn first. argv: the two file descriptors of
# turn_taker, then trl_command.
TRL_IN_TURNS = """
turn, seconds = turn_taker([int(sys.argv[1]), int(sys.argv[2])])
spec = importlib.util.spec_from_file_location("trl_baseline", sys.argv[3])
baseline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(baseline)
import_trl_ppo = baseline.import_trl_ppo


def import_trl_ppo_in_turns():
    PPOConfig, PPOTrainer, ppo_module = import_trl_ppo()
    batch_generation = ppo_module.batch_generation

    def in_turn(*args, **kwargs):
        turn()
        return batch_generation(*args, **kwargs)

    ppo_module.batch_generation = in_turn
    return PPOConfig, PPOTrainer, ppo_module


baseline.import_trl_ppo = import_trl_ppo_in_turns
baseline.main(sys.argv[4:])
print(json.dumps({"seconds": seconds}))
"""


def start_trl_in_turns(args: Args, work_dir: str, iterations: int, gc_freeze: bool, turns: list[int],
                       output) -> subprocess.Popen:
    """TRL's script (trl_command) in --trl-python, taking turns (in_turns)."""
    code = "import importlib.util, json, os, sys, time\n" + inspect.getsource(turn_taker) + TRL_IN_TURNS
    return subprocess.Popen([args.trl_python, "-c", code, *map(str, turns),
                             *trl_command(args, work_dir, iterations, gc_freeze)], env=rank_env(1), stdout=output,
                            stderr=subprocess.STDOUT, text=True, pass_fds=tuple(turns))


def ppo_flags_on_trl_models(args: Args, work_dir: str, iterations: int) -> list[str]:
    """ppo.py on TRL's models (policy, reward model, value model as the critic) and prompts (as text,
    write_trl_prompts_as_text), with TRL's settings where ppo.py's defaults differ (temperature, KL coefficient,
    learning rates, and no gradient clipping: TRL's PPOTrainer clips none)."""
    return [*ppo_flags(args, work_dir, 1, 0, "benchmark_on_trl_models", iterations),
            "--actor-model-name-or-path", os.path.join(work_dir, "policy"),
            "--reward-model-name-or-path", os.path.join(work_dir, "reward_model"),
            "--critic-model-name-or-path", os.path.join(work_dir, "value_model"),
            "--dataset", os.path.join(work_dir, "prompts_text.jsonl"), "--temperature", "0.7", "--kl-coef", "0.05",
            "--actor-learning-rate", "3e-6", "--critic-learning-rate", "3e-6", "--gradient-clipping", "0"]


def write_trl_prompts_as_text(work_dir: str) -> None:
    """TRL's prompts (token ids) as the text that ppo.py reads, prompts_text.jsonl in work_dir."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(work_dir, "tokenizer"))
    with open(os.path.join(work_dir, "prompts.jsonl")) as f, \
            open(os.path.join(work_dir, "prompts_text.jsonl"), "w") as out:
        for line in f:
            out.write(json.dumps({"prompt": tokenizer.decode(json.loads(line)["input_ids"])}) + "\n")


def against_trl(args: Args) -> None:
    """Rounds of four fresh processes taking turns, one iteration each (in_turns): ppo.py, its limit (run_limit with
    ppo.py's flags: its model calls alone), TRL without its per-step garbage collection (its script's --gc-freeze) and
    TRL as shipped, each on TRL's models. Each iteration of ppo.py and TRL runs from one start to the next, the logging
    included. Prints each round's median episodes per second, and ppo.py's and the limit's episodes per second over
    each TRL's, the median of the ratios of iterations next to each other in time."""
    iterations = args.warmup_iterations + args.iterations + 1  # the last one ends without a next start: not timed
    names = ["ppo.py", "limit", "TRL, gc.freeze()", "TRL as shipped"]
    seconds = {name: [] for name in names}  # per round: the timed iterations
    with tempfile.TemporaryDirectory() as work_dir:
        run_one_rank([args.trl_python, *trl_command(args, work_dir, 1, False)], "TRL")  # TRL's models and prompts
        write_trl_prompts_as_text(work_dir)
        print("| round | " + " | ".join(f"{name} episodes/s" for name in names) + " |\n|" + "---|" * (len(names) + 1),
              flush=True)
        for round_number in range(1, args.repeats + 1):
            flags = ppo_flags_on_trl_models(args, work_dir, iterations)
            # The limit times each iteration itself; it runs one more, in the turn where the others end their last.
            starts = {"ppo.py": [functools.partial(start_in_own_process, "ppo_in_turns", args, [flags])],
                      "limit": [functools.partial(start_in_own_process, "run_limit",
                                                  replace(args, iterations=args.iterations + 1), [flags, 1])]}
            for name, gc_freeze, own_dir in [("TRL, gc.freeze()", True, "trl_gc_freeze"),
                                             ("TRL as shipped", False, "trl_as_shipped")]:  # same models, rebuilt
                starts[name] = [functools.partial(start_trl_in_turns, args, os.path.join(work_dir, own_dir),
                                                  iterations, gc_freeze)]
            results = in_turns(starts, iterations)
            for name in names:
                seconds[name].append([t["rollout"] + t["update"] for t in results[name][0]["timed"]][:args.iterations]
                                     if name == "limit" else results[name][0]["seconds"][args.warmup_iterations:])
            print(f"| {round_number} | " + " | ".join(f"{args.episodes / statistics.median(seconds[name][-1]):.1f}"
                                                      for name in names) + " |", flush=True)

    def over(fast: str, slow: str) -> float:  # fast's episodes per second over slow's: slow's seconds over fast's
        return statistics.median(t / f for fast_round, slow_round in zip(seconds[fast], seconds[slow])
                                 for f, t in zip(fast_round, slow_round))

    print(f"\nppo.py's episodes per second over TRL's, the median over {sum(map(len, seconds['ppo.py']))} pairs of "
          f"iterations next to each other in time ({args.episodes} episodes each): over TRL without its garbage "
          f"collection {over('ppo.py', names[2]):.2f}, over TRL as shipped {over('ppo.py', names[3]):.2f}. The "
          f"limit's (ppo.py's model calls alone): over TRL without its garbage collection {over('limit', names[2]):.2f}"
          f", over TRL as shipped {over('limit', names[3]):.2f}, over ppo.py {over('limit', 'ppo.py'):.2f}")


def exec_ppo_main(flags: list[str], replacements: dict) -> None:
    """ppo.py's main block run in this process as `python ppo.py FLAGS` runs it, with functions replaced while it
    runs: (owner, name) -> the function that stands in."""
    originals = {key: getattr(*key) for key in replacements}
    main = ast.parse(inspect.getsource(ppo)).body[-1]  # if __name__ == "__main__": its body
    argv, sys.argv = sys.argv, ["ppo.py", *flags]
    names = set(vars(ppo))
    try:
        for (owner, name), function in replacements.items():
            setattr(owner, name, function)
        exec(compile(ast.Module(body=main.body, type_ignores=[]), ppo.__file__, "exec"), vars(ppo))
    finally:
        sys.argv = argv
        for (owner, name), function in originals.items():
            setattr(owner, name, function)
        for name in set(vars(ppo)) - names:  # the main block's variables, its four engines among them, are freed
            del vars(ppo)[name]
        gc.collect()
        get_accelerator().empty_cache()


def profile_in_turns(args: Args, folder: str) -> tuple[dict, dict]:
    """ppo.py's profile (profile_ppo) and the limit's (limit_iteration), in this process, taking turns: one iteration
    of the limit where each of ppo.py's starts, so that the machine's speed, which drifts by 10% and more within a
    minute, is the same for an iteration of each. The limit's models sit beside ppo.py's engines; the limit's
    iteration timed[i] ran just before ppo.py's timed[i]."""
    step, summary = limit_timer(args, profile_flags(args, folder), 1, profile=True)

    def limit_turn(iteration: int) -> None:
        if iteration < args.warmup_iterations + args.iterations:  # the last start only ends ppo.py's timed ones
            step(iteration)

    ppo_profile = profile_ppo(args, folder, between=limit_turn)
    return ppo_profile, summary()


def profile_between_limits(args: Args, folder: str) -> tuple[dict, dict]:
    """ppo.py's profile (profile_ppo) and the limit's (time_limit), in this process: the limit timed before ppo.py and
    after it, each phase averaged over the two, so that a steady drift of the machine's speed falls on both sides
    alike (over minutes this machine's speed has drifted by 10% and more). Both limits are in the returned limit's
    "before" and "after"."""
    before = time_limit(args, profile_flags(args, folder), 1, profile=True)
    get_accelerator().empty_cache()  # on a GPU, the limit's models' memory goes back before ppo.py's engines load
    ppo_profile = profile_ppo(args, folder)
    after = time_limit(args, profile_flags(args, folder), 1, profile=True)
    return ppo_profile, {"phases": {name: (before["phases"][name] + after["phases"][name]) / 2 for name in PHASES},
                         "mean_iteration": (before["mean_iteration"] + after["mean_iteration"]) / 2,
                         "before": before, "after": after}


def print_profile(ppo_profile: dict, limit: dict) -> None:
    """The phases of ppo.py's iteration beside the limit's, in seconds per iteration; "other" is the iteration's time
    outside every phase."""
    print("\n| phase | ppo.py s | limit s | ppo.py - limit s |\n|---|---|---|---|")
    rows = [(name, ppo_profile["phases"][name], limit["phases"][name]) for name in PHASES]
    rows.append(("other", ppo_profile["mean_iteration"] - sum(ppo_profile["phases"].values()),
                 limit["mean_iteration"] - sum(limit["phases"].values())))
    rows.append(("iteration", ppo_profile["mean_iteration"], limit["mean_iteration"]))
    for name, ours, limit_s in rows:
        print(f"| {name} | {ours:.4f} | {limit_s:.4f} | {ours - limit_s:+.4f} |")
    if "timed" in limit:  # in turns (profile_in_turns)
        ratios = [ours / (limit_s["rollout"] + limit_s["update"])
                  for ours, limit_s in zip(ppo_profile["timed"], limit["timed"])]
        print(f"ppo.py's iteration over the limit's just before it, in this process: the median over {len(ratios)} "
              f"pairs {statistics.median(ratios):.3f}")


def ppo_times(metrics: dict) -> dict:
    """The rollout and update seconds of an iteration of ppo.py (its metrics), named as the limit's."""
    return {"rollout": metrics["time/rollout"], "update": metrics["time/update"]}


def median_ratios(pairs: list[tuple[dict, dict]]) -> dict[str, float]:
    """Pairs of iterations next to each other in time, each {"rollout": s, "update": s}: the medians of the pairs'
    ratios of rollout, update and iteration (their sum)."""
    ratios = {key: statistics.median(a[key] / b[key] for a, b in pairs) for key in ["rollout", "update"]}
    ratios["iteration"] = statistics.median((a["rollout"] + a["update"]) / (b["rollout"] + b["update"])
                                            for a, b in pairs)
    return ratios


def against_zero0(two_ranks: list[tuple[dict, list, dict]], stage: int) -> list[tuple[dict, dict]]:
    """On 2 ranks (rounds of two_ranks_in_turns), each iteration of ppo.py at an actor ZeRO stage with ZeRO-0's next to
    it in time, the same round's iteration of the same index: pairs of their rollout and update seconds."""
    return [(ppo_times(m), ppo_times(z)) for timed, _, _ in two_ranks for m, z in zip(timed[stage], timed[0])]


def iteration_seconds(pairs: list[tuple[dict, dict]]) -> list[tuple[float, float]]:
    """Pairs of an iteration of ppo.py (its metrics) and the limit's as their iteration seconds, for the JSON."""
    return [(m["time/rollout"] + m["time/update"], l["rollout"] + l["update"]) for m, l in pairs]


def paired_row(args: Args, config: str, pairs: list[tuple[dict, dict]], peak_rss_gb: float) -> dict:
    """One configuration's row from pairs of an iteration of ppo.py (its metrics) and the limit's next to it in time:
    the median times of each, the medians of the pairs' ratios, throughput and memory."""
    measured = {**summary(args, [m for m, _ in pairs]), "peak_rss_gb": peak_rss_gb}
    limit = {key: statistics.median(l[key] for _, l in pairs) for key in ["rollout", "update"]}
    ratios = median_ratios([(ppo_times(m), l) for m, l in pairs])
    iteration, limit_iteration = measured["rollout"] + measured["update"], limit["rollout"] + limit["update"]
    return {"config": config, "rollout_s": measured["rollout"], "rollout_limit_s": limit["rollout"],
            "update_s": measured["update"], "update_limit_s": limit["update"], "iteration_s": iteration,
            "iteration_limit_s": limit_iteration, **{f"{key}_ratio": value for key, value in ratios.items()},
            "generation_share": measured["generation"] / iteration, "episodes_per_s": args.episodes / iteration,
            "generated_tokens_per_s": args.episodes * args.response_len / measured["generation"],
            "peak_rss_gb": measured["peak_rss_gb"], "gpu_max_allocated_gb": measured["max_allocated_gb"],
            "gpu_max_reserved_gb": measured["max_reserved_gb"]}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def model_memory(args: Args, folder: str) -> list[dict]:
    """Bytes of parameters, gradients and optimizer state of ppo.py's four engines, built by ppo.py's own functions
    (one rank, ZeRO-0, fp32: the optimizer is then torch's own AdamW, whose state is all there is) and measured after
    one training step of actor and critic (gradients just before it)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=plumbing.free_port())
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    ppo_args = ppo.Args(dtype="fp32", per_device_train_batch_size=4, gradient_accumulation_steps=1,
                        num_iterations=1)
    device = torch.device(get_accelerator().device_name(0))
    batch = torch.randint(1, args.vocab_size, (4, args.prompt_len + args.response_len), device=device)
    rows = []
    for name, model_class, path, trained in [
        ("actor", AutoModelForCausalLM, "policy", True), ("reference", AutoModelForCausalLM, "policy", False),
        ("critic", AutoModelForSequenceClassification, "reward", True),
        ("reward", AutoModelForSequenceClassification, "reward", False),
    ]:
        engine = ppo.init_engine(model_class, os.path.join(folder, path), f"the benchmark's {path} model",
                                 ppo.deepspeed_config(0, trained, False, ppo_args), ppo_args, 1e-6 if trained else None)
        if trained:
            engine.backward(engine(input_ids=batch).logits.float().mean())
        else:
            with torch.no_grad():
                engine(input_ids=batch)
        grads = tensor_bytes(p.grad for p in engine.module.parameters())
        if trained:
            engine.step()
        optimizer_state = tensor_bytes(v for state in engine.optimizer.state.values() for v in state.values()) \
            if engine.optimizer is not None else 0
        rows.append({"model": name, "parameters_mb": tensor_bytes(engine.module.parameters()) / 2**20,
                     "gradients_mb": grads / 2**20, "optimizer_state_mb": optimizer_state / 2**20})
    return rows


def two_rank_stages_here(stages: list[int]) -> list[int]:
    """The 2-rank stages this machine can run: none where there is one GPU, which two ranks cannot share (rank 1 would
    ask for device 1), with a line that says so; all of them on a CPU or on several GPUs."""
    if stages and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        print(f"one GPU: the 2-rank runs (--two-rank-stages {' '.join(map(str, stages))}) need two; skipped")
        return []
    return stages


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.preset != "cpu":
        defaults = Args()
        for key, value in PRESETS[args.preset].items():
            if getattr(args, key) == getattr(defaults, key):  # a flag given with another value wins over the preset
                setattr(args, key, value)
    args.two_rank_stages = two_rank_stages_here(args.two_rank_stages)
    os.makedirs("runs", exist_ok=True)
    print(settings(args), flush=True)
    profile = profile_between_limits if args.profile_limit_apart else profile_in_turns
    if args.trl_python:
        against_trl(args)
        raise SystemExit(0)
    if args.profile:
        with tempfile.TemporaryDirectory() as folder:
            build_models(args, folder)
            print_profile(*profile(args, folder))
        raise SystemExit(0)
    with tempfile.TemporaryDirectory() as folder:
        build_models(args, folder)
        one_rank, states, two_ranks, null = [], [], [], []
        for round_number in range(1, args.repeats + 1):
            print(f"round {round_number}/{args.repeats}: ppo.py and the limit on 1 rank, taking turns ...", flush=True)
            ppo_timed, limit_timed, state = run_in_turns(args, folder)
            one_rank.append((ppo_timed, limit_timed, state["peak_rss_gb"]))
            states.append(state["state"])
            if round_number <= args.null_rounds:
                print(f"round {round_number}/{args.repeats}: the limit against a second limit on 1 rank, taking "
                      "turns ...", flush=True)
                second, limit_timed, _ = run_in_turns(args, folder, against_itself=True)
                null.append([(s["rollout"] + s["update"], l["rollout"] + l["update"])
                             for s, l in zip(second, limit_timed)])
            if args.two_rank_stages:
                print(f"round {round_number}/{args.repeats}: ppo.py on 2 ranks at actor ZeRO stages "
                      f"{args.two_rank_stages} and the limit of one rank's work, taking turns ...", flush=True)
                two_ranks.append(two_ranks_in_turns(args, folder))
        # Each iteration of ppo.py against the limit's next to it in time; the medians of those ratios.
        pairs = [(m, l) for ppo_timed, limit_timed, _ in one_rank for m, l in zip(ppo_timed, limit_timed)]
        rows = [paired_row(args, "1 rank, actor ZeRO-0", pairs, max(rss for _, _, rss in one_rank))]
        two_rank_pairs = {stage: [(m, l) for timed, limit_timed, _ in two_ranks
                                  for m, l in zip(timed[stage], limit_timed)] for stage in args.two_rank_stages}
        for stage, stage_pairs in two_rank_pairs.items():
            rows.append(paired_row(args, f"2 ranks, actor ZeRO-{stage}", stage_pairs,
                                   max(rss[stage] for _, _, rss in two_ranks)))

        print("the profile: ppo.py's main block and the limit in this process, phase by phase ...", flush=True)
        ppo_profile, limit_profile = profile(args, folder)
        memory = model_memory(args, folder)

    on_gpu = torch.cuda.is_available()
    header = ["config", "rollout s (limit, ratio)", "update s (limit, ratio)", "iteration s (ratio)", "episodes/s",
              "gen tokens/s", "gen share", "peak RSS GB"] + (["GPU max allocated / reserved GB"] if on_gpu else [])
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        gpu = f" {r['gpu_max_allocated_gb']:.2f} / {r['gpu_max_reserved_gb']:.2f} |" if on_gpu else ""
        print(f"| {r['config']} | {r['rollout_s']:.3f} ({r['rollout_limit_s']:.3f}, {r['rollout_ratio']:.2f}) "
              f"| {r['update_s']:.3f} ({r['update_limit_s']:.3f}, {r['update_ratio']:.2f}) "
              f"| {r['iteration_s']:.3f} ({r['iteration_ratio']:.2f}) | {r['episodes_per_s']:.1f} "
              f"| {r['generated_tokens_per_s']:.0f} | {r['generation_share']:.0%} | {r['peak_rss_gb']:.2f} |" + gpu)
    print(f"\nOn 1 rank each ratio is the median over {len(pairs)} pairs of an iteration of ppo.py and the limit's next "
          f"to it in time. Process state, round 1: ppo.py {states[0]['ppo.py']}; the limit {states[0]['limit']}; "
          f"load average now {os.getloadavg()[0]:.2f} (1 minute).")
    if null:
        null_ratios = [[second_s / limit_s for second_s, limit_s in round_pairs] for round_pairs in null]
        print(f"The limit against a second limit, taking turns in the same way (the noise of the 1-rank ratios): "
              f"iteration ratio {statistics.median(r for rounds in null_ratios for r in rounds):.2f} over "
              f"{sum(map(len, null_ratios))} pairs; by round "
              f"{', '.join(f'{statistics.median(r):.2f}' for r in null_ratios)}.")
    print("\nWhere the time of an iteration goes, in one process (--profile):")
    print_profile(ppo_profile, limit_profile)
    print("\n| model (one rank, ZeRO-0, fp32) | parameters MB | gradients MB | optimizer state MB |\n|---|---|---|---|")
    for m in memory:
        print(f"| {m['model']} | {m['parameters_mb']:.2f} | {m['gradients_mb']:.2f} | {m['optimizer_state_mb']:.2f} |")
    if 0 in args.two_rank_stages:
        print()
        for stage in [s for s in args.two_rank_stages if s != 0]:  # each iteration against ZeRO-0's next to it
            stage_pairs = against_zero0(two_ranks, stage)
            ratio = median_ratios(stage_pairs)
            print(f"actor ZeRO-{stage} / ZeRO-0 on 2 ranks, the median over {len(stage_pairs)} pairs of iterations "
                  f"next to each other in time: rollout {ratio['rollout']:.2f}, update {ratio['update']:.2f}, "
                  f"iteration {ratio['iteration']:.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.output_json, "w") as f:
        json.dump({"commit": commit, "args": asdict(args), "rows": rows, "memory": memory, "state": states,
                   "pairs": iteration_seconds(pairs),
                   "two_rank_pairs": {stage: iteration_seconds(stage_pairs)
                                      for stage, stage_pairs in two_rank_pairs.items()},
                   "null_pairs": null,
                   "profile": {"ppo.py": ppo_profile, "limit": limit_profile}}, f, indent=2)
    print(f"wrote {args.output_json}")
