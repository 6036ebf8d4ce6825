"""Plumbing: what every stage needs that is not the learning. A reader learning RLHF can skip this file.

Flags, files, model and output folders, ranks, signals, and a DeepSpeed engine's state on disk, in plain functions
that stop with one line saying what to fix. The stages and evaluate.py import it; it imports none of them."""

import atexit
import contextlib
import ctypes
import difflib
import errno
import functools
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import asdict, fields
from typing import Annotated, get_type_hints

import datasets
import deepspeed
import peft
import safetensors.torch
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


# --- Stopping with one line that says what to fix. ---
def script() -> str:
    """The running script's file name (sft.py, ...): its messages' prefix and the owner of the folders it writes."""
    return os.path.basename(sys.argv[0])

def fail(message: str) -> None:
    """Stop with a one-line message that says what to fix, instead of a stack trace from inside a library."""
    raise SystemExit(f"{script()}: error: {message}")

def exact_div(a: int, b: int, what: str) -> int:
    """a / b, which must divide exactly: batch arithmetic is never silently rounded."""
    if b <= 0 or a % b != 0:
        fail(f"{what}: {a} is not divisible by {b}")
    return a // b


# Ranges that check_ranges enforces, read from each Args field's annotation: "--total-episodes must be at least 1".
PositiveInt = Annotated[int, "be at least 1"]
CountInt = Annotated[int, "not be negative"]
PositiveFloat = Annotated[float, "be positive"]
NonNegativeFloat = Annotated[float, "not be negative"]
Fraction = Annotated[float, "be between 0 and 1"]
Seed = Annotated[int, "be between 0 and 2**32 - 1"]
RANGES = {"be at least 1": lambda v: v >= 1, "be positive": lambda v: v > 0, "not be negative": lambda v: v >= 0,
          "be between 0 and 1": lambda v: 0 <= v <= 1, "be between 0 and 2**32 - 1": lambda v: 0 <= v < 2**32}

def check_ranges(args) -> None:
    """Every float flag finite and every flag within its annotation's range (PositiveInt, ...), or one line."""
    check_finite_args(args)  # first: nan fails every range, and "must be a finite number" says why
    for name, hint in get_type_hints(type(args), include_extras=True).items():
        value = getattr(args, name)
        for rule in getattr(hint, "__metadata__", ()):
            if value is not None and not RANGES[rule](value):
                fail(f"--{name.replace('_', '-')} must {rule}, not {value}")
    for name, stage in vars(args).items():
        if name.endswith("zero_stage") and stage == 0 and getattr(args, "offload", False):
            fail(f"--offload needs --{name.replace('_', '-')} 1, 2 or 3: DeepSpeed offloads only a partitioned "
                 "optimizer, and ZeRO-0 keeps it whole on the device")

def check_finite_args(args) -> None:
    """Every float flag must be a number: inf or nan slip through `> 0` checks."""
    for field in fields(args):
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{field.name.replace('_', '-')} must be a finite number, not {value}")

# --- Model folders, tokenizers and DeepSpeed engines. ---
def is_hub_name(path: str) -> bool:
    """True for `name` or `org/name` that from_pretrained would look up on the hub. Never for a local-looking path:
    the stages' outputs (checkpoints/..., even before they exist), or a near miss of a folder here (chekpoints/sft)."""
    first = path.split("/")[0]
    here = [name for name in os.listdir(".") if os.path.isdir(name)] + ["checkpoints"]
    return not (os.path.exists(path) or path.startswith(("/", ".", "~", "checkpoints/")) or path.count("/") > 1
                or os.path.isdir(first) or difflib.get_close_matches(first, here, n=1, cutoff=0.8))

def check_model_folder(path: str, hint: str) -> None:
    """A local model folder must hold a config and safetensors weights: never pickle, whose loading runs its code."""
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
    """model_class.from_pretrained(path) in safetensors, or one line: a damaged file, or a weight missing or unused (a
    head saved under another name would start random). new_head: a fresh head on another model's checkpoint (a
    classifier from a causal LM): only weights outside the backbone (base_model_prefix) may be missing or unused."""
    try:
        model, info = model_class.from_pretrained(path, use_safetensors=True, output_loading_info=True, **kwargs)
    except (OSError, ValueError, safetensors.SafetensorError) as error:
        fail(f"cannot load the model in {path!r} ({' '.join(str(error).split())[:300]}); {hint}")
    except RuntimeError as error:  # a weight whose shape is not the config's: transformers names it in a printed table
        if "ignore_mismatched_sizes" not in str(error):
            raise
        _, info = model_class.from_pretrained(path, use_safetensors=True, output_loading_info=True,
                                              ignore_mismatched_sizes=True, **kwargs)
        name, saved, wanted = sorted(info["mismatched_keys"])[0]
        fail(f"the weights in {path!r} do not fit its config.json: {name} is {list(saved)} there, {list(wanted)} by "
             f"the config (another vocabulary size, or number of labels); {hint}")
    checked = f"{model.base_model_prefix}." if new_head else ""  # the names that must match: all, or the backbone's
    missing = sorted(name for name in info["missing_keys"] if name.startswith(checked))
    unexpected = sorted(name for name in info["unexpected_keys"] if name.startswith(checked))
    if missing or unexpected:
        fail(f"{path!r} does not fit {model_class.__name__}: weights missing from it {missing[:4]}, weights in it "
             f"that the model does not use {unexpected[:4]} ({len(missing)} and {len(unexpected)} in all); {hint}")
    return model

def folder_identity(path: str | None) -> str | None:
    """What identifies a model folder moved or named another way, and tells it from a model put in its place, even
    one changed in a single weight or token: a SHA-256 of the names and whole content of the files of the model and
    its tokenizer (SAVED_FILE's but the record and generation config; about 1 GB/s). A hub name (or None) is itself."""
    if path is None or not os.path.isdir(path):
        return path
    digest = hashlib.sha256()
    for name in sorted(name for name in os.listdir(path) if SAVED_FILE.fullmatch(name)
                       and name not in (RECORD, "generation_config.json")):
        with open(os.path.join(path, name), "rb") as f:
            digest.update(f"{name} {os.fstat(f.fileno()).st_size}".encode())
            while block := f.read(2**24):
                digest.update(block)
    return digest.hexdigest()

def check_finite_weights(model, name: str) -> None:
    """Stop if a weight is inf or NaN (a damaged checkpoint); under ZeRO-3 every rank takes part."""
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

def load_tokenizer_with_pad(path: str, hint: str, trust_remote_code: bool, is_main: bool, model_path: str):
    """The tokenizer, with an EOS and a pad token distinct from it (added if missing: padding equal to EOS would mask
    the real EOS, DeepSpeed-Chat's trap), and whether it was added (the model's embeddings must then grow); every
    other token must have a row in the embeddings of the model at MODEL_PATH."""
    tokenizer = load_tokenizer(path, hint, trust_remote_code)
    check_vocabulary(tokenizer, model_path, hint, trust_remote_code)
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {path!r} has no EOS token; set one, or pick another with --tokenizer-name-or-path")
    added_pad_token = tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id
    if added_pad_token:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        if is_main:
            print(f"the tokenizer had no pad token distinct from EOS: added '<|pad|>' (id {tokenizer.pad_token_id})")
    return tokenizer, added_pad_token

def check_vocabulary(tokenizer, path: str, hint: str, trust_remote_code: bool, added: int = 0) -> None:
    """Every token of TOKENIZER but the ADDED ones (which the caller resizes the embeddings for) has a row in the
    embeddings of the model at PATH (config.json's vocab_size): tokens added without resize_token_embeddings would index
    past them, an IndexError deep inside the model."""
    rows = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config().vocab_size
    if len(tokenizer) - added > rows:
        fail(f"the tokenizer has {len(tokenizer) - added} tokens but the model in {path!r} embeds only {rows}: tokens "
             "were added to it without model.resize_token_embeddings(len(tokenizer)); resize the model's embeddings "
             f"and save it with its tokenizer, or {hint}")

