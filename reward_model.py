"""Stage 2 of PPO-RLHF: the reward model.

A copy of the SFT model with a scalar head instead of the language-model head learns to score prompt + response so
that the preferred response of each pair scores higher (InstructGPT eq. 1, a Bradley-Terry model of preferences):

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))          (rlhf_math.pairwise_reward_loss)

The score of a sequence is the head's output at its last real token, the EOS that ends the response: the same
place where ppo.py reads it and where its score lands. After training, the policy that PPO starts from (the SFT model)
answers training prompts, and the mean and standard deviation of the scores of its responses are stored in the
checkpoint's config.json as `reward_mean` and `reward_std`; ppo.py and evaluate.py use (score - reward_mean) /
reward_std, which has mean 0 and standard deviation 1 where PPO starts (reward normalization with a gain and a bias,
Ziegler et al. 2019).

    python reward_model.py                                   # the bundled toy task, from checkpoints/sft
    deepspeed --num_gpus 2 reward_model.py --zero-stage 3    # the same, on 2 ranks with ZeRO-3
"""

import atexit
import contextlib
import difflib
import functools
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Literal

import datasets
import deepspeed
import numpy as np
import safetensors
import torch
import torch.distributed as dist
import tyro
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig, get_cosine_schedule_with_warmup)
from transformers.integrations import HfDeepSpeedConfig

import rlhf_math


