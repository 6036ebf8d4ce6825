"""Model folders, tokenizers and DeepSpeed engines: loaded or refused with one line; ZeRO-3 weights gathered; LoRA."""

import contextlib
import difflib
import json
import os
import re

import deepspeed
import peft
import safetensors.torch
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import AutoConfig, AutoTokenizer

from .processes import fail


# The bundled toy task (its base model, data and pretraining text): the stages' defaults, found from any working folder.
TOY_TASK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "toy_task")

def is_hub_name(path: str) -> bool:
    """True for `name` or `org/name` that from_pretrained would look up on the hub. Never for a local-looking path:
    the stages' outputs (checkpoints/..., even before they exist), toy_task/..., or a near miss of a folder here
    (chekpoints/sft)."""
    first = path.split("/")[0]
    here = [name for name in os.listdir(".") if os.path.isdir(name)] + ["checkpoints"]
    local = ("/", ".", "~", "checkpoints/", "toy_task/")
    return not (os.path.exists(path) or path.startswith(local) or path.count("/") > 1
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

def load_generating_tokenizer(path: str, flag: str, trust_remote_code: bool):
    """The tokenizer of a model that generates, padding on the left (every prompt then ends where its response starts),
    with an EOS (a response ends with it) and a pad token distinct from it (a pad equal to EOS would hide the real EOS
    in every mask made from padding), or one line naming FLAG."""
    tokenizer = load_tokenizer(path, f"check {flag}", trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id in (None, tokenizer.eos_token_id):
        fail(f"the tokenizer of {path!r} needs an EOS token (a response ends with it) and a pad token distinct from "
             f"it, as a model saved by sft.py has; check {flag}")
    return tokenizer

def check_positions(config, length: int, what: str) -> None:
    """Sequences of LENGTH tokens (WHAT: the flag, or the flags' sum, that makes it) fit the positions of a model of
    this CONFIG."""
    positions = getattr(config, "max_position_embeddings", length)
    if length > positions:
        fail(f"{what} is longer than the model's {positions} positions; lower {'them' if ' + ' in what else 'it'}")

def check_classifier_config(path: str, flag: str, trust_remote_code: bool):
    """The config of a 1-label AutoModelForSequenceClassification (a scalar score), or one line naming FLAG: not a
    causal language model's (its head would start random), not one of other labels (a config.json that names none
    reads as 2 labels)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if any(name.endswith("ForCausalLM") for name in config.architectures or []):
        fail(f"{path!r} is a causal language model, not a 1-label sequence classifier: its score head would start "
             f"random; check {flag}")
    if config.num_labels != 1:
        fail(f"{path!r} must be a 1-label AutoModelForSequenceClassification (its config.json has {config.num_labels} "
             f"labels); check {flag}")
    return config

def load_tokenizer_with_pad(path: str, hint: str, trust_remote_code: bool, is_main: bool, model_path: str):
    """The tokenizer (each token with a row in the embeddings of the model at MODEL_PATH), with an EOS and a pad token
    distinct from it (a pad equal to EOS would mask the real EOS: DeepSpeed-Chat's trap), and whether the pad was
    added (the model's embeddings must then grow)."""
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
    """Every token of TOKENIZER but the ADDED ones (the caller resizes for them) has a row in the embeddings of the
    model at PATH (config.json's vocab_size): one without would stop the run with an IndexError deep inside it."""
    rows = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config().vocab_size
    if len(tokenizer) - added > rows:
        fail(f"the tokenizer has {len(tokenizer) - added} tokens but the model in {path!r} embeds only {rows}: tokens "
             "were added to it without model.resize_token_embeddings(len(tokenizer)); resize the model's embeddings "
             f"and save it with its tokenizer, or {hint}")

def check_embedding_rows(flag: str, path: str, readers: dict[str, str], trust_remote_code: bool) -> None:
    """The model at PATH (FLAG) samples from every row of its output layer (config.json's vocab_size, padding rows
    included): each model that reads those ids (READERS: flag -> path) must embed them all (as check_vocabulary)."""
    def rows(folder):
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).get_text_config().vocab_size
    sampled = rows(path)
    for reader_flag, reader in readers.items():
        if (embedded := rows(reader)) < sampled:
            fail(f"{flag} {path!r} samples token ids from {sampled} rows, but {reader_flag} {reader!r} embeds only "
                 f"{embedded}: an id past them would stop the run; give models of one vocabulary size (resize "
                 f"the smaller one's embeddings with model.resize_token_embeddings({sampled}) and save it)")

def check_tokens(policy: str, policy_flag: str, scorer: str, scorer_flag: str, readers: dict[str, str],
                 trust_remote_code: bool) -> tuple:
    """A model that samples and the models that read what it samples, checked before any loads. Returns the POLICY's
    tokenizer (load_generating_tokenizer) and the SCORER's if its tokens are others (load_other_tokenizer: each text
    is then tokenized again for it), else None. Each tokenizer fits its model's embeddings (check_vocabulary), and each
    model that reads the policy's ids (READERS: flag -> path, and a scorer of the same tokens) embeds every row that
    the policy samples from (check_embedding_rows)."""
    tokenizer = load_generating_tokenizer(policy, policy_flag, trust_remote_code)
    scorer_tokenizer = load_other_tokenizer(scorer, f"check {scorer_flag}", tokenizer, trust_remote_code)
    check_vocabulary(tokenizer, policy, f"check {policy_flag}", trust_remote_code)
    if scorer_tokenizer is None:
        readers = {**readers, scorer_flag: scorer}
    else:
        check_vocabulary(scorer_tokenizer, scorer, f"check {scorer_flag}", trust_remote_code)
        if os.environ.get("RANK", "0") == "0":  # the global rank: once per run
            print(f"{scorer_flag} {scorer!r} has another tokenizer than {policy_flag}: every prompt + response is "
                  "decoded to text and tokenized again for it")
    check_embedding_rows(policy_flag, policy, readers, trust_remote_code)
    return tokenizer, scorer_tokenizer

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
    """Prompt + response [B, P + R] in TOKENIZER's tokens as a model with OTHER_TOKENIZER (None: the same) reads them:
    each decoded and tokenized again as the stages tokenize their data (EOS where the response has one, no other
    special token), padded left and right again -> (sequences [B, P' + R'], attention_mask, P')."""
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

def adamw(model, lr: float, weight_decay: float, adapter_lr: float = 0.0):
    """torch's fused AdamW over a model's trained parameters (one kernel for all, on the GPU, or on the CPU where
    --offload puts the step), LoRA's adapters (add_lora) in a group of their own at ADAPTER_LR."""
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    groups = [{"params": [param for name, param in trained if ("lora_" in name) == adapters],
               "lr": adapter_lr if adapters else lr} for adapters in (False, True)]
    return torch.optim.AdamW([group for group in groups if group["params"]], lr=lr, weight_decay=weight_decay,
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
    """Under ZeRO-3, for no-gradient work (TRL's unwrap_model_for_generation): a model's weights gathered whole once (one
    coalesced all-gather) and DeepSpeed's hooks off, not gathered layer by layer for every token. The hooks come back
    into their modules' hook tables as they were (registered anew, DeepSpeed would forget the module order it traced
    and stop prefetching). No public API: the hook handles of the parameter coordinator and the engine, torch's hook
    tables, ds_active_sub_modules (DeepSpeed 0.19.8; test_gathered_rollout_weights_are_whole_and_hooks_come_back)."""
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
    """MODEL's state dict, whole, in rank 0's CPU memory (is_main; others get {}); with merge_lora a plain model's (W +
    (alpha / r) B A under W's name). Under ZeRO-3 (zero3: every rank takes part) one tensor or adapted layer is
    gathered at a time. Tied weights stay one tensor."""
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

@contextlib.contextmanager
def aligned_overflow(engines: list, enabled: bool):
    """Around the engines' step() calls (DeepSpeed-Chat's align_overflow): in fp16 an optimizer whose gradients
    overflow skips its step, and the engines would drift a step apart. When one overflowed, the others see an
    overflow for this step and take DeepSpeed's own skip path (no update, no scheduler step, the loss scale kept).
    No API for it (DeepSpeed-Chat's skip_step is gone): the optimizers' private overflow checks are shadowed for one
    step (DeepSpeed 0.19.8, ZeRO 0-3; test_align_overflow_skips_both_steps)."""
    if not enabled or not engines[0].is_gradient_accumulation_boundary():
        yield
        return
    overflows = [found_overflow(engine) for engine in engines]
    patched = []  # (object, method name): instance attributes that shadow the class's methods for this one step
    for engine, overflow in zip(engines, overflows):
        if any(overflows) and not overflow:
            optimizer = engine.optimizer
            checker = getattr(optimizer, "overflow_checker", optimizer)  # ZeRO-0 asks its checker, ZeRO 1-3 themselves
            for name in ("has_overflow", "check", "check_using_norm"):
                if hasattr(checker, name):
                    setattr(checker, name, lambda *args, **kwargs: True)
                    patched.append((checker, name))
            optimizer._update_scale = lambda *args, **kwargs: None
            patched.append((optimizer, "_update_scale"))
    try:
        yield
    finally:
        for obj, name in patched:
            delattr(obj, name)

def found_overflow(engine) -> bool:
    """Whether this accumulation's fp16 gradients hold inf or NaN, the way the engine's optimizer will see it in
    step() (a collective call: every rank takes part). Private DeepSpeed attributes (0.19.8)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow_checker"):  # ZeRO-0: FP16_Optimizer, FP16_UnfusedOptimizer
        return optimizer.overflow_checker.check()
    return optimizer.has_overflow(partition_gradients=getattr(optimizer, "partition_gradients", True))  # ZeRO 1-3