def check_embedding_rows(flag: str, path: str, readers: dict[str, str], trust_remote_code: bool) -> None:
    """The model at PATH (FLAG) samples from every row of its output layer (config.json's vocab_size, rows that pad
    the vocabulary included); each model that reads those ids (READERS: flag -> path) must embed them all, or a
    sampled id past its rows stops the run with an IndexError deep inside it."""
    def rows(folder):
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).get_text_config().vocab_size
    sampled = rows(path)
    for reader_flag, reader in readers.items():
        if (embedded := rows(reader)) < sampled:
            fail(f"{flag} {path!r} samples token ids from {sampled} rows, but {reader_flag} {reader!r} embeds only "
                 f"{embedded}: an id past them would stop the run; give models of one vocabulary size (resize "
                 f"the smaller one's embeddings with model.resize_token_embeddings({sampled}) and save it)")

def load_other_tokenizer(path: str, hint: str, tokenizer, trust_remote_code: bool):
    """The tokenizer of the model at PATH if its tokens are not TOKENIZER's (text is then tokenized again for it, which
    needs its own EOS and pad token), else None."""
    other = load_tokenizer(path, hint, trust_remote_code)
    if other.get_vocab() == tokenizer.get_vocab():
        return None
    if other.eos_token_id is None or other.pad_token_id is None:
        fail(f"the tokenizer of {path!r} has other tokens than the policy's, and reads its text tokenized again: it "
             f"needs an EOS and a pad token; set them and save it, or {hint}")
    return other