@dataclass
class Args:
    # Experiment
    exp_name: str = "reward_model"
    """the name of this experiment, the first part of the run name"""
    seed: int = 1
    """seed of the experiment (data order, initialisation of the head)"""
    output_dir: str = "checkpoints/reward_model"
    """where the reward model is saved, as a Hugging Face folder (safetensors + tokenizer); a new or empty folder, or
    one that reward_model.py wrote before"""
    overwrite: bool = False
    """write into a non-empty --output-dir that reward_model.py did not write: files of the same names are replaced,
    nothing else is deleted"""
    track: bool = False
    """log to Weights & Biases (tensorboard logs are always written to runs/)"""
    wandb_project_name: str = "ppo-rlhf"
    """the wandb project, with --track"""
    logging_steps: int = 10
    """print and log the train loss and accuracy every this many optimizer steps"""

    # Model and data
    model_name_or_path: str = "checkpoints/sft"
    """the model the reward model starts from: the SFT checkpoint (stage 1), a hub name or a local folder"""
    tokenizer_name_or_path: str | None = None
    """the tokenizer, if not the model's own"""
    dataset: str = "toy_task/data"
    """a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder"""
    train_split: str = "train"
    """the split to train on"""
    eval_split: str = "test"
    """the held-out split for accuracy"""
    prompt_column: str = "prompt"
    """the column that holds the prompt: text, or a list of {"role", "content"} chat messages (the tokenizer's chat
    template makes it a prompt)"""
    chosen_column: str = "chosen"
    """the column that holds the preferred response"""
    rejected_column: str = "rejected"
    """the column that holds the other response"""
    split_conversations: bool = False
    """the hh-rlhf layout: each of --chosen-column and --rejected-column holds the whole conversation, and the prompt is its text up to and including the
    last --assistant-marker"""
    assistant_marker: str = "\n\nAssistant:"
    """where the last assistant turn opens in a whole conversation (--split-conversations)"""
    max_seq_len: int = 64
    """longest prompt + response + EOS, in tokens; pairs with a longer side are dropped (and counted), never truncated"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""

    # Optimization
    num_train_epochs: int = 1
    """passes over the training pairs"""
    per_device_train_batch_size: int = 16
    """pairs per rank per micro-batch (each pair is two sequences)"""
    per_device_eval_batch_size: int = 32
    """pairs per rank per evaluation batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    learning_rate: float = 4e-4
    """peak learning rate of AdamW (the toy default; real models of 1B parameters want about 1e-5)"""
    warmup_ratio: float = 0.05
    """share of the optimizer steps spent warming the learning rate up, before its cosine decay to 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    gradient_clipping: float = 1.0
    """clip the gradient norm to this"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about a third more compute"""
    disable_dropout: bool = True
    """set every dropout probability to 0 (the RLHF convention; --no-disable-dropout keeps the model's own)"""

    # Reward normalization: the scores of the policy's own responses set reward_mean and reward_std
    normalization_samples: int = 1024
    """responses sampled from the policy for training prompts, after training; their scores' mean and standard
    deviation are stored as reward_mean and reward_std, so that the normalized score has mean 0 and std 1 on them"""
    policy_model_name_or_path: str | None = None
    """the policy that samples them, the one PPO starts from; --model-name-or-path (the SFT model) when not set"""
    max_new_tokens: int = 24
    """longest sampled response: ppo.py's --max-new-tokens"""
    temperature: float = 1.0
    """sampling temperature: ppo.py's --temperature"""

    # DeepSpeed
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 0 plain data parallel, 1 shards optimizer states, 2 also gradients, 3 also parameters"""
    offload: bool = False
    """offload optimizer states (and, at ZeRO-3, parameters) to CPU memory"""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """training precision; fp16 needs a GPU"""
    local_rank: int = -1
    """this process's rank on its node, passed by the deepspeed launcher"""

    # Filled in at runtime
    world_size: int = 0
    """number of ranks"""
    batch_size: int = 0
    """pairs per optimizer step: per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_training_steps: int = 0
    """optimizer steps in the whole run"""


def fail(message: str) -> None:
    """Stop with a one-line message that says what to fix, instead of a stack trace from inside a library."""
    raise SystemExit(f"reward_model.py: error: {message}")


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
    """Stop before training if a weight is inf or NaN (a damaged checkpoint), instead of failing later inside sampling
    or as a NaN loss. Under ZeRO-3 each parameter is gathered in turn (every rank takes part)."""
    bad = []
    for param_name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters(param):  # does nothing to a parameter that is not partitioned
            if not torch.isfinite(param).all():
                bad.append(param_name)
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


def refuse_repeated_prompt(prompt, responses: dict[str, str], i: int, split: str) -> None:
    """Responses that each begin with their prompt's text are the hh-rlhf layout read as if it were not: the prompt
    would be there twice. responses: column -> text."""
    if isinstance(prompt, str) and all(response.startswith(prompt) for response in responses.values()):
        fail(f"row {i} of split {split!r}: {' and '.join(map(repr, responses))} begin with the prompt (the hh-rlhf "
             "layout); pass --split-conversations to cut the prompt from each whole conversation")


def tokenize_pairs(data, tokenizer, args: Args, split: str) -> list[dict]:
    """Each pair as two token-id lists, prompt + chosen + EOS and prompt + rejected + EOS.

    Prompt and response are tokenized separately and their ids concatenated, as sft.py and ppo.py do, so that the
    reward model sees exactly the token sequences that the policy produces.
    """
    examples, too_long = [], 0
    for i, row in enumerate(data):
        chosen, rejected = text_of(row, i, args.chosen_column, split), text_of(row, i, args.rejected_column, split)
        if args.split_conversations:  # both hold the whole conversation; the prompt ends at chosen's last marker
            ids = prompt_ids(tokenizer, row, i, args.chosen_column, split, args.assistant_marker)
            prompt, chosen = split_conversation(chosen, args.assistant_marker, f"row {i} of split {split!r}")
            if not rejected.startswith(prompt):
                fail(f"row {i} of split {split!r}: {args.rejected_column!r} does not begin with the conversation of "
                     f"{args.chosen_column!r} up to its last {args.assistant_marker!r}; fix or remove the row")
            rejected = rejected[len(prompt) :]
        else:
            ids = prompt_ids(tokenizer, row, i, args.prompt_column, split)
            refuse_repeated_prompt(row[args.prompt_column], {args.chosen_column: chosen, args.rejected_column: rejected},
                                   i, split)
        # split_special_tokens: text that spells a special token ("<|endoftext|>") stays text, never a real EOS.
        sides = [ids + tokenizer(response, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                 + [tokenizer.eos_token_id] for response in (chosen, rejected)]
        if max(len(s) for s in sides) > args.max_seq_len:
            too_long += 1
            continue
        examples.append({"prompt": ids, "chosen": sides[0], "rejected": sides[1]})
    if too_long and os.environ.get("RANK", "0") == "0":  # the global rank: every node has a local rank 0
        print(f"dropped {too_long} of {len(data)} pairs of split {split!r} longer than --max-seq-len {args.max_seq_len}")
    if not examples:
        fail(f"no pair of split {split!r} fits --max-seq-len {args.max_seq_len}; raise it")
    return examples


def right_pad(sequences: list[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Token-id lists -> input_ids and attention_mask [len(sequences), longest], padded on the right."""
    length = max(len(s) for s in sequences)
    input_ids = [s + [pad_token_id] * (length - len(s)) for s in sequences]
    attention_mask = [[1] * len(s) + [0] * (length - len(s)) for s in sequences]
    return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


