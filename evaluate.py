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

import io
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import plumbing
import rlhf_math
from plumbing import CountInt, PositiveFloat, PositiveInt, Seed
from ppo import (check_not_saved_by_ppo, check_score_head, response_logprobs, reward_scores, sample, sampling_config,
                 score_normalization)
from toy_task.gold_judge import gold_score


@dataclass
class Args:
    seed: Seed = 1
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
    snapshot_prompts: PositiveInt = 200
    """held-out prompts answered by each snapshot"""
    dataset: str = os.path.join(plumbing.TOY_TASK, "data")
    """the prompts' data set, as ppo.py's --dataset: a hub name, or a local .json/.jsonl/.parquet file or folder"""
    split: str = "test"
    """the held-out split whose prompts are answered"""
    prompt_column: str = "prompt"
    """the column of the prompts, as in ppo.py: text, or a list of {"role", "content"} chat messages"""
    split_conversations: bool = False
    """the hh-rlhf layout, as in ppo.py: each cell of --prompt-column (pass --prompt-column chosen) is a whole
    conversation, whose prompt ends at its last --assistant-marker"""
    assistant_marker: str = "\n\nAssistant:"
    """the opening of the last assistant turn in a whole conversation (--split-conversations), as in ppo.py"""
    max_prompt_len: PositiveInt = 32
    """longest prompt in tokens; longer prompts are left out (and counted), as in ppo.py"""
    max_new_tokens: PositiveInt = 24
    """longest response, as in ppo.py"""
    temperature: PositiveFloat = 1.0
    """sampling temperature, as in ppo.py"""
    batch_size: PositiveInt = 64
    """prompts per generation batch"""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """the precision every model is loaded and run in, whatever its checkpoint's: a bf16 PPO actor against an fp32
    SFT model would add the rounding of one to the KL between them"""
    num_samples: CountInt = 5
    """side-by-side samples to print"""
    metrics_file: str | None = None
    """the metrics.jsonl to plot; the one of the run that trained --ppo-model (named in its training_run.json) when
    not set"""
    output_dir: str = "runs"
    """where the figures (evaluation.json) and the pictures (ppo_training.png, overoptimization.png) are written; a
    writable folder that is not, and does not hold, a model or the data set read here"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""


def main(args: Args) -> None:
    """Answer the evaluation prompts with each policy, score them, and write the table and the figures."""
    plumbing.check_ranges(args)  # bad flags stop here, before anything is loaded
    if args.snapshots_dir is None:
        args.snapshots_dir = os.path.join(os.path.dirname(args.ppo_model.rstrip("/")), "snapshots")
    elif not os.path.isdir(args.snapshots_dir):
        plumbing.fail(f"--snapshots-dir {args.snapshots_dir!r} is no folder; name the snapshots/ folder of a ppo.py "
                      "run with --snapshot-every N, or leave the flag out")
    check_evaluation_dir(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        plumbing.keep_freed_memory()  # as every rank of the three stages has it (detail 44)
    snapshots = snapshots_of_run(args)
    models = [(args.sft_model, "check --sft-model"), (args.ppo_model, "check --ppo-model"),
              (args.reward_model, "check --reward-model")] + [(path, "check --snapshots-dir") for path in snapshots]
    for path, hint in models:
        plumbing.check_model_folder(path, hint)
    args.metrics_file = training_metrics_file(args)
    check_not_saved_by_ppo(args.reward_model, "--reward-model")
    plumbing.check_classifier_config(args.reward_model, "--reward-model", args.trust_remote_code)
    plumbing.check_positions(AutoConfig.from_pretrained(args.sft_model, trust_remote_code=args.trust_remote_code),
                             args.max_prompt_len + args.max_new_tokens,
                             f"--max-prompt-len {args.max_prompt_len} + --max-new-tokens {args.max_new_tokens}")

    # The SFT tokenizer pads on the left, so that every prompt ends where its response starts; a reward model with a
    # tokenizer of its own reads each prompt + response as text tokenized again, as in ppo.py.
    tokenizer, reward_tokenizer = plumbing.check_tokens(args.sft_model, "--sft-model", args.reward_model,
                                                        "--reward-model", {}, args.trust_remote_code)
    ppo_tokenizer = plumbing.load_tokenizer(args.ppo_model, "check --ppo-model", args.trust_remote_code)
    if ppo_tokenizer.get_vocab() != tokenizer.get_vocab():
        plumbing.fail(f"{args.ppo_model!r} has another tokenizer than the SFT model {args.sft_model!r}; check "
                      "--ppo-model")
    plumbing.check_vocabulary(tokenizer, args.ppo_model, "check --ppo-model", args.trust_remote_code)
    # The SFT model reads the PPO policy's and the snapshots' ids, the reward model every policy's (in the same tokens).
    readers = {"--sft-model": args.sft_model, **({"--reward-model": args.reward_model} if reward_tokenizer is None
                                                 else {})}
    for path, flag in [(args.ppo_model, "--ppo-model")] + [(path, "--snapshots-dir") for path in snapshots]:
        plumbing.check_embedding_rows(flag, path, readers, args.trust_remote_code)
    prompts = plumbing.load_prompts(tokenizer, args.dataset, args.split, args.prompt_column, args.max_prompt_len, True,
                                    args.assistant_marker if args.split_conversations else None)

    sft = load_model(AutoModelForCausalLM, args.sft_model, "check --sft-model", args, device)
    ppo = load_model(AutoModelForCausalLM, args.ppo_model, "check --ppo-model", args, device)
    reward = load_model(AutoModelForSequenceClassification, args.reward_model, "check --reward-model", args, device)
    check_score_head(reward, args.reward_model, "--reward-model")
    reward_mean, reward_std = score_normalization(reward.config)

    # ppo.py's sampling settings. The models' own generation_config.json is replaced, so that nothing in it (a
    # repetition penalty, min_new_tokens) changes what is sampled.
    generation_config = sampling_config(tokenizer, args.max_new_tokens, args.temperature)
    sft.generation_config = ppo.generation_config = generation_config
    judged = (tokenizer, reward_tokenizer, prompts, generation_config, args, reward_mean, reward_std, device)
    results = {"sft": answer(sft, sft, reward, *judged)}
    print(f"SFT answered {len(prompts)} prompts")
    results["ppo"] = answer(ppo, sft, reward, *judged)
    print(f"PPO answered {len(prompts)} prompts")
    summary = {"prompts": len(prompts), "sft": summarize(results["sft"], None, args.gold_judge),
               "ppo": summarize(results["ppo"], results["sft"], args.gold_judge), "args": asdict(args)}
    summary["length_change"] = summary["ppo"]["mean_length"] / summary["sft"]["mean_length"] - 1

    sft_summary, ppo_summary = summary["sft"], summary["ppo"]
    rows = [("mean reward-model score (normalized)", "mean_score", "{:+.3f}"),
            ("win rate of PPO over SFT, by the reward model", "win_rate", "{:.3f}")]
    if args.gold_judge:
        rows += [("mean gold score (responses that parse)", "mean_gold_score", "{:+.3f}"),
                 ("win rate of PPO over SFT, by the gold rule", "gold_win_rate", "{:.3f}"),
                 ("parse rate", "parse_rate", "{:.3f}"),
                 ("Spearman correlation of reward model and gold rule", "spearman_score_gold", "{:.3f}")]
    rows += [("mean KL to the SFT policy (per response)", "mean_kl_to_sft", "{:.2f}"),
             ("mean length (tokens, EOS included)", "mean_length", "{:.1f}")]
    plumbing.print_table(f"{len(prompts)} held-out prompts of {args.dataset!r} ({args.split})",
                         ["", "SFT policy", "PPO policy"],
                         [[name, form.format(sft_summary[key]) if key in sft_summary else "",
                           form.format(ppo_summary[key])] for name, key, form in rows])

    def label(result, i):
        gold = result["gold"][i]
        if not args.gold_judge:
            return f"{result['responses'][i]}  [{result['scores'][i]:+.2f}]"
        return f"{result['responses'][i]}  [{result['scores'][i]:+.2f} | {'no parse' if gold is None else f'{gold:+.2f}'}]"

    plumbing.print_table("samples [reward-model score | gold score]" if args.gold_judge else
                         "samples [reward-model score]", ["prompt", "SFT", "PPO"],
                         [[tokenizer.decode(prompts[i], skip_special_tokens=True), label(results["sft"], i),
                           label(results["ppo"], i)] for i in range(min(args.num_samples, len(prompts)))])

    # The figures are saved before any picture is drawn, so that a failure in plotting never loses them.
    evaluation_file = os.path.join(args.output_dir, "evaluation.json")
    plumbing.write_json(evaluation_file, summary)
    print(f"wrote {evaluation_file}")
    if args.metrics_file is not None:
        plot_training(args.metrics_file, os.path.join(args.output_dir, "ppo_training.png"))

    # The over-optimisation picture: every snapshot answers the first snapshot_prompts prompts, against the SFT policy.
    if snapshots and args.gold_judge:
        few = prompts[: args.snapshot_prompts]
        judged_few = (tokenizer, reward_tokenizer, few, generation_config, args, reward_mean, reward_std, device)
        sft_few = answer(sft, sft, reward, *judged_few)
        points = [{"label": "SFT", **summarize(sft_few, sft_few, gold_judge=True)}]
        for path in snapshots:
            policy = load_model(AutoModelForCausalLM, path, "check --snapshots-dir", args, device)
            policy.generation_config = generation_config
            result = answer(policy, sft, reward, *judged_few)
            points.append({"label": os.path.basename(path).replace("iteration_", "it "),
                           **summarize(result, sft_few, gold_judge=True)})
            print(f"{points[-1]['label']}: KL {points[-1]['mean_kl_to_sft']:.2f}, reward model "
                  f"{points[-1]['mean_score']:+.2f}, gold {points[-1]['mean_gold_score']:+.2f}, gold win rate "
                  f"{points[-1]['gold_win_rate']:.3f}")
        summary["overoptimization"] = points
        plumbing.write_json(evaluation_file, summary)
        print(f"wrote {evaluation_file}, with the snapshots' figures")
        picture = os.path.join(args.output_dir, "overoptimization.png")
        plot_overoptimization(points, picture)
        print(f"wrote {picture} ({len(snapshots)} snapshots from {args.snapshots_dir})")
    elif args.gold_judge:
        print(f"no snapshots in {args.snapshots_dir}: run ppo.py with --snapshot-every N for the over-optimisation "
              "picture")


OUTPUTS = ["evaluation.json", "ppo_training.png", "overoptimization.png"]  # what an evaluation writes in --output-dir

def check_evaluation_dir(args: Args) -> None:
    """OUTPUT_DIR must not be, hold or sit inside an input (plumbing.check_output_dir), and must be writable, and its
    files (OUTPUTS, each written whole, never through a link: plumbing.write_whole) are neither links nor folders:
    checked before any model loads, so that an evaluation never runs to the end to find that it cannot be saved."""
    plumbing.check_output_dir(args.output_dir, {f"--{name.replace('_', '-')}": getattr(args, name) for name in (
        "sft_model", "ppo_model", "reward_model", "dataset", "snapshots_dir")})
    for path in [os.path.join(args.output_dir, name) for name in OUTPUTS]:
        if os.path.islink(path) or os.path.isdir(path):
            kind = "link" if os.path.islink(path) else "folder"
            plumbing.fail(f"{path!r}, where the evaluation writes, is a {kind}; move it away, or name another "
                          "--output-dir")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=args.output_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        plumbing.fail(f"cannot write to --output-dir {args.output_dir!r} ({error.strerror}); name a folder you can "
                      "write")


def training_metrics_file(args: Args) -> str | None:
    """The metrics.jsonl to plot: --metrics-file, or that of the run that --ppo-model's training_run.json names (ppo.py
    writes it into every actor folder it saves): runs/RUN_NAME/metrics.jsonl in the working folder, where the run
    logs, else the one the record names. None, with a line that says why, when there is none: the evaluation goes on
    without the training picture."""
    if args.metrics_file is not None:
        if not os.path.isfile(args.metrics_file):
            plumbing.fail(f"no metrics file at {args.metrics_file!r}; check --metrics-file")
        return args.metrics_file
    record = plumbing.read_record(args.ppo_model)
    if record is None:
        print(f"no training picture: {args.ppo_model!r} has no {plumbing.RECORD} that names the run that trained it "
              "(set --metrics-file)")
        return None
    run_name = record.get("run_name", "")
    here = os.path.abspath(os.path.join("runs", run_name, "metrics.jsonl"))  # the project moved or copied
    if plumbing.RUN_NAME.fullmatch(run_name) and os.path.isfile(here):
        return here
    metrics_file = plumbing.run_metrics_file(record)  # None unless runs/RUN_NAME/metrics.jsonl of the record's run
    if metrics_file is None or not os.path.isfile(metrics_file):
        why = "is no runs/RUN_NAME/metrics.jsonl of its run" if metrics_file is None else "does not exist"
        print(f"no training picture: the metrics file {record.get('metrics_file')!r} named in "
              f"{os.path.join(args.ppo_model, plumbing.RECORD)} {why} (set --metrics-file)")
        return None
    return metrics_file


def snapshots_of_run(args: Args) -> list[str]:
    """The snapshots in --snapshots-dir (iteration_N folders; iteration_N.tmp is a save cut short), oldest first, that
    the run which trained --ppo-model saved (their records' run_name): another run's are left out, said."""
    folder = args.snapshots_dir
    names = os.listdir(folder) if os.path.isdir(folder) else []
    snapshots = sorted(filter(None, (plumbing.own_path(folder, name, plumbing.ITERATION_FOLDER, is_dir=True)
                                     for name in names)), key=lambda path: int(path.rsplit("_", 1)[1]))
    run_name = (plumbing.read_record(args.ppo_model) or {}).get("run_name")
    if run_name is None:
        if snapshots:
            print(f"--ppo-model {args.ppo_model!r} names no run (no {plumbing.RECORD}): the snapshots in {folder} are "
                  "taken as its run's")
        return snapshots
    others = [path for path in snapshots if (plumbing.read_record(path) or {}).get("run_name") != run_name]
    if others:
        print(f"left out {len(others)} snapshots in {folder} that another run saved than --ppo-model's ({run_name}): "
              f"{', '.join(os.path.basename(path) for path in others[:3])}")
    return [path for path in snapshots if path not in others]


def load_model(model_class, path: str, hint: str, args: Args, device: torch.device):
    """A checked model folder (check_model_folder), loaded in --dtype with every weight used and finite, in eval mode
    (dropout off)."""
    model = plumbing.load_pretrained(model_class, path, hint, trust_remote_code=args.trust_remote_code,
                                     dtype=plumbing.TORCH_DTYPES[args.dtype])
    plumbing.check_finite_weights(model, f"model {path!r}")
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
def answer(policy, sft, reward, tokenizer, reward_tokenizer, prompts: list[list[int]], generation_config,
           args: Args, reward_mean: float, reward_std: float, device) -> dict[str, list]:
    """Sample one response per prompt from `policy` as ppo.py does, and measure it: the normalized reward-model score,
    the gold score (None where the text does not parse), the length in tokens (EOS included), and the KL to the SFT
    policy (the sum over the response of log pi - log pi_sft, the k1 estimate: objective/kl's at ppo.py's default
    --kl-estimator). reward_tokenizer: the reward model's, when it is another than the policies' (else None)."""
    result = {"responses": [], "scores": [], "gold": [], "lengths": [], "kl": []}
    for start in range(0, len(prompts), args.batch_size):
        padded = tokenizer.pad({"input_ids": prompts[start : start + args.batch_size]}, return_tensors="pt")
        prompt_ids, prompt_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device)
        P = prompt_ids.shape[1]
        torch.manual_seed(args.seed + start)  # the same random stream for every policy
        with plumbing.stop_on(ValueError):  # sample's refusal (logits not finite), as evaluate.py's one line
            responses = sample(policy, prompt_ids, prompt_mask, generation_config, synced=False)
        # Truncate after the first EOS, as ppo.py does.
        response_mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
        responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
        sequences = torch.cat([prompt_ids, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        result["scores"] += reward_scores(reward, sequences, attention_mask, P, reward_mean, reward_std, tokenizer,
                                          reward_tokenizer).tolist()  # in the reward model's own tokens
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


METRICS_KEYS = ("iteration", "episode", "objective/scores", "objective/rlhf_reward", "objective/kl")


def read_metrics(metrics_file: str) -> list[dict]:
    """The rows of ppo.py's metrics.jsonl that plot_training needs, one per iteration in order. A line that is not a
    JSON object with those keys is skipped and counted (a run killed mid-write leaves a partial last line); where an
    iteration repeats (an older run resumed from a checkpoint), its last row is kept."""
    by_iteration, skipped = {}, 0
    with open(metrics_file, errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict) and all(isinstance(row.get(key), (int, float)) for key in METRICS_KEYS):
                by_iteration[row["iteration"]] = row
            elif line.strip():
                skipped += 1
    if skipped:
        print(f"skipped {skipped} lines of {metrics_file} that are not whole metrics rows")
    return [by_iteration[iteration] for iteration in sorted(by_iteration)]


def save_figure(fig, path: str) -> None:
    """The picture as a PNG file written whole, never through a link or a hard link (plumbing.write_whole), or one line
    (evaluation.json, written before any picture, is whole)."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plumbing.write_whole(path, png.getvalue())


def plot_training(metrics_file: str, path: str) -> None:
    """Reward (score and score minus KL penalty) and KL per episode, read from ppo.py's metrics.jsonl, under the run's
    name (the folder ppo.py writes it in: runs/RUN_NAME/metrics.jsonl)."""
    rows = read_metrics(metrics_file)
    if not rows:
        print(f"no training picture: {metrics_file} holds no metrics rows")
        return
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    episodes = [row["episode"] for row in rows]
    fig, (reward_axis, kl_axis) = plt.subplots(1, 2, figsize=(10, 4))
    reward_axis.plot(episodes, [row["objective/scores"] for row in rows], label="objective/scores")
    reward_axis.plot(episodes, [row["objective/rlhf_reward"] for row in rows], label="objective/rlhf_reward")
    reward_axis.set(xlabel="episode", ylabel="reward", title="reward model score (normalized)")
    reward_axis.legend()
    kl_axis.plot(episodes, [row["objective/kl"] for row in rows])
    kl_axis.set(xlabel="episode", ylabel="KL(pi || pi_ref) per response", title="objective/kl")
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(metrics_file))))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    print(f"wrote {path} (from {metrics_file})")