def retokenized(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, tokenizer,
                other_tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompt + response [B, P + R] in TOKENIZER's tokens as a model with OTHER_TOKENIZER reads them: unchanged if it is
    None (the same tokens); else each prompt and response decoded to text and tokenized again as the stages tokenize
    their data (EOS appended where the response has one; special tokens not carried over), left- and right-padded
    again -> (sequences [B, P' + R'], attention_mask, P')."""
    if other_tokenizer is None:
        return sequences, attention_mask, prompt_len
    prompts, responses = [], []
    for ids, mask in zip(sequences, attention_mask.bool()):
        prompt, response = ids[:prompt_len][mask[:prompt_len]], ids[prompt_len:][mask[prompt_len:]]
        prompts.append(other_tokenizer(tokenizer.decode(prompt, skip_special_tokens=True),
                                       split_special_tokens=True)["input_ids"])
        eos = [other_tokenizer.eos_token_id] if (response == tokenizer.eos_token_id).any() else []
        text = tokenizer.decode(response, skip_special_tokens=True)
        # A response of special tokens only, without EOS, decodes to nothing: its score is read at an EOS.
        responses.append(other_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                         + eos or [other_tokenizer.eos_token_id])
    P, R, pad = max(map(len, prompts)), max(map(len, responses)), other_tokenizer.pad_token_id
    if P + R > other_tokenizer.model_max_length:
        fail(f"a prompt + response is {P + R} tokens for {other_tokenizer.name_or_path!r}, more than its tokenizer's "
             f"model_max_length {other_tokenizer.model_max_length}; lower --max-prompt-len or --max-new-tokens")
    rows = [[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(prompts, responses)]
    masks = [[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)) for p, r in zip(prompts, responses)]
    return torch.tensor(rows, device=sequences.device), torch.tensor(masks, device=sequences.device), P

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

def model_config(path: str, disable_dropout: bool, trust_remote_code: bool, **kwargs):
    """A model folder's config (AutoConfig), with every dropout probability set to 0 if disable_dropout."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    if disable_dropout:
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
    return config

def adamw(params, lr: float, weight_decay: float):
    """torch's fused AdamW: one kernel for all weights, on the GPU, or on the CPU where --offload puts the step."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                             fused=get_accelerator().device_name() in ("cpu", "cuda"))

def initialize_engine(model, ds_config: dict, optimizer=None, scheduler=None):
    """deepspeed.initialize: trained (optimizer and scheduler given) in train mode, else frozen in eval mode."""
    if optimizer is None:
        model.requires_grad_(False)
    # With the optimizer offloaded, DeepSpeed asks for its own CPU Adam, compiled on first use (90 s on 2 cores, and a
    # C++ compiler on every node); torch's fused AdamW steps on the CPU as fast (docs/scaling.md, "Offload").
    ds_config = {**ds_config, "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    # from_pretrained returns a model in eval mode, and gradient checkpointing only acts in train mode.
    engine.train(optimizer is not None)
    if optimizer is not None and engine.zero_optimization_stage() == 0 and dist.get_world_size() == 1:
        # One rank has no gradients to average, but DeepSpeed would still copy them all into one buffer, all-reduce
        # it and copy them back after every backward pass (checked with DeepSpeed 0.19.8).
        engine.enable_backward_allreduce = False
    return engine

@contextlib.contextmanager
def gathered(engine, enabled: bool):
    """Under ZeRO-3, a model's full weights gathered once (one coalesced all-gather) and DeepSpeed's hooks off, so
    that generating and scoring do not gather them block by block for every token and forward pass (TRL's
    unwrap_model_for_generation, for no-gradient work). The hooks come back as they were, in their modules' hook
    tables: registered anew, DeepSpeed would forget the module order it traced, and stop prefetching. Nothing below
    ZeRO-3. No public API: it uses the hook handles of the parameter coordinator and the engine, torch's hook tables
    and ds_active_sub_modules (DeepSpeed 0.19.8; test_gathered_rollout_weights_are_whole_and_hooks_come_back)."""
    if not enabled or engine.zero_optimization_stage() != 3:
        yield
        return
    # The ZeRO-3 machinery that owns the hooks: the optimizer's, or the engine's own when it has no optimizer.
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    partitioned = [p for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if partitioned:
        partitioned[0].all_gather_coalesced(partitioned).wait()
    handles = [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook, engine.module_forward_pre_hook,
               engine.module_forward_post_hook]
    tables = {id(table): table for handle in handles
              for table in [handle.hooks_dict_ref(), *(ref() for ref in handle.extra_dict_ref)]}
    saved = {key: dict(table) for key, table in tables.items()}  # each table as it is, in its order
    for handle in handles:
        handle.remove()
    for p in engine.module.parameters():
        p.ds_active_sub_modules.clear()
    try:
        yield
    finally:
        for key, table in tables.items():
            table.clear()
            table.update(saved[key])
        if partitioned:  # back to this rank's shard; nothing was changed, so nothing is written back
            partitioned[0].partition(param_list=partitioned, has_been_updated=False)

def inference_copy(model, device: torch.device, trust_remote_code: bool):
    """A plain copy of a model's architecture, for inference: in its dtype, on `device`, no gradients, no DeepSpeed
    hooks; its weights come from copy_weights. Built from the config (a ZeRO-3 model's own weights are shards)."""
    with torch.device(device):
        copy = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype,
                                                trust_remote_code=trust_remote_code)
    return copy.eval().requires_grad_(False)

@torch.no_grad()
def copy_weights(source, target) -> None:
    """target's weights set to source's, in place: each stays in its storage (a recorded CUDA graph reads it there)."""
    sources, targets = dict(source.named_parameters()), dict(target.named_parameters())
    if sources.keys() != targets.keys():
        fail(f"{type(source).__name__}'s weights are not those of a plain copy of it (LoRA adapters?)")
    torch._foreach_copy_([targets[name] for name in sources], list(sources.values()))

def cuda_graph(function, args: tuple):
    """function(*args) recorded once as a CUDA graph, after three runs on a side stream (which compile it), and a
    replay(*new_args) that copies each tensor of new_args into the recorded one, replays the graph (one launch for
    all its kernels) and returns the recorded outputs, overwritten by the next replay. Every other tensor the graph
    reads, weights or a cache, must stay in its storage: the graph reads those addresses."""
    recorded = [arg.clone() if torch.is_tensor(arg) else arg for arg in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            function(*recorded)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = function(*recorded)

    def replay(*new_args):
        for arg, new in zip(recorded, new_args):
            if torch.is_tensor(arg):
                arg.copy_(new)
        graph.replay()
        return outputs
    return replay

def add_lora(model, lora_dim: int, args):
    """LoRA (Hu et al. 2021): beside each targeted linear layer W, a trainable low-rank update (alpha / r) B A, with
    B = 0 at the start so that the model is unchanged; peft builds the layers in place. A sequence classifier's head
    `score` stays plain, and the adapters have no dropout: the same input gives the same output."""
    lora_config = peft.LoraConfig(r=lora_dim, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                  target_modules=args.lora_target_modules,
                                  exclude_modules=["score"] if hasattr(model, "score") else None)
    try:
        model = peft.inject_adapter_in_model(lora_config, model)  # freezes all but the adapters
    except (ValueError, re.error) as error:  # no module matches, or a regular expression that does not compile
        fail(f"--lora-target-modules {args.lora_target_modules!r}: {' '.join(str(error).split())[:300]}; give "
             "'all-linear', or a regular expression that matches some of the model's modules")
    if not args.only_optimize_lora:
        model.requires_grad_(True)  # DeepSpeed-Chat's default: the adapters train alongside the whole model
    return model

@contextlib.contextmanager
def adapters_disabled(model):
    """Switch a model's LoRA adapters off for a while (a model without adapters is unchanged): a model whose adapters
    alone were trained is then the model it started as."""
    lora_layers = [m for m in model.modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)]
    for layer in lora_layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in lora_layers:
            layer.enable_adapters(True)

def whole_state_dict(model, zero3: bool, is_main: bool, merge_lora: bool = False) -> dict[str, torch.Tensor]:
    """MODEL's state dict, whole, in rank 0's CPU memory (is_main; other ranks get {}); with merge_lora, as a plain
    model's (W + (alpha / r) B A under W's name). Under ZeRO-3 (zero3: every rank takes part) one tensor or adapted
    layer is gathered at a time: no rank holds more than a layer whole on its device. Tied weights stay one tensor."""
    state, copies = {}, {}  # copies: each tensor's CPU copy, by identity, which tied names share
    for name, tensor in model.state_dict(keep_vars=True).items():
        gather, saved_name, adapted = [tensor], name, None
        if merge_lora:
            if "lora_" in name:
                continue  # the adapter's own weights: folded into its layer's weight
            saved_name = name.replace(".base_layer.", ".")
            layer = model.get_submodule(saved_name.rpartition(".")[0])
            if isinstance(layer, peft.tuners.lora.LoraLayer) and saved_name.endswith(".weight"):
                gather, adapted = list(layer.parameters()), layer
        with deepspeed.zero.GatheredParameters(gather, enabled=zero3):  # a buffer, never partitioned, stays as it is
            if is_main and adapted is not None:  # summed where the weights are, as the model sums them
                state[saved_name] = (tensor + adapted.get_delta_weight("default")).detach().cpu()
            elif is_main:
                if id(tensor) not in copies:
                    copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
                state[saved_name] = copies[id(tensor)]
    return state

# --- Data files: one split, checked for its columns and its cells; prompts as token ids. ---
DATA_FORMATS = {".json": "JSON", ".jsonl": "JSON", ".parquet": "Parquet", ".csv": "CSV", ".txt": "text",
                ".arrow": "Arrow"}  # the data files `datasets` reads from a folder, by their loader

def check_data_folder(folder: str, flag: str, split: str) -> None:
    """A local data folder holds its data files in one format, each once (`datasets` reads one format's files, leaving
    the others out unsaid, and reads both train.json and train.jsonl). A SPLIT read from several files (shards, or a
    copy in a subfolder: old/train.jsonl) is said, file by file."""
    files = []
    for root, folders, names in os.walk(folder):
        folders[:] = sorted(name for name in folders if not name.startswith((".", "_")))  # as `datasets` skips them
        files += [os.path.relpath(os.path.join(root, name), folder) for name in sorted(names)
                  if os.path.splitext(name)[1] in DATA_FORMATS and not name.startswith((".", "_"))]
    formats = {}
    for file in files:
        formats.setdefault(DATA_FORMATS[os.path.splitext(file)[1]], file)
    if len(formats) > 1:
        fail(f"{flag} {folder!r} holds data files of {len(formats)} formats ({', '.join(formats.values())}): only "
             "one format would be read, the other files left out; keep the files of one format in the folder")
    stems = [os.path.splitext(file)[0] for file in files]
    twice = [file for file in files if stems.count(os.path.splitext(file)[0]) > 1]
    if twice:
        fail(f"{flag} {folder!r} holds {' and '.join(twice[:2])}: the same data twice, and both would be read; keep "
             "one of them")
    with contextlib.suppress(FileNotFoundError):  # no data file at all: load_dataset says so
        split_files = datasets.data_files.DataFilesDict.from_patterns(
            datasets.data_files.get_data_patterns(folder), base_path=folder).get(split.split("[")[0], [])
        if len(split_files) > 1 and os.environ.get("RANK", "0") == "0":  # the global rank: once per run
            print(f"split {split!r} of {flag} {folder!r} is read from {len(split_files)} files: "
                  f"{', '.join(os.path.relpath(file, folder) for file in split_files)}")

def load_split(dataset: str, split: str, columns: list[str], flag: str = "--dataset", config: str | None = None,
               extensions: tuple = (".json", ".jsonl", ".parquet"), hint: str | None = None) -> datasets.Dataset:
    """One split of a hub data set (config: its configuration name, if it has several) or of a local file or folder,
    checked for the columns we need; a one-line error that names the flag to fix otherwise (and HINT, if given, for a
    missing column)."""
    kinds = f"{', '.join(extensions[:-1])} or {extensions[-1]}"
    if not os.path.exists(dataset) and not is_hub_name(dataset):
        fail(f"no data set at {dataset!r}; check {flag}")
    if os.path.isdir(dataset):
        check_data_folder(dataset, flag, split)
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
    except RuntimeError as error:  # a data set (here or on the hub) that comes as a loading script
        if "Dataset scripts are no longer supported" not in str(error):
            raise
        fail(f"{flag} {dataset!r} comes with a loading script ({str(error).split('found ')[-1]}): code, which is never "
             f"run here; give the data as {kinds} files")
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
        hh_rlhf = {"chosen", "rejected"} <= set(data.column_names) and hint is None
        fail(f"data set {dataset!r} split {split!r} has no column {missing}; its columns are {data.column_names}"
             + ("; if 'chosen' and 'rejected' each hold the whole conversation (the hh-rlhf layout), pass "
                "--split-conversations (ppo.py and evaluate.py also --prompt-column chosen)" if hh_rlhf else "")
             + (f"; {hint}" if hint else ""))
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
    """A whole conversation (hh-rlhf) -> (prompt up to and including its last assistant marker, response)."""
    cut = text.rfind(assistant_marker)
    if cut < 0:
        fail(f"{where}: no {assistant_marker!r} to split the conversation at; check --assistant-marker")
    prompt, response = text[: cut + len(assistant_marker)], text[cut + len(assistant_marker) :]
    if not response.strip():
        fail(f"{where}: nothing after the last {assistant_marker!r}; fix or remove the row")
    return prompt, response

def prompt_ids(tokenizer, row: dict, i: int, column: str, split: str, assistant_marker: str | None = None) -> list:
    """The token ids of one row's prompt: text as it is (text that spells "<|endoftext|>" stays text, never a real
    EOS), with assistant_marker a whole conversation cut at its last marker (split_conversation), and a list of
    {"role", "content"} messages through the tokenizer's chat template, up to the opening of the assistant's turn."""
    value, where = row[column], f"row {i} of split {split!r}, column {column!r}"
    if not isinstance(value, list):
        text = text_of(row, i, column, split)
        if assistant_marker is not None:
            text = split_conversation(text, assistant_marker, where)[0]
        ids = tokenizer(text, split_special_tokens=True)["input_ids"]
        if not ids:  # a forward pass over no token at all fails deep inside the model
            fail(f"{where}: the prompt {text[:40]!r} is no token at all in this tokenizer (its normalizer drops the "
                 "text); fix or remove the row, or use a tokenizer that reads it")
        return ids
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

def response_ids(tokenizer, text: str, where: str) -> list:
    """The token ids of a response, then EOS: text as it is (text that spells "<|endoftext|>" stays text, never a real
    EOS). A response that is no token at all (the tokenizer's normalizer drops its text) stops with one line naming
    WHERE it is: it would teach, or be scored as, an empty answer."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if not ids:
        fail(f"{where}: the response {text[:40]!r} is no token at all in this tokenizer (its normalizer drops the "
             "text); fix or remove the row, or use a tokenizer that reads it")
    return ids + [tokenizer.eos_token_id]

def load_text_blocks(tokenizer, dataset: str, config: str | None, column: str, block_len: int, min_blocks: int,
                     flag: str = "--unsup-dataset", column_flag: str = "--unsup-text-column") -> torch.Tensor:
    """Plain text (a .txt file, a column of a data file, or a hub data set), tokenized, joined with EOS between
    documents and cut into blocks of BLOCK_LEN tokens, at least MIN_BLOCKS of them: [blocks, block_len]."""
    data = load_split(dataset, "train", [column], flag, config, (".txt", ".json", ".jsonl", ".parquet"),
                      hint=f"{flag} is plain text to learn from: a .txt file, or a data set whose column of text "
                           f"{column_flag} names")
    texts = [text for text in data[column] if isinstance(text, str) and text.strip()]
    if not texts:
        fail(f"{flag} {dataset!r} holds no text, only blank lines or empty cells")
    stream = [t for ids in tokenizer(texts, split_special_tokens=True)["input_ids"]
              for t in ids + [tokenizer.eos_token_id]]
    num_blocks = len(stream) // block_len
    if num_blocks < min_blocks:
        fail(f"{flag} {dataset!r} holds {len(stream)} tokens, fewer than one micro-batch of {min_blocks} blocks of "
             f"{block_len}; give it more text")
    return torch.tensor(stream[: num_blocks * block_len]).view(num_blocks, block_len)

def refuse_repeated_prompt(prompt, responses: dict[str, str], i: int, split: str) -> None:
    """Stop on the hh-rlhf layout read as if it were not: every response (column -> text) begins with the prompt."""
    if isinstance(prompt, str) and all(response.startswith(prompt) for response in responses.values()):
        fail(f"row {i} of split {split!r}: {' and '.join(map(repr, responses))} begin with the prompt (the hh-rlhf "
             "layout); pass --split-conversations to cut the prompt from each whole conversation")

def load_prompts(tokenizer, dataset: str, split: str, column: str, max_prompt_len: int, is_main: bool,
                 assistant_marker: str | None = None) -> list:
    """The token ids of every prompt of a split that fits max_prompt_len; longer ones are dropped and counted."""
    data = load_split(dataset, split, [column])
    hh_rlhf = {"chosen", "rejected"} <= set(data.column_names)
    if assistant_marker is None and column in ("chosen", "rejected") and hh_rlhf:
        fail(f"column {column!r} of {dataset!r} holds whole conversations, answers included (the hh-rlhf layout); pass "
             "--split-conversations to take each prompt up to its last assistant marker")
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

# --- Processes and ranks: the process group, the launcher watch, signals, and rank 0's work. ---
def init_distributed(args, zero3: bool) -> torch.device:
    """Join the ranks (deepspeed or torchrun set RANK; plain `python` is one rank), set args.local_rank, world_size,
    return this rank's device; stop if the launcher dies, and with one line on Ctrl-C or SIGTERM. zero3: whether any
    of the script's models is partitioned by ZeRO-3, whose collectives copy tensors on gloo's threads."""
    launchers = watch_launcher()  # before the set-up: a rank waiting there for a peer must not outlive its launcher
    if "RANK" not in os.environ:  # one rank, on any free port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    on_cpu = get_accelerator().device_name() == "cpu"
    if args.dtype == "fp16" and on_cpu:
        fail("--dtype fp16 needs a GPU: DeepSpeed has no fp16 on CPU; use --dtype bf16 or fp32")
    args.local_rank = int(os.environ["LOCAL_RANK"])
    get_accelerator().set_device(args.local_rank)
    if on_cpu:
        keep_freed_memory()
        if zero3:  # before gloo starts the threads that run the collectives
            one_openmp_thread_for_new_threads()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())  # see end_run
    if on_cpu:
        remove_shared_memory_file()
    stop_on_signals()
    args.world_size = dist.get_world_size()
    if args.world_size > 1:
        sys.excepthook = functools.partial(one_line_for_a_lost_rank, launchers)
    return torch.device(get_accelerator().device_name(args.local_rank))

def peak_resident_gb() -> float:
    """This process's peak resident memory, in GB: Linux's VmHWM, this program's own (the ru_maxrss of getrusage and
    wait4 starts from the peak of the process that spawned it). Elsewhere, getrusage's figure."""
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)

def peak_memory_gb() -> dict:
    """This rank's peak memory so far, in GB: on a GPU, torch's allocated and reserved figures; on a CPU, the process's
    peak resident memory for both (DeepSpeed's CPU figures are the largest of its own readings of the resident memory,
    which miss the peaks between them)."""
    if get_accelerator().device_name() == "cpu":
        peak = peak_resident_gb()
        return {"max_allocated_gb": peak, "max_reserved_gb": peak}
    return {"max_allocated_gb": get_accelerator().max_memory_allocated() / 2**30,
            "max_reserved_gb": get_accelerator().max_memory_reserved() / 2**30}

def free_port() -> str:
    """A TCP port free on this machine now, for a process group: two runs side by side must not take the same one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])

def keep_freed_memory() -> None:
    """On a CPU with glibc's malloc: memory freed by a tensor of up to 32 MiB stays in the process for the next one,
    not faulted in again page by page (1,000 page faults in a generation at the benchmark's shape; 7 with this):
    mallopt's M_MMAP_THRESHOLD (-3) at its largest, 32 MiB, and M_TRIM_THRESHOLD (-1) at twice that."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 32 * 2**20)
        libc.mallopt(-1, 64 * 2**20)

def one_openmp_thread_for_new_threads() -> None:
    """On a CPU: threads started from now on (gloo's, which run the collectives) do tensor work on one OpenMP thread,
    not a team each, more threads than cores (ZeRO-3 on one 2-core rank: 99 s instead of 61 s). Only for ZeRO-3
    (below it gloo's threads start no team, and a one-rank run took 3% longer with it)."""
    torch.get_num_threads()  # this thread takes its count now, before the default for new threads changes
    setter = threading.Thread(target=torch.set_num_threads, args=(1,))
    setter.start()
    setter.join()

def remove_shared_memory_file() -> None:
    """DeepSpeed's CPU shared-memory all-reduce (unused here) gives each rank a 66 MB file in /dev/shm that it never
    removes. Once every rank has mapped the others' files each removes its own name (DeepSpeed 0.19.8's shm.cpp)."""
    dist.barrier()  # every rank has mapped every rank's file
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
            f"{os.environ['MASTER_PORT']}_{dist.get_rank()}")
    if os.path.exists(name):
        os.remove(name)

def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return pid > 0

def end_run() -> None:
    """Last call of a finished run: ranks wait for one another; several then skip Python's shutdown, where a gloo
    thread freeing a tensor dies in a C++ destructor: "terminate called without an active exception" (gdb; 1 in 10)."""
    dist.barrier()
    if dist.get_world_size() > 1:  # one rank returns: the tests run stages in their own process
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)