def collate(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """B pairs -> one right-padded batch of 2B sequences: the B chosen first, then the B rejected."""
    return right_pad([e["chosen"] for e in examples] + [e["rejected"] for e in examples], pad_token_id)


def one_openmp_thread_for_new_threads() -> None:
    """On a CPU: every thread started from now on does its tensor work on one OpenMP thread; this one keeps its own.
    The collectives run on gloo's worker threads, and with torch's default each of them starts an OpenMP team of its
    own at its first large tensor copy. The process then has more OpenMP threads than cores, libgomp puts idle threads
    to sleep at once instead of spinning, and every operation of every model waits for its threads to wake up (the
    bundled task under ZeRO-3 on one 2-core rank: 99 s instead of 61 s). torch.set_num_threads sets the calling
    thread's count and the count that a thread takes at its first parallel operation, so it is called from a
    short-lived thread of its own (checked with torch 2.13: test_new_threads_take_one_openmp_thread)."""
    torch.get_num_threads()  # this thread takes its count now, before the default for new threads changes
    setter = threading.Thread(target=torch.set_num_threads, args=(1,))
    setter.start()
    setter.join()


def remove_shared_memory_file() -> None:
    """DeepSpeed's shared-memory all-reduce for the CPU ranks of one node (for its inference engine; unused here) gives
    each rank a 66 MB file in /dev/shm when the process group starts, and never removes it: every run would keep that
    much memory per rank until the machine restarts. Once every rank has joined, each has mapped the others' files, so
    each rank removes its own name, and the memory goes when the last rank exits (the name is the one DeepSpeed
    0.19.8's shm.cpp gives it; a job across nodes or under torchrun makes none)."""
    dist.barrier()  # every rank has mapped every rank's file
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
            f"{os.environ['MASTER_PORT']}_{dist.get_rank()}")
    if os.path.exists(name):
        os.remove(name)


def deepspeed_config(stage: int, trained: bool, offload: bool, args) -> dict:
    """One model's DeepSpeed config. Trained models get gradient accumulation and clipping (their optimizer and
    scheduler are passed to deepspeed.initialize); frozen ones only run forward passes."""
    # ZeRO-3 keeps no small parameter whole on every rank (DeepSpeed-Chat keeps those under 10k elements, norms and
    # biases): each one kept whole costs an all-gather of its own after every optimizer step, while a partitioned one
    # comes in the coalesced all-gather that prefetches its layer's weights.
    # memory_efficient_linear off: otherwise loading a ZeRO-3 model replaces torch.nn.functional.linear, for the
    # whole process and every model in it, with a slower autograd function.
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False}
    if offload and trained:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "zero_optimization": zero,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "steps_per_print": 10**9,
    }
    if trained:
        config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        config["gradient_clipping"] = args.gradient_clipping
    return config


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward r(x, y) of each right-padded sequence: the scalar head at its last real token (the EOS).

    The head is applied at every position ([B, T] scores, one after each prefix) and read at the last one, instead of
    letting Hugging Face pool it, so that this is visibly the same computation as ppo.py's.
    """
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, hidden]
    scores = model.score(hidden).squeeze(-1).float()  # [B, T]
    last = attention_mask.sum(dim=1) - 1  # right padding: the index of the last real token
    return scores[torch.arange(len(scores), device=scores.device), last]


@torch.no_grad()
def evaluate(engine, loader, device) -> dict[str, float]:
    """Held-out accuracy, loss and mean chosen/rejected scores over every rank's share of the split."""
    engine.eval()
    total = torch.zeros(5, device=device)  # [loss x pairs, correct pairs, chosen score sum, rejected score sum, pairs]
    for batch in loader:
        scores = sequence_scores(engine.module, batch["input_ids"].to(device), batch["attention_mask"].to(device))
        chosen, rejected = scores.chunk(2)
        loss, accuracy = rlhf_math.pairwise_reward_loss(chosen, rejected)
        n = len(chosen)
        total += torch.stack([loss * n, accuracy * n, chosen.sum(), rejected.sum(), torch.tensor(float(n))])
    dist.all_reduce(total)
    engine.train()
    n = total[4].item()
    return {"loss": total[0].item() / n, "accuracy": total[1].item() / n,
            "chosen_score": total[2].item() / n, "rejected_score": total[3].item() / n}


