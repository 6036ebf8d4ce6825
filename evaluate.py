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

import difflib
import glob
import json
import math
import os
from dataclasses import asdict, dataclass, fields

import datasets
import safetensors
import torch
import tyro
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import rlhf_math
from ppo import response_logprobs, reward_model_inputs, reward_scores, sampling_config
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
    """the column that holds the prompt: text, or a list of {"role", "content"} chat messages (the
    tokenizer's chat template makes it a prompt)"""
    split_conversations: bool = False
    """the hh-rlhf layout: each cell of --prompt-column (pass --prompt-column chosen) holds the whole conversation, and the prompt is its text up to and including the
    last --assistant-marker"""
    assistant_marker: str = "\n\nAssistant:"
    """where the last assistant turn opens in a whole conversation (--split-conversations)"""
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
    """the metrics.jsonl to plot; the one of the run that trained --ppo-model (named in its training_run.json) when
    not set"""
    output_dir: str = "runs"
    """where the figures (evaluation.json) and the pictures (ppo_training.png, overoptimization.png) are written; a
    writable folder that is not, and does not hold, a model or the data set read here"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""


def fail(message: str) -> None:
    """Stop with a one-line message that says what to fix."""
    raise SystemExit(f"evaluate.py: error: {message}")


# ---------------------------------------------------------------------------------------------------------------
# Inputs: the same checks as the training stages, so that a wrong flag or damaged file stops with one line that says
# what to fix. Copied from sft.py on purpose (each stage reads on its own); check_finite_weights is the plain version,
# without deepspeed.
# ---------------------------------------------------------------------------------------------------------------
def is_hub_name(path: str) -> bool:
    """True for `name` or `org/name` that is not a path here: from_pretrained looks it up on the Hugging Face hub.
    Local-looking paths never go there: the stages' own outputs (checkpoints/...), even before the stage that writes
    them has run, and a path whose first folder is a near miss of one here (chekpoints/sft), which is a typo."""
    first = path.split("/")[0]
    here = [name for name in os.listdir(".") if os.path.isdir(name)] + ["checkpoints"]
    return not (os.path.exists(path) or path.startswith(("/", ".", "~", "checkpoints/")) or path.count("/") > 1
                or os.path.isdir(first) or difflib.get_close_matches(first, here, n=1, cutoff=0.8))


def check_model_folder(path: str, hint: str) -> None:
    """A local model folder must hold a config and safetensors weights: pickle files (pytorch_model.bin) are never
    loaded, since unpickling a file runs any code it holds. Checked before anything is loaded."""
    if is_hub_name(path):
        return  # from_pretrained(use_safetensors=True) downloads only safetensors weights
    if not os.path.isdir(path):
        fail(f"no model folder at {path!r}; {hint}")
    files = os.listdir(path)
    if "config.json" not in files:
        fail(f"{path!r} holds no model (no config.json); {hint}")
    try:
        with open(os.path.join(path, "config.json")) as f:
            json.load(f)
    except (OSError, ValueError) as error:
        fail(f"{path!r} has a damaged config.json ({error}); {hint}")
    if not any(f.endswith(".safetensors") for f in files):
        if any(f.endswith(".bin") for f in files):
            fail(f"{path!r} has no model.safetensors; only safetensors weights are loaded (no pickle): if you trust "
                 "the file, convert it once with from_pretrained(path, use_safetensors=False).save_pretrained(path)")
        fail(f"{path!r} has no model weights (model.safetensors); {hint}")


def load_pretrained(model_class, path: str, hint: str, new_head: bool = False, **kwargs):
    """model_class.from_pretrained(path) in safetensors, or a one-line error: a damaged weights file, or a weight that
    the checkpoint lacks or that the model leaves unused (a head saved under another name would start random).
    new_head: the model's head starts fresh from a checkpoint of another head (a sequence classifier from a causal LM):
    the weights outside the shared backbone (transformers' base_model_prefix), and only those, may be missing from the
    checkpoint or left unused in it."""
    try:
        model, info = model_class.from_pretrained(path, use_safetensors=True, output_loading_info=True, **kwargs)
    except (OSError, ValueError, safetensors.SafetensorError) as error:
        fail(f"cannot load the model in {path!r} ({' '.join(str(error).split())[:300]}); {hint}")
    checked = f"{model.base_model_prefix}." if new_head else ""  # the names that must match: all, or the backbone's
    missing = sorted(name for name in info["missing_keys"] if name.startswith(checked))
    unexpected = sorted(name for name in info["unexpected_keys"] if name.startswith(checked))
    if missing or unexpected:
        fail(f"{path!r} does not fit {model_class.__name__}: weights missing from it {missing[:4]}, weights in it "
             f"that the model does not use {unexpected[:4]} ({len(missing)} and {len(unexpected)} in all); {hint}")
    return model


def check_finite_weights(model, name: str) -> None:
    """Stop if a weight is inf or NaN (a damaged checkpoint), instead of failing later inside sampling."""
    bad = [param_name for param_name, param in model.named_parameters() if not torch.isfinite(param).all()]
    if bad:
        fail(f"the {name} has weights that are not finite (inf or nan) in {len(bad)} tensors ({', '.join(bad[:3])}); "
             "its checkpoint is damaged: train it again")


def load_tokenizer(path: str, hint: str, trust_remote_code: bool):
    """AutoTokenizer.from_pretrained, or a one-line error that says what to fix."""
    if not is_hub_name(path) and not os.path.isdir(path):
        fail(f"no tokenizer folder at {path!r}; {hint}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        fail(f"cannot load a tokenizer from {path!r} ({' '.join(str(error).split())}); {hint}")


def load_split(dataset: str, split: str, columns: list[str], flag: str = "--dataset", config: str | None = None,
               extensions: tuple = (".json", ".jsonl", ".parquet")) -> datasets.Dataset:
    """One split of a hub data set (config: its configuration name, if it has several) or of a local file or folder,
    checked for the columns we need; a one-line error that names the flag to fix otherwise."""
    kinds = f"{', '.join(extensions[:-1])} or {extensions[-1]}"
    if not os.path.exists(dataset) and not is_hub_name(dataset):
        fail(f"no data set at {dataset!r}; check {flag}")
    if os.path.isfile(dataset) and not dataset.endswith(extensions):
        fail(f"{flag} {dataset!r} is not a {kinds} file")
    if os.path.isfile(dataset) and os.path.getsize(dataset) == 0:
        fail(f"{flag} {dataset!r} is an empty file")
    try:
        if os.path.isfile(dataset):  # one file is every split; a slice such as train[:64] still applies
            kind = {".txt": "text", ".parquet": "parquet"}.get(os.path.splitext(dataset)[1], "json")
            data = datasets.load_dataset(kind, data_files={split.split("[")[0]: dataset}, split=split)
        else:
            data = datasets.load_dataset(dataset, config, split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as error:
        error = error.__cause__ or error  # the generation error's cause says which row is malformed
        if os.path.isfile(dataset) and dataset.endswith(".jsonl"):  # name the line, which datasets does not
            with open(dataset, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    try:
                        json.loads(line) if line.strip() else None
                    except ValueError as bad:
                        fail(f"line {number} of {dataset!r} is not valid JSON ({bad}); fix or remove it")
        fail(f"cannot load split {split!r} of data set {dataset!r} ({' '.join(str(error).split())[:300]}); check "
             f"{flag} (a UTF-8 {kinds} file) and the split flags")
    missing = [c for c in columns if c not in data.column_names]
    if missing:
        hh_rlhf = {"chosen", "rejected"} <= set(data.column_names)
        fail(f"data set {dataset!r} split {split!r} has no column {missing}; its columns are {data.column_names}"
             + ("; if 'chosen' and 'rejected' each hold the whole conversation (the hh-rlhf layout), pass "
                "--split-conversations (ppo.py and evaluate.py also --prompt-column chosen)" if hh_rlhf else ""))
    try:  # pyarrow loads bytes that are not UTF-8 into a text column: reading that row would fail with a traceback
        data.select_columns(columns).data.validate(full=True)
    except ValueError as error:
        fail(f"data set {dataset!r} split {split!r} is not UTF-8 text ({error}); save it as UTF-8")
    return data


def text_of(row: dict, i: int, column: str, split: str) -> str:
    """The text in one cell of the data, or an error that names the row, the column and what is wrong with it."""
    value = row[column]
    problem = ("empty (null)" if value is None else f"a value of type {type(value).__name__}, not text"
               if not isinstance(value, str) else "empty text" if not value.strip() else None)
    if problem:
        fail(f"row {i} of split {split!r}, column {column!r}: {problem}; fix or remove the row")
    return value


def split_conversation(text: str, assistant_marker: str, where: str) -> tuple[str, str]:
    """A whole conversation (the hh-rlhf layout, "\n\nHuman: ...\n\nAssistant: ...") -> (prompt, response): the
    prompt up to and including its last assistant marker, the response after it."""
    cut = text.rfind(assistant_marker)
    if cut < 0:
        fail(f"{where}: no {assistant_marker!r} to split the conversation at; check --assistant-marker")
    prompt, response = text[: cut + len(assistant_marker)], text[cut + len(assistant_marker) :]
    if not response.strip():
        fail(f"{where}: nothing after the last {assistant_marker!r}; fix or remove the row")
    return prompt, response


def prompt_ids(tokenizer, row: dict, i: int, column: str, split: str, assistant_marker: str | None = None) -> list:
    """The token ids of one row's prompt. Text is tokenized as it is (split_special_tokens: text that spells a special
    token, "<|endoftext|>", stays text, never a real EOS); with assistant_marker the text is a whole conversation
    whose prompt ends at its last marker (split_conversation). A list of {"role", "content"} messages goes through
    the tokenizer's chat template, up to the opening of the assistant's turn."""
    value, where = row[column], f"row {i} of split {split!r}, column {column!r}"
    if not isinstance(value, list):
        text = text_of(row, i, column, split)
        if assistant_marker is not None:
            text = split_conversation(text, assistant_marker, where)[0]
        return tokenizer(text, split_special_tokens=True)["input_ids"]
    if tokenizer.chat_template is None:
        fail(f"{where} holds chat messages, but the tokenizer has no chat template; use a tokenizer that has one (an "
             "instruct or chat model's) or give the prompts as text")
    if not value or not all(isinstance(message, dict) and isinstance(message.get("role"), str)
                            and isinstance(message.get("content"), str) for message in value):
        fail(f"{where}: not a list of {{'role': ..., 'content': ...}} messages with text content; fix or remove the row")
    # The template's text is tokenized with its markers as real tokens: a message that spells one would fake a turn.
    spelled = [token for token in tokenizer.get_added_vocab() if any(token in m["content"] for m in value)]
    if spelled:
        fail(f"{where}: a message spells the token {spelled[0]!r}, which the chat template would read as the real "
             "one; fix or remove the row")
    text = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_prompts(tokenizer, dataset: str, split: str, column: str, max_prompt_len: int, is_main: bool,
                 assistant_marker: str | None = None) -> list:
    """The token ids (prompt_ids) of every prompt of a split that fits max_prompt_len: a longer prompt is dropped,
    never truncated, and the dropped ones are counted (on rank 0)."""
    data = load_split(dataset, split, [column])
    prompts, too_long = [], 0
    for i, row in enumerate(data):
        ids = prompt_ids(tokenizer, row, i, column, split, assistant_marker)
        if len(ids) > max_prompt_len:
            too_long += 1
        else:
            prompts.append(ids)
    if too_long and is_main:
        print(f"dropped {too_long} of {len(data)} prompts longer than --max-prompt-len {max_prompt_len}")
    if not prompts:
        fail(f"no prompt of split {split!r} fits --max-prompt-len {max_prompt_len}; raise it")
    return prompts


RECORD = "training_run.json"  # in every folder a stage writes: the script, run name and arguments that wrote it


def read_record(folder: str) -> dict | None:
    """The training_run.json of a folder, or None if it has none that reads."""
    try:
        with open(os.path.join(folder, RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_json(path: str, value) -> None:
    """Write a JSON file whole or not at all: a temporary file, flushed to disk, renamed into place."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def check_finite_args(args) -> None:
    """Every float flag must be a number: inf or nan slip through `> 0` checks."""
    for field in fields(args):
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{field.name.replace('_', '-')} must be a finite number, not {value}")