def on_rank_0(function):
    """function() on rank 0 only, its result (or the message it stopped with) sent to every rank."""
    result = [None, None]
    try:
        result = [function(), None] if dist.get_rank() == 0 else result
    except SystemExit as stop:
        result = [None, str(stop)]
    dist.broadcast_object_list(result, src=0)
    if result[1] is not None:
        raise SystemExit(result[1])
    return result[0]

# What a collective says when a peer is gone: gloo's words, and NCCL's (its DistBackendError "remote process exited
# or there was a network error", or "internal error" with the socket's "Connection closed by remote peer" as the last
# error, and the "communicator was aborted" of the collectives after it).
LOST_PEER = ["Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "remote process exited", "Connection closed by remote peer", "communicator was aborted"]

def one_line_for_a_lost_rank(launchers, kind, error, trace) -> None:
    """sys.excepthook of a run of several ranks: a collective that lost its peer (a rank killed, or stopped with its
    own message) ends this rank with one line instead of gloo's or NCCL's stack trace; if the launcher is gone (a peer
    of this node left first), watch_launcher's thread says so within a second and ends the rank."""
    if not (isinstance(error, RuntimeError) and any(words in str(error) for words in LOST_PEER)):
        return sys.__excepthook__(kind, error, trace)
    if launchers and not launchers_alive(launchers):
        time.sleep(10)  # watch_launcher's thread ends this rank first, with its line
    # The message's first line, without the source file it names: "[pair.cc:553] Connection closed by peer ...",
    # "NCCL error in: .../ProcessGroupNCCL.cpp:3763, remote process exited or there was a network error, ...".
    reason = re.sub(r"^(\[[^\]]*\] )+|^NCCL error in: \S+, ", "", str(error).strip().splitlines()[0]).split(". ")[0]
    print(f"{script()}: error: rank {dist.get_rank()} lost its connection to another rank of this run ({reason}): "
          "that rank stopped, or the launcher did; their output says why", file=sys.stderr, flush=True)

def stop_on_signals() -> None:
    """Ctrl-C or a scheduler's SIGTERM ends the run with one line, its lock released, instead of a traceback."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: fail(f"stopped by {signal.Signals(signum).name}"))

def parent_and_start(pid: int) -> tuple[int, str] | None:
    """A process's parent and start time (Linux /proc); None once it is gone, or dead and not yet reaped (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in "ZX" else (int(fields[1]), fields[19])
    except (OSError, IndexError):
        return None

def launchers_alive(launchers: list[tuple[int, str]]) -> bool:
    """Whether each (pid, start time) of watch_launcher's list still runs (the same process, not a reused pid)."""
    return all((parent_and_start(pid) or (None, None))[1] == start for pid, start in launchers)

def watch_launcher() -> list[tuple[int, str]]:
    """Exit within seconds when the launcher dies (a killed `deepspeed` or `torchrun` leaves its ranks training): a
    thread checks each second that every ancestor running this same Python is still there (Linux /proc). Returns
    them, (pid, start time) each; none for a plain `python` run."""
    watched, pid = [], os.getppid()
    while pid > 1 and (process := parent_and_start(pid)) and \
            os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath("/proc/self/exe"):
        watched.append((pid, process[1]))
        pid = process[0]
    def watch():
        while launchers_alive(watched):
            time.sleep(1)
        print(f"{script()}: error: rank {os.environ.get('RANK')}: the launcher that started this rank is gone; "
              "stopping", file=sys.stderr, flush=True)
        os._exit(1)
    if watched:
        threading.Thread(target=watch, daemon=True).start()
    return watched

def rank_share(rows: list, rank: int, world_size: int, filler) -> list:
    """This rank's share of ROWS for an evaluation on every rank: every world_size-th row from the rank-th, padded with
    filler(rows[0]) (counting for nothing) to the longest share, so that every rank runs as many forward passes
    (under ZeRO-3, collectives)."""
    share = rows[rank::world_size]
    return share + [filler(rows[0])] * (math.ceil(len(rows) / world_size) - len(share))

def sum_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each value (a scalar tensor) summed over all ranks, in one all_reduce, in float64."""
    summed = torch.stack([value.double() for value in values.values()])
    dist.all_reduce(summed)
    return dict(zip(values, summed.tolist()))

# --- Output folders: claimed and locked before anything loads, written whole or not at all (detail 40). ---
RECORD = "training_run.json"  # in every folder a stage writes: the script, run name and arguments that wrote it

def read_record(folder: str) -> dict | None:
    """The training_run.json of a folder, or None if it has none that reads (or only a link to one)."""
    with contextlib.suppress(OSError, ValueError), open(own_path(folder, RECORD, SAVED_FILE) or os.devnull) as f:
        record = json.load(f)
        return record if isinstance(record, dict) else None
    return None

# Names read back from an output folder (its record, `latest`) are untrusted: one is used only if it is a name of the
# kind this project writes there (one of these patterns: never a path, never hidden) and names a regular file or
# folder, never a link (own_path).
SAVED_FILE = re.compile(r"(model|adapter_model)(-\d+-of-\d+)?\.safetensors(\.index\.json)?|(config|generation_config|"
                        r"tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab|chat_template)\.json|"
                        r"(vocab|merges)\.txt|chat_template\.jinja|\w[\w.-]*\.(model|tiktoken)|training_run\.json")
ITERATION_FOLDER = re.compile(r"iteration_\d+")  # a checkpoint (resume/) or snapshot (snapshots/); .tmp while written
RUN_NAME = re.compile(r"[^/\x00]+__\d+__\d+(_\d+)?")  # new_run_name's: EXP_NAME__SEED__TIME, _N if taken

def own_path(folder: str, name, pattern: re.Pattern, is_dir: bool = False) -> str | None:
    """FOLDER/NAME if NAME (read back from a file: untrusted) is a name that this project writes in FOLDER (PATTERN)
    and a regular file there (is_dir: a folder), not a link; else None."""
    if not (isinstance(name, str) and pattern.fullmatch(name)):
        return None
    path = os.path.join(folder, name)
    mode = os.lstat(path).st_mode if os.path.lexists(path) else 0
    return path if (stat.S_ISDIR(mode) if is_dir else stat.S_ISREG(mode)) else None

def write_fix(error: OSError) -> str:
    """What to do about a failed write: a link or a folder where a file of the run goes, no permission, a full disk."""
    if error.errno == errno.ELOOP:
        return "it is a link, and a run never writes through one: remove the link"
    if error.errno == errno.EISDIR:
        return "a folder is in its place: move it away"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable"
    return "free some space"

def open_own(path: str, mode: str = "w"):
    """open(PATH, MODE), to write ("w", "wb") or append ("a"), for a file of the run's own: never through a link
    (O_NOFOLLOW), which would write over the file it points to."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o666), mode)

def write_json(path: str, value) -> None:
    """Write a JSON file whole or not at all: a temporary file, flushed to disk, renamed into place; or one line."""
    try:
        with open_own(path + ".tmp") as f:
            json.dump(value, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except OSError as error:  # a full disk, a folder made read-only meanwhile, a link put there
        with contextlib.suppress(OSError):
            if not os.path.islink(path + ".tmp"):
                os.remove(path + ".tmp")
        fail(f"cannot write {path!r} ({error.strerror}); {write_fix(error)} and run again")

WRITE_ERRORS = (OSError, safetensors.SafetensorError)  # a full disk, a quota, a folder made read-only meanwhile

def stop_after_failed_write(error: Exception, partial: str, what: str, kept: str) -> None:
    """Stop with one line after a write failed: how much this run had written to PARTIAL (its own folder, removed
    now: nothing half-written stays behind), and what is still whole (KEPT)."""
    written = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(partial) for name in names)
    shutil.rmtree(partial, ignore_errors=True)
    fail(f"cannot write {what} ({' '.join(str(error).split())[:200]}); the {written / 2**20:.1f} MB of it written are "
         f"removed again, and {kept}. Free some space and run again")

def fsync_tree(path: str) -> None:
    """Flush a folder's files and entries to disk: a rename after this names complete files, even after a power cut."""
    for root, _, files in os.walk(path):
        for name in files + ["."]:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

def check_output_dir(output_dir: str, inputs: dict[str, str | None]) -> None:
    """OUTPUT_DIR can be this run's: not a file, nor a link to nowhere, nor an input (INPUTS: flag -> path), holding
    one or inside one (a file written into a data set folder would be read as data next time)."""
    if os.path.isfile(output_dir):
        fail(f"--output-dir {output_dir!r} is a file; name a folder")
    if os.path.islink(output_dir) and not os.path.exists(output_dir):
        fail(f"--output-dir {output_dir!r} is a link to {os.readlink(output_dir)!r}, which does not exist; make that "
             "folder or name another")
    real = os.path.realpath(output_dir)
    for flag, path in inputs.items():
        if path and os.path.exists(path) and (os.path.realpath(path) + os.sep).startswith(real + os.sep):
            fail(f"--output-dir {output_dir!r} is or holds {flag} {path!r}, which this run reads; name another folder")
        if path and os.path.isdir(path) and real.startswith(os.path.realpath(path) + os.sep):
            fail(f"--output-dir {output_dir!r} is inside {flag} {path!r}, which this run reads (its files would "
                 "become part of it); name a folder outside it")

def refuse_links(output_dir: str, subfolders: list[str]) -> None:
    """Stop with one line if a run would write through a link in OUTPUT_DIR (into or out of the folder it points to):
    its staging folder .saving, or anything in the SUBFOLDERS it writes (snapshots/, resume/, ...)."""
    paths = [os.path.join(output_dir, name) for name in [".saving", *subfolders]]
    for path in list(paths):
        if os.path.isdir(path) and not os.path.islink(path):
            paths += [os.path.join(root, name) for root, folders, files in os.walk(path) for name in folders + files]
    for path in paths:
        if os.path.islink(path):
            fail(f"{path!r} is a link (to {os.readlink(path)!r}) inside --output-dir: the run writes there and never "
                 "through a link; remove the link, or name another --output-dir")

def claim_output_dir(output_dir: str, inputs: dict[str, str | None], overwrite: bool,
                     subfolders: list[str] = ()) -> None:
    """Make OUTPUT_DIR this run's before any model loads, or stop with a message: neither it nor its SUBFOLDERS an
    input nor holding one, nor a link inside; if not empty, this script's earlier output unless --overwrite; writable.
    OUTPUT_DIR/.lock (host and pid) keeps a second run out while this one lives (a killed run's is taken over)."""
    script_name = script()
    for path in [output_dir] + [os.path.join(output_dir, name) for name in subfolders]:
        check_output_dir(path, inputs)
    refuse_links(output_dir, list(subfolders))
    ours = (read_record(output_dir) or {}).get("script") == script_name
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        if not ours:
            fail(f"--output-dir {output_dir!r} is not empty and holds no earlier output of {script_name}; name a new "
                 "or empty folder, or pass --overwrite to write into it (files of the same names are replaced, nothing "
                 "else is deleted)")
    lock, me = os.path.join(output_dir, ".lock"), f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(lock, "x") as f:
                f.write(me)
            break
        except FileExistsError:
            if own_path(output_dir, ".lock", re.compile(r"\.lock")) is None:
                fail(f"{lock!r} is a folder or a link, not a run's lock file; remove it")
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
        write_json(os.path.join(output_dir, RECORD), {"script": script_name, "finished": False})

def open_log(path: str):
    """A log file of the run (metrics.jsonl, trace.jsonl) opened to append to, never through a link, or one line."""
    try:
        return open_own(path, "a")
    except OSError as error:
        fail(f"cannot write to {path!r} ({error.strerror}); {write_fix(error)}, then run again (with --resume to "
             "continue the run)")

def append_line(file, line: str) -> None:
    """LINE appended to an open log file and flushed to it, or one line on a full disk."""
    try:
        file.write(line + "\n")
        file.flush()
    except OSError as error:
        fail(f"cannot write to {file.name!r} ({error.strerror}); {write_fix(error)}, then continue the run with "
             "--resume")

def new_run_name(exp_name: str, seed: int) -> str:
    """A new run's name, EXP_NAME__SEED__TIME (cleanrl's), and its folder runs/RUN_NAME (tensorboard logs, ppo.py's
    metrics.jsonl), made for it alone before anything loads: a run started in the same second under the same name
    gets RUN_NAME_2 (and so on), and says so, instead of sharing its logs."""
    if "/" in exp_name or os.sep in exp_name or exp_name in ("", ".", ".."):
        fail(f"--exp-name {exp_name!r} must be a plain name (no '/'): it names the run's folder in runs/")
    base = f"{exp_name}__{seed}__{int(time.time())}"
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as error:  # a file named runs, a folder that cannot be written
        fail(f"cannot make runs/ for the run's logs ({error.strerror}); run from a folder you can write, where runs "
             "is not a file")
    for number in range(1, 1000):
        run_name = base if number == 1 else f"{base}_{number}"
        try:
            os.mkdir(os.path.join("runs", run_name))  # exclusive: two runs never get one folder
        except FileExistsError:
            continue
        except OSError as error:
            fail(f"cannot write the run's logs to runs/{run_name} ({error.strerror}); run from a folder you can write")
        if number > 1:
            print(f"runs/{base} is another run's (started in the same second): this run logs to runs/{run_name}")
        return run_name
    fail(f"runs/{base} and 998 more names like it are taken; pass another --exp-name")

def make_run_dir(run_name: str) -> str:
    """runs/RUN_NAME of a run that continues (--resume), made again if it is gone, before anything loads."""
    path = os.path.join("runs", run_name)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        fail(f"cannot write the run's logs to {path} ({error.strerror}); run from a folder you can write")
    return path

def save_model_folder(model, tokenizer, output_dir: str, record: dict, state_dict: dict | None = None) -> None:
    """The model as an ordinary Hugging Face folder (safetensors, tokenizer, record), written in OUTPUT_DIR/.saving,
    flushed and moved into place file by file (a run killed while saving leaves the earlier model whole). Regular files
    an earlier save wrote (its record lists them; SAVED_FILE's names) and this one does not are removed, no other."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        staging = os.path.join(output_dir, ".saving")
        refuse_links(output_dir, [])
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was cut short
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        saved = os.listdir(staging) + [RECORD]
        write_json(os.path.join(staging, RECORD), {**record, "files": sorted(saved)})
        fsync_tree(staging)
        listed = (read_record(output_dir) or {}).get("files")
        ignored = []
        for name in listed if isinstance(listed, list) else []:
            if name in saved:
                continue
            earlier = own_path(output_dir, name, SAVED_FILE)
            if earlier:  # an earlier save's file (its record names it) not written now
                with contextlib.suppress(FileNotFoundError):
                    os.remove(earlier)
            elif not (isinstance(name, str) and SAVED_FILE.fullmatch(name)
                      and not os.path.lexists(os.path.join(output_dir, name))):  # (one removed already: nothing to do)
                ignored.append(name)
        if ignored:
            print(f"{os.path.join(output_dir, RECORD)} lists {len(ignored)} names that are no files of a save there "
                  f"({', '.join(map(repr, ignored[:3]))}): left alone")
        for name in sorted(saved, key=lambda name: name == RECORD):  # the record last: it says the folder is complete
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        os.rmdir(staging)
        fsync_tree(output_dir)
    except WRITE_ERRORS as error:
        stop_after_failed_write(error, os.path.join(output_dir, ".saving"), f"the model to {output_dir!r}",
                                f"{output_dir!r} keeps what it held")

def save_engine_folder(engine, tokenizer, output_dir: str, record: dict, merge_lora: bool = False) -> None:
    """save_model_folder of an engine's model, its weights copied to rank 0's CPU memory first (whole_state_dict: under
    ZeRO-3 one layer gathered at a time), with merge_lora its LoRA adapters folded in; every rank takes part."""
    is_main = dist.get_rank() == 0
    state = whole_state_dict(engine.module, engine.zero_optimization_stage() == 3, is_main, merge_lora)
    if is_main:
        save_model_folder(engine.module, tokenizer, output_dir, record, state)

def start_tensorboard(run_name: str, args, purge_step: int | None = None) -> SummaryWriter:
    """Rank 0's tensorboard writer in runs/RUN_NAME with the hyperparameters (Args) as a table, mirrored to wandb with
    --track; purge_step: a resumed run drops the events its killed predecessor logged from that step on."""
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, name=run_name, config=asdict(args), sync_tensorboard=True)
    writer = SummaryWriter(os.path.join("runs", run_name), purge_step=purge_step)
    table = "\n".join(f"|{name}|{value}|" for name, value in asdict(args).items())
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    return writer

# --- A DeepSpeed engine's state on disk, for --resume: weights, Adam's moments and step, the scheduler, in ---
# --- safetensors (nothing that a load would unpickle); checkpoints renamed into place once complete. ---
def save_weights(engine, path: str, is_main: bool) -> None:
    """A frozen engine's parameters, whole (every rank takes part; rank 0 writes), in PATH/model.safetensors."""
    weights = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters(param, enabled=engine.zero_optimization_stage() == 3):
            if is_main:
                weights[name] = param.detach().cpu().clone()
    if is_main:
        os.makedirs(path, exist_ok=True)
        safetensors.torch.save_file(weights, os.path.join(path, "model.safetensors"))

def load_weights(engine, weights: dict[str, torch.Tensor]) -> None:
    """The inverse of save_weights: every parameter set from `weights`, under ZeRO-3 into every rank's partition."""
    for name, param in engine.module.named_parameters():
        with torch.no_grad(), deepspeed.zero.GatheredParameters(
                param, modifier_rank=0, enabled=engine.zero_optimization_stage() == 3):
            param.data.copy_(weights[name])

def torch_optimizer(engine):
    """The torch optimizer inside an engine (its state holds Adam's step): under ZeRO or bf16 the private `optimizer`
    of DeepSpeed's wrapper, else the engine's own (DeepSpeed 0.19.8, test_killed_run_resumes_to_the_same_metrics)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)

def local_master(engine, param) -> torch.Tensor | None:
    """Under ZeRO-0, the fp32 tensor that the torch optimizer steps and keys its state by, whole on every rank: in
    fp32 the parameter itself, in fp16 its copy in DeepSpeed's FP16_UnfusedOptimizer (its fp16_groups and
    fp32_groups, DeepSpeed 0.19.8). None where DeepSpeed's tensor-fragment API assembles it (ZeRO 1-3, bf16)."""
    optimizer = engine.optimizer
    if optimizer is torch_optimizer(engine):
        return param
    if isinstance(optimizer, deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer):
        for fp16_group, fp32_group in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            for fp16, fp32 in zip(fp16_group, fp32_group):
                if fp16 is param:
                    return fp32
    return None