# ---------------------------------------------------------------------------------------------------------------
# Output folder, lock and launcher watch: plumbing that keeps a run from destroying a user's files or outliving
# its launcher (docs/implementation_details.md, detail 40). The same functions in every stage.
# ---------------------------------------------------------------------------------------------------------------
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


def fsync_tree(path: str) -> None:
    """Flush a folder's files and the folder entries themselves to disk, so that a rename after this names complete
    files even after a power cut."""
    for root, _, files in os.walk(path):
        for name in files + ["."]:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def claim_output_dir(output_dir: str, inputs: dict[str, str | None], overwrite: bool) -> None:
    """Make OUTPUT_DIR this run's before any model loads, or stop with a message. It must not be, nor hold, an input
    (--output-dir . holds the data); a non-empty folder must hold an earlier output of this script (its
    training_run.json says so) unless --overwrite; it must be writable. OUTPUT_DIR/.lock, holding host and pid, keeps
    a second run out while this one lives; it is removed at exit, and one left by a killed run is taken over."""
    script = os.path.basename(__file__)
    real = os.path.realpath(output_dir)
    for flag, path in inputs.items():
        if path and os.path.exists(path) and (os.path.realpath(path) + os.sep).startswith(real + os.sep):
            fail(f"--output-dir {output_dir!r} is or holds {flag} {path!r}, which this run reads; name another folder")
    ours = (read_record(output_dir) or {}).get("script") == script
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        if not ours:
            fail(f"--output-dir {output_dir!r} is not empty and holds no earlier output of {script}; name a new or "
                 "empty folder, or pass --overwrite to write into it (files of the same names are replaced, nothing "
                 "else is deleted)")
    lock, me = os.path.join(output_dir, ".lock"), f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(lock, "x") as f:
                f.write(me)
            break
        except FileExistsError:
            host, pid = (open(lock).read().split() + ["?", "0"])[:2]
            if host != socket.gethostname() or pid_alive(int(pid) if pid.isdigit() else 0):
                fail(f"--output-dir {output_dir!r} is in use by another run (pid {pid} on {host}); wait for it to end "
                     f"or stop it (if it is gone, delete {lock})")
            os.remove(lock)  # left by a run that was killed
        except OSError as error:
            fail(f"cannot write to --output-dir {output_dir!r} ({error.strerror}); name a folder you can write")
    def release_lock():
        with contextlib.suppress(OSError), open(lock) as f:
            if f.read() == me:
                os.remove(lock)

    atexit.register(release_lock)
    if not ours:
        write_json(os.path.join(output_dir, RECORD), {"script": script, "finished": False})


def make_run_dir(run_name: str) -> str:
    """runs/RUN_NAME, for the tensorboard logs (and ppo.py's metrics.jsonl), made before anything loads."""
    path = os.path.join("runs", run_name)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        fail(f"cannot write the run's logs to {path} ({error.strerror}); run from a folder you can write")
    return path


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return pid > 0


def on_rank_0(function):
    """function() on rank 0 only, its result sent to every rank; if it stops with a message, every rank stops with
    that message (instead of waiting for rank 0 forever)."""
    result = [None, None]
    if dist.get_rank() == 0:
        try:
            result = [function(), None]
        except SystemExit as stop:
            result = [None, str(stop)]
    dist.broadcast_object_list(result, src=0)
    if result[1] is not None:
        raise SystemExit(result[1])
    return result[0]