def check_args(args: Args) -> None:
    """Bad flags stop the script here, with a message that names them, before anything is loaded."""
    check_finite_args(args)
    for name in ("batch_size", "max_new_tokens", "max_prompt_len", "snapshot_prompts"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.num_samples < 0:
        fail(f"--num-samples must not be negative, not {args.num_samples}")
    if not args.temperature > 0:
        fail(f"--temperature must be positive, not {args.temperature}")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed must be between 0 and 2**32 - 1, not {args.seed}")


def check_output_dir(args: Args) -> None:
    """OUTPUT_DIR must not be, nor hold, an input (evaluation.json written into a data folder would be read as data
    next time), and must be writable: checked before any model loads, so that an evaluation never runs to the end to
    find that it cannot be saved."""
    real = os.path.realpath(args.output_dir)
    for name in ("sft_model", "ppo_model", "reward_model", "dataset"):
        path = getattr(args, name)
        if os.path.exists(path) and (os.path.realpath(path) + os.sep).startswith(real + os.sep):
            fail(f"--output-dir {args.output_dir!r} is or holds --{name.replace('_', '-')} {path!r}, which this run "
                 "reads; name another folder")
    probe = os.path.join(args.output_dir, f".probe_{os.getpid()}")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        fail(f"cannot write to --output-dir {args.output_dir!r} ({error.strerror}); name a folder you can write")


def training_metrics_file(args: Args) -> str | None:
    """The metrics.jsonl to plot: --metrics-file, or the one that --ppo-model's training_run.json names (ppo.py
    writes it into every actor folder it saves). None, with a line that says why, when there is none: the evaluation
    goes on without the training picture."""
    if args.metrics_file is not None:
        if not os.path.isfile(args.metrics_file):
            fail(f"no metrics file at {args.metrics_file!r}; check --metrics-file")
        return args.metrics_file
    record = read_record(args.ppo_model)
    if record is None:
        print(f"no training picture: {args.ppo_model!r} has no {RECORD} that names the run that trained it (set "
              "--metrics-file)")
        return None
    metrics_file = record.get("metrics_file")
    if not isinstance(metrics_file, str) or not os.path.isfile(metrics_file):
        print(f"no training picture: the metrics file {metrics_file!r} named in {os.path.join(args.ppo_model, RECORD)} "
              "does not exist (set --metrics-file)")
        return None
    return metrics_file


def load_model(model_class, path: str, hint: str, args: Args, device: torch.device):
    """A checked model folder (check_model_folder), loaded with every weight used and finite, in eval mode (dropout
    off)."""
    model = load_pretrained(model_class, path, hint, trust_remote_code=args.trust_remote_code)
    check_finite_weights(model, f"model {path!r}")
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
    policy (the sum over the response of log pi - log pi_sft, the k1 estimate behind objective/kl). reward_tokenizer:
    the reward model's, when it is another than the policies' (else None)."""
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
        scored = reward_model_inputs(sequences, attention_mask, P, tokenizer, reward_tokenizer)  # its own tokens
        result["scores"] += reward_scores(reward, *scored, reward_mean, reward_std).tolist()
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


def plot_training(metrics_file: str, path: str) -> None:
    """Reward (score and score minus KL penalty) and KL per episode, read from ppo.py's metrics.jsonl."""
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
    fig.suptitle(os.path.dirname(metrics_file))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path} (from {metrics_file})")


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
    check_args(args)
    check_output_dir(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.snapshots_dir is None:
        args.snapshots_dir = os.path.join(os.path.dirname(args.ppo_model.rstrip("/")), "snapshots")
    # iteration_N only: a save cut short leaves iteration_N.tmp.
    snapshots = sorted([path for path in glob.glob(os.path.join(args.snapshots_dir, "iteration_*"))
                        if path.rsplit("_", 1)[1].isdigit()], key=lambda path: int(path.rsplit("_", 1)[1]))
    models = [(args.sft_model, "check --sft-model"), (args.ppo_model, "check --ppo-model"),
              (args.reward_model, "check --reward-model")] + [(path, "check --snapshots-dir") for path in snapshots]
    for path, hint in models:
        check_model_folder(path, hint)
    args.metrics_file = training_metrics_file(args)

    # The SFT tokenizer pads on the left, so that every prompt ends where its response starts.
    tokenizer = load_tokenizer(args.sft_model, "check --sft-model", args.trust_remote_code)
    tokenizer.padding_side = "left"
    if load_tokenizer(args.ppo_model, "check --ppo-model", args.trust_remote_code).get_vocab() != tokenizer.get_vocab():
        fail(f"{args.ppo_model!r} has another tokenizer than the SFT model {args.sft_model!r}; check --ppo-model")
    # A reward model with a tokenizer of its own reads each prompt + response as text tokenized again, as in ppo.py.
    reward_tokenizer = load_tokenizer(args.reward_model, "check --reward-model", args.trust_remote_code)
    if reward_tokenizer.get_vocab() == tokenizer.get_vocab():
        reward_tokenizer = None
    prompts = load_prompts(tokenizer, args.dataset, args.split, args.prompt_column, args.max_prompt_len, True,
                           args.assistant_marker if args.split_conversations else None)

    sft = load_model(AutoModelForCausalLM, args.sft_model, "check --sft-model", args, device)
    ppo = load_model(AutoModelForCausalLM, args.ppo_model, "check --ppo-model", args, device)
    reward = load_model(AutoModelForSequenceClassification, args.reward_model, "check --reward-model", args, device)
    reward_mean = getattr(reward.config, "reward_mean", 0.0)
    reward_std = getattr(reward.config, "reward_std", 1.0)

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

    # The figures are saved before any picture is drawn, so that a failure in plotting never loses them.
    evaluation_file = os.path.join(args.output_dir, "evaluation.json")
    write_json(evaluation_file, summary)
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
        write_json(evaluation_file, summary)
        print(f"wrote {evaluation_file}, with the snapshots' figures")
        picture = os.path.join(args.output_dir, "overoptimization.png")
        plot_overoptimization(points, picture)
        print(f"wrote {picture} ({len(snapshots)} snapshots from {args.snapshots_dir})")
    elif args.gold_judge:
        print(f"no snapshots in {args.snapshots_dir}: run ppo.py with --snapshot-every N for the over-optimisation "
              "picture")
