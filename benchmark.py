"""Benchmark: ppo.py against the limit of its own model calls.

For one shape, this script builds random-init models in a temporary folder and runs ppo.py on them for a few
iterations after a warm-up, on one rank and then on 2 ranks at several actor ZeRO stages. It then times the same
work as bare torch calls on the same models, with no DeepSpeed and no bookkeeping: one `generate` of the batch, the
forward passes of actor, reference, critic and reward, and the forward, backward and optimizer steps of actor and
critic for the same number of micro-batches. That sum is the "limit". Responses are forced to full length: the
benchmark's tokenizer puts EOS outside the models' vocabulary, so no model can sample it.

    python benchmark.py                       # the default CPU shape (about 2 minutes on 2 cores)
    python benchmark.py --preset pythia-1b    # a GPU shape like Pythia-1B, in bf16

Prints one table and writes it as JSON (--output-json) for comparison across commits.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import tyro
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging

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
    iterations: int = 15
    """iterations timed"""
    two_rank_stages: list[int] = field(default_factory=lambda: [0, 2, 3])
    """actor ZeRO stages to run on 2 ranks (the critic stays at ZeRO-0); empty to skip"""
    output_json: str = "benchmark.json"
    """where the table is written"""


def build_models(args: Args, folder: str) -> None:
    """A random policy (actor and reference) and a random reward model (critic and reward), with a word-level
    tokenizer whose EOS id is vocab_size: outside every model's vocabulary, so responses always run to full length."""
    words = ["<pad>"] + [f"w{i}" for i in range(1, args.vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<pad>", "<eos>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                         num_attention_heads=args.num_heads, intermediate_size=args.intermediate_size,
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


def free_port() -> int:
    """A TCP port free on this machine now: two runs side by side must not both take the launcher's default."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ppo(args: Args, folder: str, ranks: int, stage: int) -> dict:
    """ppo.py's own timings (its metrics file), the median over the timed iterations, and the peak RSS of a rank."""
    exp_name = f"benchmark_{ranks}ranks_zero{stage}"
    per_rank = args.episodes // ranks
    command = [
        "ppo.py", "--actor-model-name-or-path", os.path.join(folder, "policy"),
        "--reward-model-name-or-path", os.path.join(folder, "reward"), "--dataset", os.path.join(folder, "prompts.jsonl"),
        "--max-prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.response_len),
        "--total-episodes", str(args.episodes * (args.warmup_iterations + args.iterations)),
        "--per-device-rollout-batch-size", str(per_rank), "--num-ppo-epochs", str(args.num_ppo_epochs),
        "--num-mini-batches", str(args.num_mini_batches),
        "--per-device-train-batch-size", str(per_rank // args.num_mini_batches // args.micro_batches_per_mini_batch),
        "--actor-zero-stage", str(stage), "--dtype", args.dtype, "--sample-every", "0",
        "--exp-name", exp_name, "--output-dir", os.path.join(folder, exp_name),
    ]
    if ranks > 1:
        command = ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(free_port()),
                   *command]
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore"}
    if ranks > 1 and not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // ranks))  # the cores shared between the ranks
    process = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    output = process.stdout.read()
    # wait4 gives the rusage of the finished process tree: ru_maxrss is the peak of its largest process, in KiB.
    _, status, rusage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"benchmark.py: ppo.py failed ({' '.join(command)}):\n{output[-3000:]}")
    run_dirs = sorted(d for d in os.listdir("runs") if d.startswith(exp_name + "__"))
    with open(os.path.join("runs", run_dirs[-1], "metrics.jsonl")) as f:
        timed = [json.loads(line) for line in f][args.warmup_iterations:]
    if any(m["val/response_length"] != args.response_len for m in timed):
        raise SystemExit("benchmark.py: a response stopped early; the timings would not compare")
    result = {name: statistics.median(m[f"time/{name}"] for m in timed) for name in ["rollout", "generation", "update"]}
    result["peak_rss_gb"] = rusage.ru_maxrss / 2**20
    for name in ["max_allocated_gb", "max_reserved_gb"]:  # rank 0's accelerator memory, as ppo.py logs it
        result[name] = max(m[f"memory/{name}"] for m in timed)
    return result


def time_limit(args: Args, folder: str, ranks: int) -> dict:
    """The same model calls as one rank of ppo.py makes in an iteration, as bare torch calls, timed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // ranks))
    policy_path, reward_path = os.path.join(folder, "policy"), os.path.join(folder, "reward")
    actor = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(device)
    reference = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(device)
    critic = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=dtype).to(device)
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=dtype).to(device)
    reference.requires_grad_(False)
    reward.requires_grad_(False)
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-6)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-6)
    per_rank = args.episodes // ranks
    micro = per_rank // args.num_mini_batches // args.micro_batches_per_mini_batch
    prompts = torch.randint(1, args.vocab_size, (per_rank, args.prompt_len), device=device)
    generation_config = GenerationConfig(max_new_tokens=args.response_len, do_sample=True, top_k=0, top_p=1.0,
                                         eos_token_id=args.vocab_size, pad_token_id=0, suppress_tokens=[0])

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def one_iteration() -> dict:
        times = {}
        synchronize()
        start = time.time()
        with torch.no_grad():
            sequences = actor.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                       generation_config=generation_config)
            synchronize()
            times["generation"] = time.time() - start
            for model in (actor, reference, critic, reward):
                for chunk in sequences.split(micro):
                    model(input_ids=chunk)
        synchronize()
        times["rollout"] = time.time() - start
        start = time.time()
        for _ in range(args.num_ppo_epochs * args.num_mini_batches):
            for chunk in sequences.split(micro)[: args.micro_batches_per_mini_batch]:
                actor(input_ids=chunk).logits.float().mean().backward()
                critic(input_ids=chunk).logits.float().mean().backward()
            for optimizer in (actor_optimizer, critic_optimizer):
                optimizer.step()
                optimizer.zero_grad()
        synchronize()
        times["update"] = time.time() - start
        return times

    for _ in range(args.warmup_iterations):
        one_iteration()
    timed = [one_iteration() for _ in range(args.iterations)]
    return {name: statistics.median(t[name] for t in timed) for name in ["rollout", "generation", "update"]}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def model_memory(args: Args, folder: str) -> list[dict]:
    """Bytes of parameters, gradients and optimizer state of ppo.py's four engines, built by ppo.py's own functions
    (one rank, ZeRO-0, fp32: the optimizer is then torch's own AdamW, whose state is all there is) and measured after
    one training step of actor and critic (gradients just before it)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import ppo

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
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
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build_models(args, folder)
        configs = [(1, 0)] + [(2, stage) for stage in args.two_rank_stages]
        limits = {}
        for ranks, stage in configs:
            print(f"ppo.py, {ranks} rank(s), actor ZeRO-{stage} ...", flush=True)
            ppo = run_ppo(args, folder, ranks, stage)
            if ranks not in limits:
                print(f"bare torch calls, the work of one of {ranks} rank(s) ...", flush=True)
                limits[ranks] = time_limit(args, folder, ranks)
            limit = limits[ranks]
            iteration = ppo["rollout"] + ppo["update"]
            rows.append({
                "config": f"{ranks} rank{'s' if ranks > 1 else ''}, actor ZeRO-{stage}",
                "rollout_s": ppo["rollout"], "rollout_limit_s": limit["rollout"],
                "update_s": ppo["update"], "update_limit_s": limit["update"],
                "iteration_s": iteration, "iteration_limit_s": limit["rollout"] + limit["update"],
                "generation_share": ppo["generation"] / iteration,
                "episodes_per_s": args.episodes / iteration,
                "generated_tokens_per_s": args.episodes * args.response_len / ppo["generation"],
                "peak_rss_gb": ppo["peak_rss_gb"],
                "gpu_max_allocated_gb": ppo["max_allocated_gb"], "gpu_max_reserved_gb": ppo["max_reserved_gb"],
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
    if "2 ranks, actor ZeRO-3" in by_config and "2 ranks, actor ZeRO-0" in by_config:
        ratio = by_config["2 ranks, actor ZeRO-3"]["rollout_s"] / by_config["2 ranks, actor ZeRO-0"]["rollout_s"]
        print(f"\nrollout time, actor ZeRO-3 / ZeRO-0 on 2 ranks: {ratio:.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.output_json, "w") as f:
        json.dump({"commit": commit, "args": asdict(args), "rows": rows, "memory": memory}, f, indent=2)
    print(f"wrote {args.output_json}")
