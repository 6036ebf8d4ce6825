"""Evaluation: did PPO improve the policy, on the task's truth and on the reward model, and at what cost in KL?

Both policies, the SFT model (stage 1) and the PPO actor (stage 3), answer the same held-out prompts with ppo.py's
sampling settings. Two judges score every response:
  - the reward model (stage 2), normalized as ppo.py normalizes it: (score - reward_mean) / reward_std. It is the
    proxy that PPO optimised, so a gain on it alone proves little.
  - the gold judge (toy task only): the task's own rule (toy_task/gold_judge.py), which training never sees. A
    response it cannot parse counts as a loss against any response it can.
The table compares mean scores, win rates of PPO over SFT on the same prompt, the parse rate, the KL of the PPO
policy to the SFT policy, the response length, and the rank correlation (Spearman) of the reward model with the gold
rule. With the snapshots that `ppo.py --snapshot-every N` saves, it also draws both scores against the KL to the SFT
policy along training: where the proxy keeps rising and the truth stops, PPO is over-optimising the reward model
(Gao et al. 2022, "Scaling Laws for Reward Model Overoptimization").

    python evaluate.py                 # after sft.py, reward_model.py and ppo.py on the bundled toy task
"""

import glob
import json
import os
from dataclasses import asdict, dataclass

import datasets
import torch
import tyro
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import rlhf_math
from ppo import response_logprobs, reward_scores, sampling_config
from toy_task.gold_judge import gold_score