def master_weight(engine, param) -> torch.Tensor:
    """A parameter whole, as the optimizer holds it: the fp32 master copy that DeepSpeed keeps under bf16, fp16 or
    ZeRO (the module's weight is its rounded or partitioned copy); a frozen parameter's module weight, gathered."""
    if not param.requires_grad or engine.optimizer is None:
        with deepspeed.zero.GatheredParameters(param, enabled=engine.zero_optimization_stage() == 3):
            return param.detach().float().clone()
    master = local_master(engine, param)
    return master.detach().float() if master is not None else deepspeed.utils.safe_get_full_fp32_param(param)

def merged_master_weight(engine, name: str) -> torch.Tensor:
    """The fp32 master of weight NAME of the plain model (whole_state_dict's names with merge_lora) of an engine whose
    model may carry LoRA adapters: for an adapted layer's weight W + (alpha / r) B A, from the masters of all three."""
    layer_name, _, kind = name.rpartition(".")
    layer = engine.module.get_submodule(layer_name)
    if not isinstance(layer, peft.tuners.lora.LoraLayer):
        return master_weight(engine, engine.module.get_parameter(name))
    value = master_weight(engine, getattr(layer.base_layer, kind))
    if kind == "weight":
        delta = master_weight(engine, layer.lora_B["default"].weight) @ \
            master_weight(engine, layer.lora_A["default"].weight)
        value = value + layer.scaling["default"] * peft.utils.transpose(delta, layer.fan_in_fan_out)
    return value

