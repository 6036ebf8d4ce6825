"""Benchmark: ppo.py against the limit of its own model calls.

For one shape, this script builds random-init models in a temporary folder and runs ppo.py on them for a few
iterations after a warm-up, on one rank and then on 2 ranks at several actor ZeRO stages, in rounds that alternate
each run of ppo.py with a run of the limit, each in a process of its own. The limit is the least work an iteration
of ppo.py needs, done through ppo.py's own helpers on plain torch models (time_limit): one `generate` with the KV
cache and the same stopping, the no-gradient forward passes of actor, reference, critic and reward in the same
micro-batches, the rewards, GAE and whitening, and for each mini-batch the forward, backward, gradient clipping and
fused AdamW step of actor and critic. It has no DeepSpeed, no checks, no statistics, no logging and no learning-rate
schedule: less work than ppo.py's iteration. Every iteration does the same work: generation runs to full length
while any response is open, and a random model samples the EOS, one token in vocab_size + 1, too rarely to close all.

    python benchmark.py                       # the default CPU shape (about 6 minutes on 2 cores)
    python benchmark.py --profile             # where one iteration's time goes, phase by phase, against the limit
    python benchmark.py --preset pythia-1b    # a GPU shape like Pythia-1B, in bf16

Prints one table and writes it as JSON (--output-json) for comparison across commits.
"""

import ast
import contextlib
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
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
    """tokens per response (always reached: EOS cannot be sampled)"""
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
    """rounds: in each, every configuration's ppo.py and the limit run once, alternating, each in a process of its
    own; the table shows the median over the rounds (on a small shared CPU one process's timings differ from
    another's by up to 10%)"""
    two_rank_stages: list[int] = field(default_factory=lambda: [0, 2, 3])
    """actor ZeRO stages to run on 2 ranks (the critic stays at ZeRO-0); empty to skip"""
    output_json: str = "benchmark.json"
    """where the table is written"""
    profile: bool = False
    """instead of the table: where one iteration's time goes, phase by phase, in ppo.py (one rank, in this process)
    and in the limit"""
    profile_zero_stage: int = 0
    """the actor's ZeRO stage in the profile"""


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
    """The shape and precision, and the process state that decides a CPU's speed (threads per rank): a drift in the
    figures is read here first."""
    threads = {ranks: rank_env(ranks).get("OMP_NUM_THREADS", "unset") for ranks in (1, 2)}
    return (f"shape: {args.episodes} episodes of {args.prompt_len} + {args.response_len} tokens, {args.num_layers} "
            f"layers of width {args.hidden_size} ({args.num_heads} heads, MLP {args.intermediate_size}), vocabulary "
            f"{args.vocab_size}, {args.dtype}; on {get_accelerator().device_name()} with {os.cpu_count()} CPU cores, "
            f"this process {torch.get_num_threads()} torch threads, OMP_NUM_THREADS for 1 rank {threads[1]}, "
            f"for each of 2 ranks {threads[2]}")


def run_ppo(args: Args, folder: str, ranks: int, stage: int) -> dict:
    """ppo.py's own timings (its metrics file), the median over the timed iterations, and the peak RSS of a rank."""
    exp_name = f"benchmark_{ranks}ranks_zero{stage}"
    command = ["ppo.py", *ppo_flags(args, folder, ranks, stage, exp_name, args.warmup_iterations + args.iterations)]
    if ranks > 1:
        command = ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", plumbing.free_port(),
                   *command]
    process = subprocess.Popen([sys.executable, *command], env=rank_env(ranks), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    # wait4 gives the rusage of the finished process tree: ru_maxrss is the peak of its largest process, in KiB.
    _, status, rusage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"benchmark.py: ppo.py failed ({' '.join(command)}):\n{output[-3000:]}")
    run_dirs = sorted(d for d in os.listdir("runs") if d.startswith(exp_name + "__"))
    with open(os.path.join("runs", run_dirs[-1], "metrics.jsonl")) as f:
        timed = [json.loads(line) for line in f][args.warmup_iterations:]
    if any(m["val/response_length"] < 0.9 * args.response_len for m in timed):  # a random model rarely samples EOS
        raise SystemExit("benchmark.py: responses stopped early; the timings would not compare")
    result = {name: statistics.median(m[f"time/{name}"] for m in timed) for name in ["rollout", "generation", "update"]}
    result["peak_rss_gb"] = rusage.ru_maxrss / 2**20
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