def stop_on_signals() -> None:
    """Ctrl-C or a scheduler's SIGTERM ends the run with one line, its lock released, instead of a traceback."""
    def stop(signum, frame):
        raise SystemExit(f"{os.path.basename(__file__)}: error: stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def watch_launcher() -> None:
    """Exit within a second or two when the launcher that started this rank dies: a killed `deepspeed` or `torchrun`
    does not take its ranks along, and an orphaned rank would go on training and writing checkpoints. The launcher
    is every ancestor process that runs this same Python (deepspeed's runner and launch.py, torchrun; for a plain
    `python` run from a shell, none); a thread checks each second that each is still there (Linux /proc)."""
    def parent_and_start(pid):  # None once the process is gone, or dead and waiting to be reaped (a zombie)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return None if fields[0] in "ZX" else (int(fields[1]), fields[19])
        except (OSError, IndexError):
            return None

    watched, pid = [], os.getppid()
    while pid > 1 and (process := parent_and_start(pid)) and \
            os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath("/proc/self/exe"):
        watched.append((pid, process[1]))
        pid = process[0]

    def watch():
        while all((parent_and_start(pid) or (None, None))[1] == start for pid, start in watched):
            time.sleep(1)
        print(f"{os.path.basename(__file__)}: error: rank {os.environ.get('RANK')}: the launcher that started this "
              "rank is gone; stopping", file=sys.stderr, flush=True)
        os._exit(1)

    if watched:
        threading.Thread(target=watch, daemon=True).start()


def check_finite_args(args) -> None:
    """Every float flag must be a number: inf or nan slip through `> 0` checks."""
    for field in fields(args):
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{field.name.replace('_', '-')} must be a finite number, not {value}")


def save_model_folder(model, tokenizer, output_dir: str, record: dict, state_dict: dict | None = None) -> None:
    """The model as an ordinary Hugging Face folder: safetensors (state_dict, or the model's own), tokenizer and
    training_run.json. Written in OUTPUT_DIR/.saving, flushed to disk, then moved into place file by file, so that a
    run killed while saving leaves the earlier model whole; weight files of an earlier save that this one does not
    write are removed, so that from_pretrained cannot mix them in. Under ZeRO-3 the caller gathers the weights."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        staging = os.path.join(output_dir, ".saving")
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was cut short
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        write_json(os.path.join(staging, RECORD), record)
        fsync_tree(staging)
        saved = os.listdir(staging)
        for name in os.listdir(output_dir):
            if name.startswith("model") and ".safetensors" in name and name not in saved:
                os.remove(os.path.join(output_dir, name))
        for name in sorted(saved, key=lambda name: name == RECORD):  # the record last: it says the folder is complete
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        os.rmdir(staging)
        fsync_tree(output_dir)
    except OSError as error:  # a full disk, a folder made read-only meanwhile
        fail(f"cannot save the model to {output_dir!r} ({error}); its new files are in {output_dir}/.saving, if any")


def check_args(args: Args) -> None:
    """Bad flags stop the script here, with a message that names them, before anything is loaded."""
    for flag, value in [("--per-device-train-batch-size", args.per_device_train_batch_size),
                        ("--per-device-eval-batch-size", args.per_device_eval_batch_size),
                        ("--gradient-accumulation-steps", args.gradient_accumulation_steps),
                        ("--num-train-epochs", args.num_train_epochs), ("--logging-steps", args.logging_steps),
                        ("--max-seq-len", args.max_seq_len), ("--max-new-tokens", args.max_new_tokens)]:
        if value < 1:
            fail(f"{flag} must be at least 1, not {value}")
    if args.normalization_samples < 2:
        fail(f"--normalization-samples must be at least 2 (a standard deviation needs two), not "
             f"{args.normalization_samples}")
    for flag, value in [("--learning-rate", args.learning_rate), ("--temperature", args.temperature)]:
        if not value > 0:
            fail(f"{flag} must be positive, not {value}")
    if not 0 <= args.warmup_ratio <= 1:
        fail(f"--warmup-ratio must be between 0 and 1, not {args.warmup_ratio}")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed must be between 0 and 2**32 - 1, not {args.seed}")
    if os.path.isfile(args.output_dir):
        fail(f"--output-dir {args.output_dir!r} is a file; name a folder")
    check_finite_args(args)


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    watch_launcher()  # before the set-up: a rank waiting there for a peer must not outlive its launcher either

    # Distributed set-up. deepspeed and torchrun set RANK, LOCAL_RANK and WORLD_SIZE; a plain `python` run is one rank.
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))  # any free port for the one-rank process group
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args.local_rank = int(os.environ["LOCAL_RANK"])
    if args.dtype == "fp16" and get_accelerator().device_name() == "cpu":
        fail("--dtype fp16 needs a GPU: DeepSpeed has no fp16 on CPU; use --dtype bf16 or fp32")
    get_accelerator().set_device(args.local_rank)
    device = torch.device(get_accelerator().device_name(args.local_rank))
    if device.type == "cpu":
        one_openmp_thread_for_new_threads()  # before gloo starts the threads that run the collectives
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    # Leave the process group before Python shuts down: a gloo group still alive at interpreter exit aborts the
    # process now and then ("terminate called without an active exception", exit code -6), a finished run too
    # (torch 2.13). Checked first, since tests run a script several times in one process.
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if device.type == "cpu":
        remove_shared_memory_file()
    args.world_size = dist.get_world_size()
    is_main = dist.get_rank() == 0
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    stop_on_signals()
    # The output folder is checked, locked and claimed before anything loads: a run never trains for an hour to find
    # that it cannot save, nor writes over a folder it does not own.
    on_rank_0(lambda: claim_output_dir(args.output_dir, {
        "--model-name-or-path": args.model_name_or_path, "--tokenizer-name-or-path": args.tokenizer_name_or_path,
        "--policy-model-name-or-path": args.policy_model_name_or_path, "--dataset": args.dataset}, args.overwrite))
    on_rank_0(lambda: make_run_dir(run_name))

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # Tokenizer. Padding must not be EOS: the score is read at the EOS, which must not look like padding.
    model_hint = "train stage 1 first (python sft.py) or check --model-name-or-path"
    check_model_folder(args.model_name_or_path, model_hint)
    if args.policy_model_name_or_path is not None:
        check_model_folder(args.policy_model_name_or_path, "check --policy-model-name-or-path")
    tokenizer_path = args.tokenizer_name_or_path or args.model_name_or_path
    tokenizer = load_tokenizer(tokenizer_path, "check --tokenizer-name-or-path" if args.tokenizer_name_or_path
                               else model_hint, args.trust_remote_code)
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {tokenizer_path!r} has no EOS token; set one, or pick another with --tokenizer-name-or-path")
    added_pad_token = tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id
    if added_pad_token:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        if is_main:
            print(f"the tokenizer had no pad token distinct from EOS: added '<|pad|>' (id {tokenizer.pad_token_id})")

    # Data
    columns = [args.chosen_column, args.rejected_column]
    columns = columns if args.split_conversations else [args.prompt_column, *columns]
    train_data = tokenize_pairs(load_split(args.dataset, args.train_split, columns), tokenizer, args,
                                args.train_split)
    eval_data = tokenize_pairs(load_split(args.dataset, args.eval_split, columns), tokenizer, args,
                               args.eval_split)
    collate_fn = functools.partial(collate, pad_token_id=tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_data, args.per_device_train_batch_size, sampler=train_sampler,
                              collate_fn=collate_fn, drop_last=True)
    # Each rank evaluates every world_size-th example, so that the held-out figures cover the split exactly once.
    eval_loader = DataLoader(eval_data[dist.get_rank() :: args.world_size], args.per_device_eval_batch_size,
                             collate_fn=collate_fn)
    args.batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    steps_per_epoch = len(train_loader) // args.gradient_accumulation_steps
    if steps_per_epoch == 0:
        fail(f"{len(train_data)} training pairs make no optimizer step of {args.batch_size} pairs; lower "
             "--per-device-train-batch-size or --gradient-accumulation-steps")
    args.num_training_steps = steps_per_epoch * args.num_train_epochs

    # Model: the SFT model with a freshly initialised scalar head (num_labels=1), so that the saved reward model loads
    # in any tool that reads Hugging Face reward models. Under ZeRO-3, HfDeepSpeedConfig (kept alive until
    # deepspeed.initialize) makes from_pretrained load the weights already partitioned across ranks.
    ds_config = deepspeed_config(args.zero_stage, True, args.offload, args)
    hf_ds_config = HfDeepSpeedConfig(ds_config) if args.zero_stage == 3 else None  # noqa: F841
    config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code, num_labels=1)
    if args.max_seq_len > getattr(config, "max_position_embeddings", args.max_seq_len):
        fail(f"--max-seq-len {args.max_seq_len} is longer than the model's {config.max_position_embeddings} positions; "
             "lower it")
    if args.max_seq_len + args.max_new_tokens > getattr(config, "max_position_embeddings", float("inf")):
        fail(f"--max-seq-len {args.max_seq_len} + --max-new-tokens {args.max_new_tokens} (a training prompt and a "
             f"sampled response) is longer than the model's {config.max_position_embeddings} positions; lower them")
    if args.disable_dropout:
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
    # Loaded in the precision it trains in, not in the checkpoint's (transformers would keep an fp16 checkpoint in
    # fp16 in an fp32 run).
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    # Only the new head may be missing from the SFT checkpoint (its language-model head is left unused).
    model = load_pretrained(AutoModelForSequenceClassification, args.model_name_or_path, model_hint,
                            new_head=True, config=config, trust_remote_code=args.trust_remote_code,
                            dtype=dtype)
    check_finite_weights(model, f"model {args.model_name_or_path!r}")
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        fail(f"{type(model).__name__} has no linear `score` head; use a model whose sequence-classification head is "
             "called `score` (Llama, Mistral, Qwen, GPT-NeoX/Pythia, OPT, GPT-2, ...)")
    if added_pad_token:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    # The head starts at N(0, 1/sqrt(hidden + 1)) (Stiennon et al. 2020; "N+ implementation details", detail 11), so
    # that the initial scores are small. Under ZeRO-3 the weight is a shard: gather it, let rank 0 write it.
    with deepspeed.zero.GatheredParameters([model.score.weight], modifier_rank=0):
        torch.nn.init.normal_(model.score.weight, std=1 / math.sqrt(model.config.hidden_size + 1))
    if args.gradient_checkpointing:
        model.config.use_cache = False
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # torch's fused AdamW updates every weight in one kernel (the for-loop default launches several per weight); with
    # --offload the step runs on the CPU, where DeepSpeed wants its own vectorised CPU Adam.
    adam = deepspeed.ops.adam.DeepSpeedCPUAdam if args.offload else functools.partial(
        torch.optim.AdamW, fused=get_accelerator().device_name() in ("cpu", "cuda"))
    optimizer = adam(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * args.num_training_steps), args.num_training_steps
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    engine.train()  # from_pretrained returns a model in eval mode, and gradient checkpointing only acts in train mode
    if args.zero_stage == 0 and args.world_size == 1:
        # One rank has no gradients to average, but DeepSpeed would still copy them all into one buffer, all-reduce
        # it and copy them back after every backward pass (checked with DeepSpeed 0.19.8).
        engine.enable_backward_allreduce = False

    # Logging: tensorboard always, wandb with --track, and the hyperparameters as a table.
    writer = None
    if is_main:
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, name=run_name, config=asdict(args), sync_tensorboard=True)
        writer = SummaryWriter(os.path.join("runs", run_name))
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
        print(f"{len(train_data)} train / {len(eval_data)} eval pairs; {args.num_training_steps} optimizer steps "
              f"of {args.batch_size} pairs")

    # TRAINING LOOP
    start_time = time.time()
    step = 0
    progress = tqdm(total=args.num_training_steps, desc="reward model", disable=not is_main)
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)  # [loss, accuracy] summed over micro-batches
        for micro_step, batch in enumerate(train_loader):
            if micro_step >= steps_per_epoch * args.gradient_accumulation_steps:
                break  # a last, incomplete accumulation would take a step on fewer pairs
            # ALGO LOGIC: score chosen and rejected in one forward pass, then the pairwise (Bradley-Terry) loss.
            scores = sequence_scores(engine.module, batch["input_ids"].to(device), batch["attention_mask"].to(device))
            chosen_scores, rejected_scores = scores.chunk(2)
            loss, accuracy = rlhf_math.pairwise_reward_loss(chosen_scores, rejected_scores)
            if not torch.isfinite(loss) and step == 0:
                fail(f"the loss of the first micro-batch is {loss.item()}, before any training: the model's forward "
                     f"pass gives non-finite numbers; check --model-name-or-path (with --dtype {args.dtype}, try fp32)")
            if not torch.isfinite(loss):
                fail(f"the loss became {loss.item()} at step {step}; lower --learning-rate or use --dtype fp32")
            engine.backward(loss)
            engine.step()  # steps the optimizer and scheduler only at the end of each accumulation
            running += torch.stack([loss.detach(), accuracy])
            if engine.is_gradient_accumulation_boundary():
                step += 1
                progress.update()
                if step % args.logging_steps == 0:
                    dist.all_reduce(running)
                    mean_loss, mean_accuracy = (running / (args.logging_steps * args.gradient_accumulation_steps
                                                           * args.world_size)).tolist()
                    running.zero_()
                    if is_main:
                        lr = scheduler.get_last_lr()[0]
                        sps = step / (time.time() - start_time)
                        progress.set_postfix(loss=f"{mean_loss:.4f}", accuracy=f"{mean_accuracy:.3f}")
                        writer.add_scalar("train/loss", mean_loss, step)
                        writer.add_scalar("train/accuracy", mean_accuracy, step)
                        writer.add_scalar("train/lr", lr, step)
                        writer.add_scalar("charts/steps_per_second", sps, step)
                        progress.write(f"step {step}: train loss {mean_loss:.4f}, accuracy {mean_accuracy:.3f}, "
                                       f"lr {lr:.2e}, {sps:.1f} steps/s")
    progress.close()

    metrics = evaluate(engine, eval_loader, device)
    if is_main:
        print(f"held-out accuracy {metrics['accuracy']:.4f}, loss {metrics['loss']:.4f}, mean score chosen "
              f"{metrics['chosen_score']:.3f} / rejected {metrics['rejected_score']:.3f}, in {time.time() - start_time:.0f}s")
        for name, value in metrics.items():
            writer.add_scalar(f"eval/{name}", value, step)

    # REWARD NORMALIZATION (Ziegler et al. 2019; lm-human-preferences' gain and bias). The policy PPO starts from
    # answers training prompts, sampled as ppo.py samples, and the mean and standard deviation of the trained model's
    # scores of those responses go into config.json. ppo.py and evaluate.py use (score - reward_mean) / reward_std:
    # mean 0 and std 1 where PPO starts, so --clip-score and --kl-coef mean the same whatever the model's own scale.
    engine.eval()
    policy_path = args.policy_model_name_or_path or args.model_name_or_path
    policy = load_pretrained(AutoModelForCausalLM, policy_path, "check --policy-model-name-or-path", dtype=dtype,
                             trust_remote_code=args.trust_remote_code)
    if added_pad_token:  # the pad token added above must exist for the policy too (it pads the prompts)
        policy.resize_token_embeddings(len(tokenizer))
    if args.zero_stage == 3:  # partitioned like the reward model (HfDeepSpeedConfig is still alive)
        policy_engine, *_ = deepspeed.initialize(model=policy.requires_grad_(False), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
            "bf16": {"enabled": args.dtype == "bf16"}, "fp16": {"enabled": args.dtype == "fp16"}})
        policy = policy_engine.module
    else:
        policy = policy.to(device)
    policy.eval()
    # Plain multinomial sampling at the temperature, pad suppressed; this replaces the folder's own
    # generation_config.json, whose settings (a repetition penalty, min_new_tokens) would change what is sampled.
    policy.generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        suppress_tokens=[tokenizer.pad_token_id])
    per_rank = math.ceil(args.normalization_samples / args.world_size)  # the same on every rank: ZeRO-3 steps together
    picked = random.Random(args.seed).choices(range(len(train_data)), k=per_rank * args.world_size)
    prompts = [train_data[i]["prompt"] for i in picked[dist.get_rank() :: args.world_size]]
    moments = torch.zeros(3, dtype=torch.float64, device=device)  # [number, sum, sum of squares] of the scores
    with torch.no_grad():
        for start in range(0, per_rank, args.per_device_eval_batch_size):
            batch = prompts[start : start + args.per_device_eval_batch_size]
            width = max(len(p) for p in batch)  # left padding, so that every response starts at position `width`
            prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch], device=device)
            prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            responses = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                        synced_gpus=args.zero_stage == 3)[:, width:]
            lengths = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id).sum(dim=1)  # EOS included
            sequences = [p + r[:n].tolist() for p, r, n in zip(batch, responses, lengths)]
            scored = right_pad(sequences, tokenizer.pad_token_id)
            scores = sequence_scores(engine.module, scored["input_ids"].to(device),
                                     scored["attention_mask"].to(device)).double()
            moments += torch.stack([torch.tensor(float(len(scores)), dtype=torch.float64, device=device),
                                    scores.sum(), (scores**2).sum()])
    dist.all_reduce(moments)
    n, total, total_squares = moments.tolist()
    engine.module.config.reward_mean = total / n
    engine.module.config.reward_std = math.sqrt(max(total_squares - n * (total / n) ** 2, 0.0) / (n - 1))
    if is_main:
        print(f"reward normalization: on {int(n)} responses of {policy_path!r} to training prompts the scores have mean "
              f"{engine.module.config.reward_mean:.4f} and standard deviation {engine.module.config.reward_std:.4f}, "
              "stored as reward_mean and reward_std in config.json")

    # Save an ordinary Hugging Face folder. Under ZeRO-3 each rank holds a shard of every parameter: gather the full
    # weights (every rank must take part) and let rank 0 write them.
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=args.zero_stage == 3):
        if is_main:
            save_model_folder(engine.module, tokenizer, args.output_dir, {"script": "reward_model.py", "finished": True,
                                                                          "run_name": run_name, "args": asdict(args)})
    if is_main:
        print(f"saved the reward model to {args.output_dir}")
        writer.close()