def link_optimizer_states(engine) -> None:
    """DeepSpeed 0.19.8's ZeRO-1/2 and bf16 optimizers link each parameter to its slice of Adam's moments once, right
    after the first parameter group's first step: a second group's moments (LoRA's adapters) do not exist yet and stay
    unlinked, and safe_get_full_optimizer_state fails on them. Linked again here, after every group has stepped."""
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()

def changed_settings(saved: dict, args, may_change: list[str]) -> list[str]:
    """The flags of this run whose values differ from those a checkpoint was written with, but for MAY_CHANGE, and
    the number of ranks (the fields that follow from it are in MAY_CHANGE)."""
    changed = [f"--{name.replace('_', '-')} {saved[name]!r} (now {value!r})" for name, value in asdict(args).items()
               if name not in may_change and name in saved and saved[name] != value]
    if saved.get("world_size", args.world_size) != args.world_size:
        changed.append(f"the number of ranks {saved['world_size']} (now {args.world_size})")
    return changed

def checkpoint_problem(checkpoint: str, engines: dict, frozen: set) -> str | None:
    """Why --resume cannot continue from CHECKPOINT, or None: the safetensors files in it (each rank's own ones among
    them: every rank reads all, so that all choose the same checkpoint) must read, and each engine's folder must hold
    whole safetensors files with a tensor for every parameter, and Adam's two moments of each unless it is FROZEN."""
    for file in sorted(os.listdir(checkpoint)):
        try:
            if file.endswith(".safetensors"):
                safetensors.torch.load_file(os.path.join(checkpoint, file))
        except (OSError, safetensors.SafetensorError):
            return f"{file} is damaged"
    for folder, engine in engines.items():
        problem = engine_state_problem(os.path.join(checkpoint, folder), engine, folder not in frozen)
        if problem is not None:
            return problem
    return None