def time_limit(args: Args, folder: str, ranks: int, profile: bool = False) -> dict:
    """The least one of `ranks` ranks of ppo.py must do in an iteration, at its default settings, timed: the same
    model calls with the same shapes, through ppo.py's own helpers on plain torch models (the calls and the math
    of PPO, nothing else: no DeepSpeed, no checks, no statistics, no logging), and a fused AdamW. Run it in a process
    with the environment of such a rank (time_limit_in_own_process)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    defaults = ppo.Args()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, "policy"))
    policy_path, reward_path = os.path.join(folder, "policy"), os.path.join(folder, "reward")
    actor = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(device).train()
    reference = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(device).requires_grad_(False)
    critic = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=dtype).to(device).train()
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=dtype).to(device)
    reward.requires_grad_(False)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)
                  for model in (actor, critic)]
    per_rank = args.episodes // ranks
    per_mini_batch = per_rank // args.num_mini_batches
    micro = per_mini_batch // args.micro_batches_per_mini_batch
    prompts = torch.randint(1, args.vocab_size, (per_rank, args.prompt_len), device=device)
    generation_config = ppo.sampling_config(tokenizer, args.response_len, defaults.temperature)
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
                sequences = actor.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                           generation_config=generation_config)
                actor.train()
            mask = rlhf_math.response_mask_from_stop(sequences[:, P:], tokenizer.eos_token_id)
            attention_mask = torch.cat([torch.ones_like(prompts), mask], dim=1)
            chunks = list(zip(sequences.split(micro), attention_mask.split(micro)))
            with phase("actor log-probs"):
                logprobs = torch.cat([ppo.response_logprobs(actor, s, m, P, defaults.temperature)
                                      for s, m in chunks])
            with phase("reference log-probs"):
                ref_logprobs = torch.cat([ppo.response_logprobs(reference, s, m, P, defaults.temperature)
                                          for s, m in chunks])
            with phase("critic values"):
                values = torch.cat([ppo.critic_values(critic, s, m, P, 0.0, 1.0) for s, m in chunks])
            with phase("reward scores"):
                scores = torch.cat([ppo.reward_scores(reward, s, m, P, 0.0, 1.0) for s, m in chunks])
            with phase("rewards, GAE and whitening"):
                rewards, _ = rlhf_math.per_token_rewards(scores, logprobs, ref_logprobs, mask, defaults.kl_coef,
                                                         defaults.clip_score, defaults.kl_estimator)
                advantages, returns = rlhf_math.gae_advantages_and_returns(rewards, values, mask, defaults.gamma,
                                                                           defaults.lam)
                advantages = rlhf_math.masked_whiten(advantages, mask)
        synchronize()
        rollout_end = time.perf_counter()
        for epoch in range(args.num_ppo_epochs):
            for mini_batch in torch.randperm(per_rank, device=device).split(per_mini_batch):
                for i in mini_batch.split(micro):
                    with phase("actor forward and loss"):
                        new_logprobs = ppo.response_logprobs(actor, sequences[i], attention_mask[i], P,
                                                             defaults.temperature)
                        pg_loss, _ = rlhf_math.policy_loss(new_logprobs, logprobs[i], advantages[i], mask[i],
                                                           defaults.cliprange)
                    with phase("critic forward and loss"):
                        new_values = ppo.critic_values(critic, sequences[i], attention_mask[i], P, 0.0, 1.0)
                        vf_loss, _ = rlhf_math.value_loss(new_values, values[i], returns[i], mask[i],
                                                          defaults.cliprange_value)
                    with phase("actor backward"):
                        (pg_loss / args.micro_batches_per_mini_batch).backward()
                    with phase("critic backward"):
                        (vf_loss / args.micro_batches_per_mini_batch).backward()
                with phase("optimizer steps"):
                    for model, optimizer in zip((actor, critic), optimizers):
                        torch.nn.utils.clip_grad_norm_(model.parameters(), defaults.gradient_clipping)
                        optimizer.step()
                        optimizer.zero_grad()
        synchronize()
        return {"rollout": rollout_end - start, "update": time.perf_counter() - rollout_end}

    totals, phase = phase_timer(synchronize=profile and device.type == "cuda")
    if not profile:
        phase = lambda name: contextlib.nullcontext()  # noqa: E731
    for _ in range(args.warmup_iterations):
        one_iteration(phase)
    totals.update(dict.fromkeys(totals, 0.0))  # the phases of the timed iterations only
    timed = [one_iteration(phase) for _ in range(args.iterations)]
    limit = {name: statistics.median(t[name] for t in timed) for name in ["rollout", "update"]}
    limit["phases"] = {name: total / args.iterations for name, total in totals.items()}
    limit["mean_iteration"] = statistics.mean(t["rollout"] + t["update"] for t in timed)
    return limit


def time_limit_in_own_process(args: Args, folder: str, ranks: int) -> dict:
    """time_limit in a new Python process with the environment of one of `ranks` ranks, started as ppo.py's runs
    are (a plain `python`, not a multiprocessing child)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import benchmark; print(json.dumps(benchmark.time_limit("
            "benchmark.Args(**json.loads(sys.argv[2])), sys.argv[3], int(sys.argv[4]))))")
    result = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)),
                             json.dumps(asdict(args)), folder, str(ranks)], env=rank_env(ranks), capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"benchmark.py: the limit failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def profile_ppo(args: Args, folder: str) -> dict:
    """ppo.py's iteration by phase: its main block run in this process (one rank, the actor at --profile-zero-stage)
    with the functions it calls for each phase wrapped in a phase timer (the wrappers cost microseconds, a few dozen
    calls an iteration). An iteration runs from one prompts_of_iteration call to the next, so it includes the
    logging."""
    totals, phase = phase_timer(synchronize=torch.cuda.is_available())
    starts, timed_totals = [], {}  # each iteration's start; the phase totals when the timed iterations end

    def grad_or_not(with_grad: str | None, without_grad: str | None):
        return lambda *a, **k: with_grad if torch.is_grad_enabled() else without_grad

    def always(name: str):
        return lambda *a, **k: name

    def iteration_start(prompts, iteration, *a, **k):
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
            name = name_of(*a, **k)
            if name is None:
                return function(*a, **k)
            with phase(name):
                return function(*a, **k)
        return wrapper

    originals = {key: getattr(*key) for key in phase_of}
    main = ast.parse(inspect.getsource(ppo)).body[-1]  # if __name__ == "__main__": its body, run as ppo.py runs it
    iterations = args.warmup_iterations + args.iterations + 1  # the last one only ends the timed ones
    argv, sys.argv = sys.argv, ["ppo.py", *ppo_flags(args, folder, 1, args.profile_zero_stage, "benchmark_profile",
                                                 iterations)]
    try:
        for (owner, name), name_of in phase_of.items():
            setattr(owner, name, timed(originals[(owner, name)], name_of))
        exec(compile(ast.Module(body=main.body, type_ignores=[]), ppo.__file__, "exec"), vars(ppo))
    finally:
        sys.argv = argv
        for (owner, name), function in originals.items():
            setattr(owner, name, function)
    first, last = starts[args.warmup_iterations], starts[args.warmup_iterations + args.iterations]
    return {"phases": {name: total / args.iterations for name, total in timed_totals.items()},
            "mean_iteration": (last - first) / args.iterations}


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


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.preset != "cpu":
        defaults = Args()
        for key, value in PRESETS[args.preset].items():
            if getattr(args, key) == getattr(defaults, key):  # a flag given with another value wins over the preset
                setattr(args, key, value)
    os.makedirs("runs", exist_ok=True)
    print(settings(args), flush=True)
    if args.profile:
        with tempfile.TemporaryDirectory() as folder:
            build_models(args, folder)
            ppo_profile = profile_ppo(args, folder)
            print_profile(ppo_profile, time_limit(args, folder, 1, profile=True))
        raise SystemExit(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build_models(args, folder)
        configs = {1: [0], 2: args.two_rank_stages}
        runs = {(ranks, stage): [] for ranks, stages in configs.items() for stage in stages}
        limits = {ranks: [] for ranks, stages in configs.items() if stages}
        for round_number in range(1, args.repeats + 1):
            for ranks in limits:
                for stage in configs[ranks]:
                    print(f"round {round_number}/{args.repeats}: ppo.py, {ranks} rank(s), actor ZeRO-{stage} ...",
                          flush=True)
                    runs[(ranks, stage)].append(run_ppo(args, folder, ranks, stage))
                print(f"round {round_number}/{args.repeats}: the limit, the work of one of {ranks} rank(s) ...",
                      flush=True)
                limits[ranks].append(time_limit_in_own_process(args, folder, ranks))
        for (ranks, stage), measured_runs in runs.items():
            measured = {key: statistics.median(m[key] for m in measured_runs) for key in measured_runs[0]}
            limit = {key: statistics.median(m[key] for m in limits[ranks]) for key in ["rollout", "update"]}
            iteration = measured["rollout"] + measured["update"]
            rows.append({
                "config": f"{ranks} rank{'s' if ranks > 1 else ''}, actor ZeRO-{stage}",
                "rollout_s": measured["rollout"], "rollout_limit_s": limit["rollout"],
                "update_s": measured["update"], "update_limit_s": limit["update"],
                "iteration_s": iteration, "iteration_limit_s": limit["rollout"] + limit["update"],
                "generation_share": measured["generation"] / iteration,
                "episodes_per_s": args.episodes / iteration,
                "generated_tokens_per_s": args.episodes * args.response_len / measured["generation"],
                "peak_rss_gb": measured["peak_rss_gb"],
                "gpu_max_allocated_gb": measured["max_allocated_gb"], "gpu_max_reserved_gb": measured["max_reserved_gb"],
            })

        memory = model_memory(args, folder)

    on_gpu = torch.cuda.is_available()
    header = ["config", "rollout s (limit, ratio)", "update s (limit, ratio)", "iteration s (ratio)", "episodes/s",
              "gen tokens/s", "gen share", "peak RSS GB"] + (["GPU max allocated / reserved GB"] if on_gpu else [])
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        gpu = f" {r['gpu_max_allocated_gb']:.2f} / {r['gpu_max_reserved_gb']:.2f} |" if on_gpu else ""
        print(f"| {r['config']} | {r['rollout_s']:.3f} ({r['rollout_limit_s']:.3f}, "
              f"{r['rollout_s'] / r['rollout_limit_s']:.2f}) "
              f"| {r['update_s']:.3f} ({r['update_limit_s']:.3f}, {r['update_s'] / r['update_limit_s']:.2f}) "
              f"| {r['iteration_s']:.3f} ({r['iteration_s'] / r['iteration_limit_s']:.2f}) | {r['episodes_per_s']:.1f} "
              f"| {r['generated_tokens_per_s']:.0f} | {r['generation_share']:.0%} | {r['peak_rss_gb']:.2f} |" + gpu)
    print("\n| model (one rank, ZeRO-0, fp32) | parameters MB | gradients MB | optimizer state MB |\n|---|---|---|---|")
    for m in memory:
        print(f"| {m['model']} | {m['parameters_mb']:.2f} | {m['gradients_mb']:.2f} | {m['optimizer_state_mb']:.2f} |")
    by_config = {r["config"]: r for r in rows}
    if "2 ranks, actor ZeRO-0" in by_config:
        zero0 = by_config["2 ranks, actor ZeRO-0"]
        print()
        for stage in [s for s in args.two_rank_stages if s != 0]:
            r = by_config[f"2 ranks, actor ZeRO-{stage}"]
            print(f"actor ZeRO-{stage} / ZeRO-0 on 2 ranks: rollout {r['rollout_s'] / zero0['rollout_s']:.2f}, "
                  f"update {r['update_s'] / zero0['update_s']:.2f}, "
                  f"iteration {r['iteration_s'] / zero0['iteration_s']:.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.output_json, "w") as f:
        json.dump({"commit": commit, "args": asdict(args), "rows": rows, "memory": memory}, f, indent=2)
    print(f"wrote {args.output_json}")