def plot_overoptimization(points: list[dict], path: str) -> None:
    """Proxy against truth along training, one point for the SFT policy and one per snapshot, against the KL to the
    SFT policy (Gao et al. 2022): the win rates over SFT by the reward model and by the gold rule, and the parse rate,
    each point of the gold rule's labelled (label_points); the mean scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = [p["mean_kl_to_sft"] for p in points]
    fig, (rate_axis, score_axis) = plt.subplots(1, 2, figsize=(11, 4))
    rate_axis.plot(kl, [p["win_rate"] for p in points], "o-", label="win rate by the reward model (the proxy)")
    rate_axis.plot(kl, [p["gold_win_rate"] for p in points], "s-", label="win rate by the gold rule (the truth)")
    rate_axis.plot(kl, [p["parse_rate"] for p in points], "^--", label="parse rate (gold judge)")
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
    label_points(rate_axis, [(p["mean_kl_to_sft"], p["gold_win_rate"]) for p in points], [p["label"] for p in points])
    save_figure(fig, path)
    plt.close(fig)


def label_points(axis, points: list[tuple[float, float]], labels: list[str]) -> None:
    """Each point's label (points in data coordinates, the figure laid out) beside it or, where it would cover a label
    placed before it or a marker of the axis' lines, as near as it is free above or below, in steps of more than a
    label's height (and a marker's), with a thin line back to its point. Each of those n things blocks at most 2 of the
    2n + 1 places tried, so one is always free: labels never overlap, however close the points lie. Inside the axes
    where a free place is."""
    from matplotlib.transforms import Bbox

    figure = axis.figure
    figure.canvas.draw()  # the final limits and layout: where each point lands on the canvas
    renderer, pixels_per_point = figure.canvas.get_renderer(), figure.dpi / 72
    frame, placed = axis.get_window_extent(renderer), []
    markers = [Bbox.from_bounds(x - r, y - r, 2 * r, 2 * r) for line in axis.get_lines() if line.get_marker() != "None"
               for r in [line.get_markersize() * pixels_per_point / 2]
               for x, y in axis.transData.transform(line.get_xydata())]
    for (x, y), label in zip(points, labels):
        left = axis.transData.transform((x, y))[0] > frame.x0 + 0.7 * frame.width  # near the right edge: to the left
        text = axis.annotate(label, (x, y), xytext=(-6 if left else 6, 0), textcoords="offset points", fontsize=7,
                             ha="right" if left else "left", va="center")
        height = max([text.get_window_extent(renderer).height] + [box.height for box in markers])
        step = (height + 2) / pixels_per_point  # in points
        obstacles, boxes = placed + markers, {}
        for k in sorted(range(-len(obstacles), len(obstacles) + 1), key=lambda k: (abs(k), k < 0)):  # 0, 1, -1, ...
            text.xyann = (text.xyann[0], k * step)
            boxes[k] = text.get_window_extent(renderer)
        free = [k for k, box in boxes.items() if not any(box.overlaps(other) for other in obstacles)]
        inside = [k for k in free if frame.contains(*boxes[k].p0) and frame.contains(*boxes[k].p1)]
        k = (inside or free)[0]
        text.xyann = (text.xyann[0], k * step)
        if k:
            axis.annotate("", (x, y), xytext=text.xyann, textcoords="offset points",
                          arrowprops={"arrowstyle": "-", "color": "gray", "linewidth": 0.5})
        placed.append(boxes[k])


if __name__ == "__main__":
    main(tyro.cli(Args))