def save_training_state(engine, path: str, is_main: bool) -> dict:
    """For --resume: fp32 master weights (model.safetensors) and Adam's moments (adam.safetensors) of the trained
    parameters, whole, by the engine's names (every rank takes part, rank 0 writes); a frozen one (LoRA's base weights)
    only its fp32 weight. Returns the optimizer's step, the scheduler's state and in fp16 the loss scale's."""
    base_optimizer = torch_optimizer(engine)
    link_optimizer_states(engine)
    weights, moments = {}, {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:  # the optimizer never had it: no master copy, no moments
            weight = master_weight(engine, param)
            if is_main:
                weights[name] = weight.cpu().contiguous()
            continue
        master = local_master(engine, param)
        if master is not None:
            state = base_optimizer.state[master]
            master, exp_avg, exp_avg_sq = master.detach(), state["exp_avg"], state["exp_avg_sq"]
        else:
            master = deepspeed.utils.safe_get_full_fp32_param(param)
            exp_avg = deepspeed.utils.safe_get_full_optimizer_state(param, "exp_avg")
            exp_avg_sq = deepspeed.utils.safe_get_full_optimizer_state(param, "exp_avg_sq")
        if is_main:
            weights[name] = master.cpu().contiguous()
            moments[f"{name}.exp_avg"] = exp_avg.cpu().contiguous()
            moments[f"{name}.exp_avg_sq"] = exp_avg_sq.cpu().contiguous()
    if is_main:
        os.makedirs(path, exist_ok=True)
        safetensors.torch.save_file(weights, os.path.join(path, "model.safetensors"))
        safetensors.torch.save_file(moments, os.path.join(path, "adam.safetensors"))
    adam_step = int(next(iter(base_optimizer.state.values()))["step"])
    return {"adam_step": adam_step, "scheduler": engine.lr_scheduler.state_dict(), "loss_scale": loss_scale(engine)}

LOSS_SCALE_FIELDS = ["cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"]

def loss_scaler(engine):
    """What holds fp16's loss scale in the engine's optimizer (ZeRO 1-3: loss_scaler; ZeRO-0: loss_scale_config), or
    None without fp16 (DeepSpeed 0.19.8, no public API; test_mixed_precision_resume_keeps_master_weights_and_scale)."""
    optimizer = engine.optimizer
    return (getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)) \
        if engine.fp16_enabled() else None