@dataclass
class Args:
    seed: int = 1
    """seed of the sampling"""
    sft_model: str = "checkpoints/sft"
    """the SFT policy (stage 1), the baseline"""
    ppo_model: str = "checkpoints/ppo/actor"
    """the PPO policy (stage 3)"""
    reward_model: str = "checkpoints/reward_model"
    """the reward model (stage 2) that scores both, normalized with its config's reward_mean and reward_std"""
    gold_judge: bool = True
    """also score with the bundled toy task's own rule (toy_task/gold_judge.py); --no-gold-judge for other data"""
    snapshots_dir: str | None = None
    """the actor snapshots of `ppo.py --snapshot-every N`, for the over-optimisation picture; PPO_MODEL/../snapshots
    when not set (skipped if there is none)"""
    snapshot_prompts: int = 200
    """held-out prompts answered by each snapshot"""
    dataset: str = "toy_task/data"
    """a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder; only prompts are used"""
    split: str = "test"
    """the held-out split whose prompts are answered"""
    prompt_column: str = "prompt"
    """the column that holds the prompt"""
    max_prompt_len: int = 32
    """longest prompt in tokens; longer prompts are left out (and counted), as in ppo.py"""
    max_new_tokens: int = 24
    """longest response, as in ppo.py"""
    temperature: float = 1.0
    """sampling temperature, as in ppo.py"""
    batch_size: int = 64
    """prompts per generation batch"""
    num_samples: int = 5
    """side-by-side samples to print"""
    metrics_file: str | None = None
    """the metrics.jsonl of the PPO run to plot; the newest runs/ppo__*/metrics.jsonl when not set"""
    output_dir: str = "runs"
    """where the pictures (ppo_training.png, overoptimization.png) and the figures (evaluation.json) are written"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""


def fail(message: str) -> None:
    """Stop with a one-line message that says what to fix."""
    raise SystemExit(f"evaluate.py: error: {message}")


def load_model(model_class, path: str, flag: str, args: Args, device: torch.device):
    """A trained model folder, in eval mode (dropout off); safetensors only."""
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        fail(f"no model.safetensors in {path!r}; train it first or check {flag}")
    model = model_class.from_pretrained(path, use_safetensors=True, trust_remote_code=args.trust_remote_code)
    return model.eval().to(device)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def win_rate(first: list, second: list) -> float:
    """How often `first` beats `second` on the same prompt, ties counted half; None (a response that the gold judge
    cannot parse) loses against any number and ties with None."""
    def value(score):
        return float("-inf") if score is None else score
    return mean([1.0 if value(a) > value(b) else 0.5 if value(a) == value(b) else 0.0 for a, b in zip(first, second)])


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks, ties given their average rank."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for i in order[start:end + 1]:
                result[i] = (start + end) / 2
            start = end + 1
        return torch.tensor(result, dtype=torch.float64)
    if len(x) < 2:
        return float("nan")
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


@torch.no_grad()
def answer(policy, sft, reward, tokenizer, prompts: list[list[int]], generation_config, args: Args,
           reward_mean: float, reward_std: float, device) -> dict[str, list]:
    """Sample one response per prompt from `policy` as ppo.py does, and measure it: the normalized reward-model score,
    the gold score (None where the text does not parse), the length in tokens (EOS included), and the KL to the SFT
    policy (the sum over the response of log pi - log pi_sft, the k1 estimate behind objective/kl)."""
    result = {"responses": [], "scores": [], "gold": [], "lengths": [], "kl": []}
    for start in range(0, len(prompts), args.batch_size):
        padded = tokenizer.pad({"input_ids": prompts[start : start + args.batch_size]}, return_tensors="pt")
        prompt_ids, prompt_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device)
        P = prompt_ids.shape[1]
        torch.manual_seed(args.seed + start)  # the same random stream for every policy
        sequences = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                    generation_config=generation_config)
        # Truncate after the first EOS, as ppo.py does.
        responses = sequences[:, P:]
        response_mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
        responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
        sequences = torch.cat([prompt_ids, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        result["scores"] += reward_scores(reward, sequences, attention_mask, P, reward_mean, reward_std).tolist()
        result["lengths"] += response_mask.sum(dim=1).tolist()
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        result["responses"] += texts
        result["gold"] += [gold_score(text) if args.gold_judge else None for text in texts]
        if policy is sft:
            result["kl"] += [0.0] * len(texts)
        else:
            logprobs, sft_logprobs = [response_logprobs(model, sequences, attention_mask, P, args.temperature)
                                      for model in (policy, sft)]
            kl = torch.where(response_mask.bool(), logprobs - sft_logprobs, 0.0).sum(dim=1)
            result["kl"] += kl.tolist()
    return result


def summarize(result: dict[str, list], baseline: dict[str, list] | None, gold_judge: bool) -> dict[str, float]:
    """A policy's figures; the win rates are over `baseline`'s responses to the same prompts."""
    summary = {"mean_score": mean(result["scores"]), "mean_kl_to_sft": mean(result["kl"]),
               "mean_length": mean(result["lengths"])}
    if baseline is not None:
        summary["win_rate"] = win_rate(result["scores"], baseline["scores"])
    if gold_judge:
        parsed = [(score, gold) for score, gold in zip(result["scores"], result["gold"]) if gold is not None]
        summary["mean_gold_score"] = mean([gold for _, gold in parsed])  # over the responses that parse
        summary["parse_rate"] = len(parsed) / len(result["gold"])
        summary["spearman_score_gold"] = spearman([s for s, _ in parsed], [g for _, g in parsed])
        if baseline is not None:
            summary["gold_win_rate"] = win_rate(result["gold"], baseline["gold"])
    return summary


def plot_training(metrics_file: str, path: str) -> None:
    """Reward (score and score minus KL penalty) and KL per episode, read from ppo.py's metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    with open(metrics_file) as f:
        rows = [json.loads(line) for line in f]
    episodes = [row["episode"] for row in rows]
    fig, (reward_axis, kl_axis) = plt.subplots(1, 2, figsize=(10, 4))
    reward_axis.plot(episodes, [row["objective/scores"] for row in rows], label="objective/scores")
    reward_axis.plot(episodes, [row["objective/rlhf_reward"] for row in rows], label="objective/rlhf_reward")
    reward_axis.set(xlabel="episode", ylabel="reward", title="reward model score (normalized)")
    reward_axis.legend()
    kl_axis.plot(episodes, [row["objective/kl"] for row in rows])
    kl_axis.set(xlabel="episode", ylabel="KL(pi || pi_ref) per response", title="objective/kl")
    fig.suptitle(os.path.dirname(metrics_file))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_overoptimization(points: list[dict], path: str) -> None:
    """Proxy against truth along training, one point per snapshot, against the KL to the SFT policy (Gao et al.
    2022): the win rates over SFT by the reward model and by the gold rule, and the parse rate; the mean scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = [p["mean_kl_to_sft"] for p in points]
    fig, (rate_axis, score_axis) = plt.subplots(1, 2, figsize=(11, 4))
    rate_axis.plot(kl, [p["win_rate"] for p in points], "o-", label="win rate by the reward model (the proxy)")
    rate_axis.plot(kl, [p["gold_win_rate"] for p in points], "s-", label="win rate by the gold rule (the truth)")
    rate_axis.plot(kl, [p["parse_rate"] for p in points], "^--", label="parse rate (gold judge)")
    for p in points:
        rate_axis.annotate(p["label"], (p["mean_kl_to_sft"], p["gold_win_rate"]), fontsize=7)
    rate_axis.set(xlabel="KL(pi || pi_sft) per response", ylim=(0, 1.02), title="against the SFT policy")
    rate_axis.legend(fontsize=8)
    score_axis.plot(kl, [p["mean_score"] for p in points], "o-", label="reward model (normalized)")
    score_axis.set(xlabel="KL(pi || pi_sft) per response", ylabel="mean reward-model score", title="mean scores")
    gold_axis = score_axis.twinx()
    gold_axis.plot(kl, [p["mean_gold_score"] for p in points], "s-", color="tab:orange",
                   label="gold rule (responses that parse)")
    gold_axis.set(ylabel="mean gold score")
    score_axis.legend(handles=score_axis.get_lines() + gold_axis.get_lines(), fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    args = tyro.cli(Args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.metrics_file is None:
        candidates = glob.glob(os.path.join("runs", "ppo__*", "metrics.jsonl"))
        if not candidates:
            fail("no runs/ppo__*/metrics.jsonl to plot; run ppo.py first or set --metrics-file")
        args.metrics_file = max(candidates, key=os.path.getmtime)
    elif not os.path.isfile(args.metrics_file):
        fail(f"no metrics file at {args.metrics_file!r}; check --metrics-file")
    if args.snapshots_dir is None:
        args.snapshots_dir = os.path.join(os.path.dirname(args.ppo_model.rstrip("/")), "snapshots")
    snapshots = sorted(glob.glob(os.path.join(args.snapshots_dir, "iteration_*")),
                       key=lambda path: int(path.rsplit("_", 1)[1]))

    sft = load_model(AutoModelForCausalLM, args.sft_model, "--sft-model", args, device)
    ppo = load_model(AutoModelForCausalLM, args.ppo_model, "--ppo-model", args, device)
    reward = load_model(AutoModelForSequenceClassification, args.reward_model, "--reward-model", args, device)
    reward_mean = getattr(reward.config, "reward_mean", 0.0)
    reward_std = getattr(reward.config, "reward_std", 1.0)
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model, padding_side="left",
                                              trust_remote_code=args.trust_remote_code)
    for path, flag in [(args.ppo_model, "--ppo-model"), (args.reward_model, "--reward-model")]:
        if AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code).get_vocab() != tokenizer.get_vocab():
            fail(f"{path!r} has another tokenizer than the SFT model {args.sft_model!r}; check {flag}")

    if os.path.isfile(args.dataset):
        kind = "parquet" if args.dataset.endswith(".parquet") else "json"
        data = datasets.load_dataset(kind, data_files={args.split.split("[")[0]: args.dataset}, split=args.split)
    else:
        try:
            data = datasets.load_dataset(args.dataset, split=args.split)
        except (FileNotFoundError, ValueError) as error:
            fail(f"cannot load split {args.split!r} of data set {args.dataset!r} ({error}); check --dataset")
    if args.prompt_column not in data.column_names:
        fail(f"data set {args.dataset!r} has no column {args.prompt_column!r}; its columns are {data.column_names}")
    prompts = [ids for ids in tokenizer(list(data[args.prompt_column]))["input_ids"]
               if 0 < len(ids) <= args.max_prompt_len]
    if not prompts:
        fail(f"no prompt of split {args.split!r} fits --max-prompt-len {args.max_prompt_len}")
    if len(prompts) < len(data):
        print(f"left out {len(data) - len(prompts)} of {len(data)} prompts longer than --max-prompt-len")

    # ppo.py's sampling settings. The models' own generation_config.json is replaced, so that nothing in it (a
    # repetition penalty, min_new_tokens) changes what is sampled.
    generation_config = sampling_config(tokenizer, args.max_new_tokens, args.temperature)
    sft.generation_config = ppo.generation_config = generation_config
    judged = (tokenizer, prompts, generation_config, args, reward_mean, reward_std, device)
    results = {"sft": answer(sft, sft, reward, *judged)}
    print(f"SFT answered {len(prompts)} prompts")
    results["ppo"] = answer(ppo, sft, reward, *judged)
    print(f"PPO answered {len(prompts)} prompts")
    summary = {"prompts": len(prompts), "sft": summarize(results["sft"], None, args.gold_judge),
               "ppo": summarize(results["ppo"], results["sft"], args.gold_judge), "args": asdict(args)}
    summary["length_change"] = summary["ppo"]["mean_length"] / summary["sft"]["mean_length"] - 1

    sft_summary, ppo_summary = summary["sft"], summary["ppo"]
    table = Table("", "SFT policy", "PPO policy", title=f"{len(prompts)} held-out prompts of {args.dataset!r} ({args.split})")
    rows = [("mean reward-model score (normalized)", "mean_score", "{:+.3f}"),
            ("win rate of PPO over SFT, by the reward model", "win_rate", "{:.3f}")]
    if args.gold_judge:
        rows += [("mean gold score (responses that parse)", "mean_gold_score", "{:+.3f}"),
                 ("win rate of PPO over SFT, by the gold rule", "gold_win_rate", "{:.3f}"),
                 ("parse rate", "parse_rate", "{:.3f}"),
                 ("Spearman correlation of reward model and gold rule", "spearman_score_gold", "{:.3f}")]
    rows += [("mean KL to the SFT policy (per response)", "mean_kl_to_sft", "{:.2f}"),
             ("mean length (tokens, EOS included)", "mean_length", "{:.1f}")]
    for name, key, form in rows:
        table.add_row(name, form.format(sft_summary[key]) if key in sft_summary else "", form.format(ppo_summary[key]))
    samples = Table("prompt", "SFT", "PPO", title="samples [reward-model score | gold score]" if args.gold_judge
                    else "samples [reward-model score]", show_lines=True)

    def label(result, i):
        gold = result["gold"][i]
        if not args.gold_judge:
            return f"{result['responses'][i]}  [{result['scores'][i]:+.2f}]"
        return f"{result['responses'][i]}  [{result['scores'][i]:+.2f} | {'no parse' if gold is None else f'{gold:+.2f}'}]"

    for i in range(min(args.num_samples, len(prompts))):
        samples.add_row(tokenizer.decode(prompts[i], skip_special_tokens=True), label(results["sft"], i),
                        label(results["ppo"], i))
    Console().print(table, samples)

    os.makedirs(args.output_dir, exist_ok=True)
    picture = os.path.join(args.output_dir, "ppo_training.png")
    plot_training(args.metrics_file, picture)
    print(f"wrote {picture} (from {args.metrics_file})")

    # The over-optimisation picture: every snapshot answers the first snapshot_prompts prompts, against the SFT policy.
    if snapshots and args.gold_judge:
        few = prompts[: args.snapshot_prompts]
        sft_few = answer(sft, sft, reward, tokenizer, few, generation_config, args, reward_mean, reward_std, device)
        points = [{"label": "SFT", **summarize(sft_few, sft_few, gold_judge=True)}]
        for path in snapshots:
            policy = load_model(AutoModelForCausalLM, path, "--snapshots-dir", args, device)
            policy.generation_config = generation_config
            result = answer(policy, sft, reward, tokenizer, few, generation_config, args, reward_mean, reward_std,
                            device)
            points.append({"label": os.path.basename(path).replace("iteration_", "it "),
                           **summarize(result, sft_few, gold_judge=True)})
            print(f"{points[-1]['label']}: KL {points[-1]['mean_kl_to_sft']:.2f}, reward model "
                  f"{points[-1]['mean_score']:+.2f}, gold {points[-1]['mean_gold_score']:+.2f}, gold win rate "
                  f"{points[-1]['gold_win_rate']:.3f}")
        summary["overoptimization"] = points
        picture = os.path.join(args.output_dir, "overoptimization.png")
        plot_overoptimization(points, picture)
        print(f"wrote {picture} ({len(snapshots)} snapshots from {args.snapshots_dir})")
    elif args.gold_judge:
        print(f"no snapshots in {args.snapshots_dir}: run ppo.py with --snapshot-every N for the over-optimisation "
              "picture")
    with open(os.path.join(args.output_dir, "evaluation.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {os.path.join(args.output_dir, 'evaluation.json')}")
