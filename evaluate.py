"""Evaluation: did PPO improve the policy under the reward model, and at what cost in KL and length?

Both policies, the SFT model (stage 1) and the PPO actor (stage 3), answer the same held-out prompts with the same
sampling settings as ppo.py's rollout. The reward model (stage 2) scores every response; the table compares the mean
score, the win rate of PPO over SFT on the same prompt, the KL of the PPO policy to the SFT policy, and the response
length. A picture of reward and KL over training is drawn from the PPO run's metrics file.

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
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

import rlhf_math
from ppo import head_at_every_position, response_logits


@dataclass
class Args:
    seed: int = 1
    """seed of the sampling"""
    sft_model: str = "checkpoints/sft"
    """the SFT policy (stage 1), the baseline"""
    ppo_model: str = "checkpoints/ppo/actor"
    """the PPO policy (stage 3)"""
    reward_model: str = "checkpoints/reward_model"
    """the reward model (stage 2) that scores both; its config's `reward_mean` is subtracted, as in ppo.py"""
    dataset: str = "toy_task/data"
    """a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder; only prompts are used"""
    split: str = "test"
    """the held-out split whose prompts are answered"""
    prompt_column: str = "prompt"
    """the column that holds the prompt"""
    max_prompt_len: int = 32
    """longest prompt in tokens; longer prompts are left out, as in ppo.py"""
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
    """where the picture (ppo_training.png) and the figures (evaluation.json) are written"""
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
    reward_axis.set(xlabel="episode", ylabel="reward", title="reward model score")
    reward_axis.legend()
    kl_axis.plot(episodes, [row["objective/kl"] for row in rows])
    kl_axis.set(xlabel="episode", ylabel="KL(pi || pi_ref) per response", title="objective/kl")
    fig.suptitle(os.path.dirname(metrics_file))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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

    sft = load_model(AutoModelForCausalLM, args.sft_model, "--sft-model", args, device)
    ppo = load_model(AutoModelForCausalLM, args.ppo_model, "--ppo-model", args, device)
    reward = load_model(AutoModelForSequenceClassification, args.reward_model, "--reward-model", args, device)
    reward_mean = getattr(reward.config, "reward_mean", 0.0)
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

    # ppo.py's sampling settings: plain multinomial sampling at the temperature, pad suppressed.
    generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        suppress_tokens=[tokenizer.pad_token_id],
    )
    results = {"sft": {"scores": [], "lengths": [], "responses": []},
               "ppo": {"scores": [], "lengths": [], "responses": [], "kl": []}}
    with torch.no_grad():
        for start in range(0, len(prompts), args.batch_size):
            padded = tokenizer.pad({"input_ids": prompts[start : start + args.batch_size]}, return_tensors="pt")
            prompt_ids, prompt_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device)
            P = prompt_ids.shape[1]
            for name, policy in [("sft", sft), ("ppo", ppo)]:
                torch.manual_seed(args.seed + start)  # the same random stream for both policies
                sequences = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                            generation_config=generation_config)
                # Truncate after the first EOS, as ppo.py does.
                responses = sequences[:, P:]
                response_mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
                responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
                sequences = torch.cat([prompt_ids, responses], dim=1)
                attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
                # The score at the last real token of the response, minus the reward model's mean (as in ppo.py).
                last = P + response_mask.sum(dim=1) - 1
                scores = head_at_every_position(reward, sequences, attention_mask)[torch.arange(len(last)), last]
                results[name]["scores"] += (scores - reward_mean).tolist()
                results[name]["lengths"] += response_mask.sum(dim=1).tolist()
                results[name]["responses"] += tokenizer.batch_decode(responses, skip_special_tokens=True)
                if name == "ppo":
                    # KL(pi_ppo || pi_sft) of each response: the sum over its tokens of log pi_ppo - log pi_sft
                    # (the k1 estimator of objective/kl), on the PPO policy's own samples.
                    logprobs = [rlhf_math.logprobs_from_logits(response_logits(model, sequences, attention_mask, P),
                                                               responses, args.temperature) for model in (ppo, sft)]
                    results["ppo"]["kl"] += ((logprobs[0] - logprobs[1]) * response_mask).sum(dim=1).tolist()
            print(f"answered {min(start + args.batch_size, len(prompts))}/{len(prompts)} prompts")

    def mean(values):
        return sum(values) / len(values)

    sft_scores, ppo_scores = results["sft"]["scores"], results["ppo"]["scores"]
    wins = [1.0 if p > s else 0.5 if p == s else 0.0 for p, s in zip(ppo_scores, sft_scores)]
    summary = {
        "prompts": len(prompts),
        "sft": {"mean_score": mean(sft_scores), "mean_kl_to_sft": 0.0, "mean_length": mean(results["sft"]["lengths"])},
        "ppo": {"mean_score": mean(ppo_scores), "mean_kl_to_sft": mean(results["ppo"]["kl"]),
                "mean_length": mean(results["ppo"]["lengths"])},
        "win_rate_ppo_over_sft": mean(wins),
        "args": asdict(args),
    }
    summary["length_change"] = summary["ppo"]["mean_length"] / summary["sft"]["mean_length"] - 1

    table = Table("policy", "mean score", "win rate vs SFT", "mean KL to SFT", "mean length (tokens)",
                  title=f"{len(prompts)} held-out prompts of {args.dataset!r} ({args.split})")
    table.add_row("SFT", f"{summary['sft']['mean_score']:+.3f}", "", "0",
                  f"{summary['sft']['mean_length']:.1f}")
    table.add_row("PPO", f"{summary['ppo']['mean_score']:+.3f}", f"{summary['win_rate_ppo_over_sft']:.3f}",
                  f"{summary['ppo']['mean_kl_to_sft']:.2f}",
                  f"{summary['ppo']['mean_length']:.1f} ({summary['length_change']:+.0%})")
    samples = Table("prompt", "SFT", "PPO", title="samples", show_lines=True)
    for i in range(min(args.num_samples, len(prompts))):
        samples.add_row(tokenizer.decode(prompts[i], skip_special_tokens=True),
                        f"{results['sft']['responses'][i]}  [{sft_scores[i]:+.2f}]",
                        f"{results['ppo']['responses'][i]}  [{ppo_scores[i]:+.2f}]")
    Console().print(table, samples)

    os.makedirs(args.output_dir, exist_ok=True)
    picture = os.path.join(args.output_dir, "ppo_training.png")
    plot_training(args.metrics_file, picture)
    with open(os.path.join(args.output_dir, "evaluation.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {picture} (from {args.metrics_file}) and {os.path.join(args.output_dir, 'evaluation.json')}")