def loss_scale(engine) -> dict | None:
    """The dynamic loss scale's state (the scale, the steps since the last overflow, the hysteresis), for --resume."""
    scaler = loss_scaler(engine)
    return None if scaler is None else {name: getattr(scaler, name) for name in LOSS_SCALE_FIELDS
                                        if hasattr(scaler, name)}

def load_training_state(engine, path: str, saved: dict, device: torch.device) -> None:
    """Restore what save_training_state wrote into an engine built as at the start: weights (the model's, in its dtype,
    and under bf16 or ZeRO the fp32 master copy), Adam's moments and step count, the learning rate, and in fp16 the
    loss scale."""
    # Adam's moments appear at the first step: one with lr 0 and zero gradients makes them; all is overwritten below.
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(engine(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device)).logits.sum() * 0.0)
        engine.step()
    link_optimizer_states(engine)
    weights = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    load_weights(engine, weights)
    moments = safetensors.torch.load_file(os.path.join(path, "adam.safetensors"))
    base_optimizer = torch_optimizer(engine)
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:  # frozen: load_weights has set it, and the optimizer has nothing of it
            continue
        master = local_master(engine, param)
        if master is None:
            deepspeed.utils.safe_set_full_fp32_param(param, weights[name].to(device))
        elif master is not param:  # fp16 at ZeRO-0: the fp32 copy (load_weights set the module's fp16 one)
            master.data.copy_(weights[name])
        for moment in ("exp_avg", "exp_avg_sq"):
            if master is not None:
                base_optimizer.state[master][moment].copy_(moments[f"{name}.{moment}"])
            else:
                deepspeed.utils.safe_set_full_optimizer_state(param, moments[f"{name}.{moment}"].to(device), moment)
    for state in base_optimizer.state.values():
        state["step"] = torch.full_like(state["step"], saved["adam_step"]) if torch.is_tensor(state["step"]) \
            else saved["adam_step"]
    engine.lr_scheduler.load_state_dict(saved["scheduler"])
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr
    for name, value in (saved.get("loss_scale") or {}).items():  # fp16: after the steps above, which moved it
        setattr(loss_scaler(engine), name, value)

def engine_state_problem(folder: str, engine, trained: bool) -> str | None:
    """Why FOLDER cannot restore ENGINE (model.safetensors, and adam.safetensors of its trained parameters if trained,
    whole and complete: a tensor of each parameter's name and whole shape, ds_shape under ZeRO-3)."""
    shapes = {name: list(getattr(param, "ds_shape", param.shape)) for name, param in engine.module.named_parameters()}
    files = {"model.safetensors": shapes}
    if trained:
        files["adam.safetensors"] = {f"{name}.{moment}": shapes[name] for name, param in
                                     engine.module.named_parameters() if param.requires_grad
                                     for moment in ("exp_avg", "exp_avg_sq")}
    for file, expected in files.items():
        try:
            with safetensors.safe_open(os.path.join(folder, file), "pt") as f:
                if set(f.keys()) != set(expected) or any(f.get_slice(name).get_shape() != shape
                                                         for name, shape in expected.items()):
                    return f"{os.path.basename(folder)}/{file} does not hold this model's parameters (their names " \
                           "and shapes)"
        except (OSError, safetensors.SafetensorError) as error:
            return f"{os.path.basename(folder)}/{file}: {' '.join(str(error).split())[:200]}"
    return None

def same_layout(value, template) -> bool:
    """Whether VALUE, read back from a JSON file (untrusted), has TEMPLATE's layout: the same keys, list lengths and
    kinds of values (a number for a number, a bool for a bool, text for text), all the way down."""
    if isinstance(template, dict):
        return isinstance(value, dict) and value.keys() == template.keys() and \
            all(same_layout(value[key], template[key]) for key in template)
    if isinstance(template, (list, tuple)):
        return isinstance(value, list) and len(value) == len(template) and all(map(same_layout, value, template))
    if isinstance(template, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(template, bool)
    if isinstance(template, (int, float)):
        return isinstance(value, (int, float)) and math.isfinite(value)
    return type(value) is type(template)

def complete_checkpoints(checkpoint_dir: str) -> list[str]:
    """The complete checkpoints (renamed from .tmp) in CHECKPOINT_DIR, newest first, the one `latest` names first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    names = sorted((name for name in os.listdir(checkpoint_dir)
                    if own_path(checkpoint_dir, name, ITERATION_FOLDER, is_dir=True)),
                   key=lambda name: int(name.removeprefix("iteration_")), reverse=True)
    with contextlib.suppress(OSError), open(os.path.join(checkpoint_dir, "latest")) as f:
        latest = f.read().strip()
        if latest in names:
            names.insert(0, names.pop(names.index(latest)))
    return [os.path.join(checkpoint_dir, name) for name in names]

def commit_checkpoint(path: str) -> None:
    """Rank 0: PATH.tmp flushed and renamed to PATH, then named in `latest`; one older kept (if latest is damaged)."""
    checkpoint_dir = os.path.dirname(path)
    fsync_tree(path + ".tmp")
    refuse_links(checkpoint_dir, [os.path.basename(path)])
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".tmp", path)
    with open_own(os.path.join(checkpoint_dir, "latest.tmp")) as f:
        f.write(os.path.basename(path))
    fsync_tree(checkpoint_dir)
    os.replace(os.path.join(checkpoint_dir, "latest.tmp"), os.path.join(checkpoint_dir, "latest"))
    fsync_tree(checkpoint_dir)
    keep = [os.path.basename(c) for c in complete_checkpoints(checkpoint_dir)[:2]]
    ours = re.compile(ITERATION_FOLDER.pattern + r"(\.tmp)?")  # older checkpoints, and the folder of one cut short
    for old in os.listdir(checkpoint_dir):
        if old not in keep and own_path(checkpoint_dir, old, ours, is_dir=True):
            shutil.rmtree(os.path.join(checkpoint_dir, old))

def remove_earlier_runs(folder: str, run_name: str, record_of) -> None:
    """Rank 0, as a run writes into FOLDER (snapshots/, resume/): each iteration_N folder whose record (record_of(path))
    names another run of this script goes; nothing else does. An earlier run's work stays until then."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = own_path(folder, name, ITERATION_FOLDER, is_dir=True)
        if path and (record_of(path) or {}).get("run_name") not in (None, run_name):
            shutil.rmtree(path)

def run_metrics_file(record: dict) -> str | None:
    """The metrics file a folder's record names if it is runs/RUN_NAME/metrics.jsonl (absolute) of the record's run, a
    regular file or none yet; else None (a path read back from an output folder is untrusted)."""
    named, run_name = record.get("metrics_file"), record.get("run_name")
    if not (isinstance(named, str) and isinstance(run_name, str) and RUN_NAME.fullmatch(run_name)
            and os.path.isabs(named) and named.split(os.sep)[-3:] == ["runs", run_name, "metrics.jsonl"]):
        return None
    regular = own_path(os.path.dirname(named), "metrics.jsonl", re.compile(r"metrics\.jsonl"))
    return named if regular or not os.path.lexists(named) else None

def continue_metrics_file(path: str, iteration: int) -> None:
    """On --resume, the metrics.jsonl keeps the lines up to the checkpoint's ITERATION: not later or cut-short ones."""
    if not os.path.lexists(path):
        return
    kept = []
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:  # never through a link
            for line in f:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    if json.loads(line)["iteration"] <= iteration:
                        kept.append(line if line.endswith("\n") else line + "\n")
        with open_own(path + ".tmp") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    except OSError as error:
        fail(f"cannot continue {path!r} ({error.strerror}); {write_fix(error)} and run again")

def found_overflow(engine) -> bool:
    """Whether this accumulation's fp16 gradients hold inf or NaN, the way the engine's optimizer will see it in
    step() (a collective call: every rank takes part). Private DeepSpeed attributes (0.19.8)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow_checker"):  # ZeRO-0: FP16_Optimizer, FP16_UnfusedOptimizer
        return optimizer.overflow_checker.check()
    return optimizer.has_overflow(partition_gradients=getattr(optimizer, "partition_gradients", True))  # ZeRO 1-3
