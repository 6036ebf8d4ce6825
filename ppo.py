"""Stage 3 of PPO-RLHF: PPO with four models, the whole loop inline.

    actor      the policy pi_theta, from the SFT checkpoint (stage 1)          trained
    reference  pi_ref, the same SFT checkpoint                                  frozen: the KL penalty's anchor
    critic     the value function V(s_t), from the reward model (stage 2)      trained
    reward     the reward model r(x, y) (stage 2)                               frozen

Each model is its own DeepSpeed engine with its own config and ZeRO stage, as in DeepSpeed-Chat's RLHF engine. Each
iteration samples responses to a batch of prompts (the rollout), scores them, turns scores and the KL penalty into
per-token rewards and GAE advantages, then takes a few epochs of clipped PPO updates of actor and critic. The math is
in rlhf_math.py; its docstring shows the layout of one sequence (which position holds which log-prob and value).
DeepSpeed-Chat's extras (an EMA of the actor, LoRA, the pretraining mix, fp16 overflow alignment, the hybrid engine)
are off by default, each behind its flag.

    python ppo.py                                          # the bundled toy task, a few minutes on a laptop CPU
    deepspeed --num_gpus 2 ppo.py --actor-zero-stage 3     # the same, on 2 ranks, the actor under ZeRO-3
"""

import atexit
import contextlib
import difflib
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Annotated, Literal, get_type_hints

import datasets
import deepspeed
import numpy as np
import peft
import safetensors.torch
import torch
import torch.distributed as dist
import tyro
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from rich.console import Console
from rich.table import Table
from torch.utils.tensorboard import SummaryWriter
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    get_scheduler,
)
from transformers.integrations import HfDeepSpeedConfig

import rlhf_math


# Ranges that check_args enforces, read from each field's annotation: "--total-episodes must be at least 1".
PositiveInt = Annotated[int, "be at least 1"]
CountInt = Annotated[int, "not be negative"]
PositiveFloat = Annotated[float, "be positive"]
NonNegativeFloat = Annotated[float, "not be negative"]
Fraction = Annotated[float, "be between 0 and 1"]
RANGES = {"be at least 1": lambda v: v >= 1, "be positive": lambda v: v > 0, "not be negative": lambda v: v >= 0,
          "be between 0 and 1": lambda v: 0 <= v <= 1}


@dataclass
class Args:
    # Experiment
    exp_name: str = "ppo"
    """the name of this experiment, the first part of the run name"""
    seed: int = 1
    """seed of the experiment (prompt order, sampling)"""
    output_dir: str = "checkpoints/ppo"
    """where the trained actor and critic are saved (actor/, critic/), and the checkpoints for --resume (resume/); a
    new or empty folder, or one that ppo.py wrote before"""

    # Models and data
    actor_model_name_or_path: str = "checkpoints/sft"
    """the SFT model (stage 1): the actor and the reference start from it"""
    reward_model_name_or_path: str = "checkpoints/reward_model"
    """the reward model (stage 2), frozen; its config's `reward_mean` is subtracted from its scores. One with another
    tokenizer than the actor's reads each prompt + response decoded to text and tokenized again"""
    critic_model_name_or_path: str | None = None
    """where the critic starts; when not set, the reward model, or, if the reward model has another tokenizer, the
    actor with a fresh value head (the critic reads the actor's tokens)"""
    dataset: str = "toy_task/data"
    """a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder; only prompts are used"""
    train_split: str = "train"
    """the split whose prompts are sampled"""
    prompt_column: str = "prompt"
    """the column that holds the prompt: text, or a list of {"role", "content"} chat messages (the
    tokenizer's chat template makes it a prompt)"""
    split_conversations: bool = False
    """the hh-rlhf layout: each cell of --prompt-column (pass --prompt-column chosen) holds the whole conversation, and the prompt is its text up to and including the
    last --assistant-marker"""
    assistant_marker: str = "\n\nAssistant:"
    """where the last assistant turn opens in a whole conversation (--split-conversations)"""
    max_prompt_len: PositiveInt = 32
    """longest prompt in tokens; longer prompts are dropped (and counted), never truncated"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""

    # Rollout
    total_episodes: PositiveInt = 4096
    """prompts answered over the whole run; iterations = total_episodes / batch_size"""
    per_device_rollout_batch_size: PositiveInt = 64
    """prompts per rank per iteration"""
    max_new_tokens: PositiveInt = 24
    """longest response; a response that reaches it without EOS is cut there"""
    temperature: PositiveFloat = 1.0
    """sampling temperature; the log-probs are computed at the same temperature"""
    min_response_tokens: int = 1
    """responses with fewer real tokens (EOS not counted) are invalid and left out of the update"""
    missing_eos_penalty: float | None = None
    """the EOS trick: a response that never generated EOS gets the score -MISSING_EOS_PENALTY instead of the reward
    model's (off by default, as in TRL)"""

    # PPO
    num_ppo_epochs: PositiveInt = 1
    """passes of PPO updates over each rollout batch (TRL's default is 4; one pass of 4 mini-batches keeps the toy run
    under 2 minutes)"""
    num_mini_batches: PositiveInt = 4
    """optimizer steps per PPO epoch: the rollout batch is split into this many mini-batches"""
    per_device_train_batch_size: PositiveInt = 16
    """sequences per rank per forward pass, in the update (gradient accumulation fills a mini-batch) and in the
    rollout's scoring passes"""
    actor_learning_rate: PositiveFloat = 2e-4
    """actor learning rate, decayed linearly to 0 (the toy default; real models of 1B parameters want about 3e-6)"""
    critic_learning_rate: PositiveFloat = 1e-4
    """critic learning rate, decayed linearly to 0"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """the learning rates of actor and critic: decayed linearly to 0 over the run, or constant"""
    weight_decay: float = 0.0
    """AdamW weight decay of actor and critic"""
    gradient_clipping: float = 1.0
    """clip each trained model's gradient norm to this"""
    kl_coef: NonNegativeFloat = 0.1
    """beta, the coefficient of the per-token KL penalty (the initial value, with --target-kl)"""
    target_kl: Annotated[float | None, "be positive"] = None
    """turn on Ziegler et al.'s adaptive KL controller, which steers the mean KL per response toward this"""
    kl_horizon: PositiveFloat = 10000
    """horizon of the adaptive KL controller, in episodes"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """the per-token KL estimator of the penalty (see rlhf_math.kl_per_token)"""
    clip_score: PositiveFloat = 5.0
    """the normalized score is clipped to [-clip_score, clip_score] (in standard deviations of the SFT policy's scores)"""
    cliprange: PositiveFloat = 0.2
    """epsilon, PPO's clip range of the probability ratio"""
    cliprange_value: PositiveFloat = 0.2
    """the value function's clip range around the rollout's values"""
    gamma: Fraction = 1.0
    """discount factor"""
    lam: Fraction = 0.95
    """GAE lambda"""
    whiten_advantages: bool = True
    """whiten the advantages over the rollout batch (--no-whiten-advantages for DeepSpeed-Chat's behaviour)"""
    whiten_rewards: bool = False
    """scale the per-token rewards to unit variance over the rollout batch, keeping their mean"""
    whiten_across_ranks: bool = True
    """whiten over the whole batch, all ranks together; --no-whiten-across-ranks whitens each rank's share on its own,
    as TRL does (with few responses per rank that erases which of them was good)"""
    loss_aggregation: Literal["token-mean", "micro-batch-mean"] = "token-mean"
    """how the policy and value losses average over tokens: token-mean, every in-mask token of a mini-batch (all its
    micro-batches, all ranks) weighs the same; micro-batch-mean, the mean over the micro-batches of each one's token
    mean, as DeepSpeed-Chat and TRL do (a short micro-batch's tokens weigh more)"""

    # Logging and checkpoints
    track: bool = False
    """log to Weights & Biases (tensorboard logs and metrics.jsonl are always written to runs/RUN_NAME/)"""
    wandb_project_name: str = "ppo-rlhf"
    """the wandb project, with --track"""
    sample_every: CountInt = 10
    """print a table of a few prompts, responses and scores every this many iterations (0: never)"""
    save_every: CountInt = 0
    """write a checkpoint of actor, critic and their optimizers every this many iterations, for --resume (0: never)"""
    snapshot_every: CountInt = 0
    """save the actor as a Hugging Face folder in OUTPUT_DIR/snapshots/iteration_N every this many iterations and at
    the last (0: never), for evaluate.py's picture of reward-model and gold scores along training"""
    resume: bool = False
    """continue the unfinished run in OUTPUT_DIR from its latest complete checkpoint (or, if that one is damaged, the
    one before), with the settings it started with: a changed setting is refused, except --save-every,
    --sample-every, --snapshot-every, --track, --wandb-project-name, --actor-zero-stage, --critic-zero-stage,
    --offload, --offload-reference-model, --offload-reward-model, --gather-weights-for-rollout,
    --actor-gradient-checkpointing, --critic-gradient-checkpointing, --release-inference-cache,
    --unpin-actor-parameters and --tp-gather-partition-size, which change how the run is saved, logged or laid out
    in memory, not what it computes"""
    overwrite: bool = False
    """write into a non-empty --output-dir that ppo.py did not write (files and folders of the names ppo.py writes are
    replaced, nothing else is deleted), or start a new run in one that holds checkpoints of an unfinished run (they
    are deleted)"""

    # DeepSpeed-Chat's extras, each off by default: an EMA of the actor, LoRA, the pretraining mix
    enable_ema: bool = False
    """keep an exponential moving average of the actor's weights, saved as OUTPUT_DIR/actor_ema"""
    ema_decay: Fraction = 0.992
    """the EMA's decay per actor optimizer step: ema = decay * ema + (1 - decay) * actor"""
    actor_lora_dim: CountInt = 0
    """rank r of the LoRA adapters added to the actor's linear layers (0: no LoRA)"""
    critic_lora_dim: CountInt = 0
    """rank r of the LoRA adapters added to the critic's linear layers (0: no LoRA)"""
    lora_alpha: PositiveFloat = 16.0
    """LoRA's alpha: an adapter adds (alpha / r) B A to its layer's weight"""
    lora_target_modules: str = "all-linear"
    """the layers that get adapters: peft's "all-linear" (every linear layer but the output head), or a regular
    expression that matches the full module names"""
    actor_lora_learning_rate: PositiveFloat = 5e-4
    """learning rate of the actor's adapters (the rest of the actor keeps --actor-learning-rate)"""
    critic_lora_learning_rate: PositiveFloat = 5e-4
    """learning rate of the critic's adapters"""
    only_optimize_lora: bool = False
    """train only the adapters; the reference model is then the actor with its adapters off, one model less"""
    unsup_dataset: str | None = None
    """plain text for InstructGPT's pretraining mix (PPO-ptx): a hub data set name, or a local .txt/.json/.jsonl/
    .parquet file (the toy task's: toy_task/pretrain.txt)"""
    unsup_dataset_config: str | None = None
    """the hub data set's configuration name, if it has several (e.g. wikitext-2-raw-v1)"""
    unsup_text_column: str = "text"
    """the column that holds the text"""
    unsup_coef: NonNegativeFloat = 27.8
    """gamma, the weight of the language-modelling loss on the plain text (InstructGPT's 27.8)"""

    # DeepSpeed
    actor_zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage of the actor (the reference follows: ZeRO-3 if the actor is, else 0)"""
    critic_zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage of the critic (the reward model follows: ZeRO-3 if the critic is, else 0)"""
    offload: bool = False
    """offload the optimizer states (and, at ZeRO-3, the parameters) of actor and critic to CPU memory"""
    offload_reference_model: bool = False
    """keep the reference model's parameters in CPU memory (ZeRO-3 parameter offload, whatever the actor's stage)"""
    offload_reward_model: bool = False
    """keep the reward model's parameters in CPU memory (ZeRO-3 parameter offload, whatever the critic's stage)"""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """precision of all four models; fp16 needs a GPU"""
    actor_gradient_checkpointing: bool = False
    """recompute the actor's activations in the backward pass: less memory, about a third more compute"""
    critic_gradient_checkpointing: bool = False
    """the same for the critic"""
    disable_dropout: bool = True
    """set every dropout probability of the four models to 0, so that PPO's first ratio is exactly 1"""
    gather_weights_for_rollout: bool = True
    """under ZeRO-3, gather each model's full weights once per rollout (one model at a time) instead of layer by layer
    for every new token and every forward pass (--no-gather-weights-for-rollout for models too large for one device)"""
    align_overflow: bool = False
    """fp16 only (DeepSpeed-Chat's extra): when the actor's or the critic's loss scaler finds an overflow, both skip
    that optimizer step"""
    enable_hybrid_engine: bool = False
    """generate with DeepSpeed's hybrid engine (DeepSpeed-Chat's extra, GPU only): inference kernels and tensor
    parallelism for the rollout"""
    inference_tp_size: PositiveInt = 1
    """hybrid engine: tensor-parallel size of generation"""
    tp_gather_partition_size: PositiveInt = 8
    """hybrid engine: how many layers to gather at a time under ZeRO-3"""
    release_inference_cache: bool = False
    """hybrid engine: free the inference key-value cache after each generation (less memory, slower)"""
    unpin_actor_parameters: bool = False
    """hybrid engine: do not pin the gathered actor parameters in memory during generation (ZeRO-3)"""
    local_rank: int = -1
    """this process's rank on its node, passed by the deepspeed launcher"""

    # Filled in at runtime
    world_size: int = 0
    """number of ranks"""
    batch_size: int = 0
    """episodes per iteration: per_device_rollout_batch_size x world_size"""
    per_device_mini_batch_size: int = 0
    """sequences per rank per optimizer step"""
    gradient_accumulation_steps: int = 0
    """forward passes per optimizer step"""
    num_iterations: int = 0
    """PPO iterations (rollout + update) in the whole run"""


# ---------------------------------------------------------------------------------------------------------------
# PPO's quantities from the models: log-probs, values and scores of a batch of prompt + response sequences. The
# formulas themselves are in rlhf_math.py.
# ---------------------------------------------------------------------------------------------------------------
def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip the left padding of the prompts: 0 at each prompt's first real token, as generate uses."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)

def response_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits that predict each response token: [B, P + R] sequences -> [B, R, V].

    The logits at position P - 1 + t predict the token at position P + t, so they are read one position earlier.
    """
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask),
                use_cache=False)
    return out.logits[:, prompt_len - 1 : -1]

def sampling_config(tokenizer, max_new_tokens: int, temperature: float) -> GenerationConfig:
    """Plain multinomial sampling from the temperature-scaled policy, nothing that would make the sampled distribution
    differ from the one whose log-probs are computed (no top-k, no top-p, no min_new_tokens, which would suppress
    EOS). The pad token is suppressed: a young policy does sample it, and a pad inside a response breaks every mask
    built from padding. (The log-probs keep pad in their softmax; the SFT model never learned to produce pad, so its
    probability, and the difference, is negligible.)"""
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0,
                            top_p=1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            suppress_tokens=[tokenizer.pad_token_id])

def response_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      temperature: float) -> torch.Tensor:
    """log pi(a_t | s_t) of every response token, at the sampling temperature: [B, P + R] sequences -> [B, R]."""
    logits = response_logits(model, sequences, attention_mask, prompt_len)
    return rlhf_math.logprobs_from_logits(logits, sequences[:, prompt_len:], temperature)

def head_at_every_position(model, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A sequence classifier's scalar head applied at every position instead of only the last: [B, T] -> [B, T]."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=sequences, attention_mask=attention_mask,
                      position_ids=position_ids_from(attention_mask), use_cache=False).last_hidden_state
    return model.score(hidden).squeeze(-1).float()

def critic_values(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, mean: float,
                  std: float) -> torch.Tensor:
    """V(s_t) for every response token: the critic's head at position P - 1 + t, the last token of the state before
    a_t, on the normalized reward scale ((output - mean) / std, as the scores). [B, P + R] -> [B, R]."""
    return (head_at_every_position(model, sequences, attention_mask)[:, prompt_len - 1 : -1] - mean) / std

def reward_scores(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, mean: float,
                  std: float) -> torch.Tensor:
    """The normalized score (r(x, y) - mean) / std of each prompt + response: the reward model's head at the last
    in-mask response position (the EOS, or the last token of a response cut at the length limit), where
    rlhf_math.per_token_rewards lands it. [B, P + R] -> [B]."""
    token_scores = head_at_every_position(model, sequences, attention_mask)[:, prompt_len:]
    last = attention_mask[:, prompt_len:].sum(dim=1) - 1
    return (token_scores[torch.arange(len(token_scores), device=token_scores.device), last] - mean) / std

def reward_model_inputs(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, tokenizer,
                        reward_tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompt + response [B, P + R] as the reward model reads them: unchanged when it has the actor's tokenizer
    (reward_tokenizer None); otherwise each prompt and response decoded to text and tokenized again as
    reward_model.py tokenizes its data (EOS appended where the response has one; the actor's special tokens are
    not carried over), left- and right-padded again -> (sequences [B, P' + R'], attention_mask, P')."""
    if reward_tokenizer is None:
        return sequences, attention_mask, prompt_len
    prompts, responses = [], []
    for ids, mask in zip(sequences, attention_mask.bool()):
        prompt, response = ids[:prompt_len][mask[:prompt_len]], ids[prompt_len:][mask[prompt_len:]]
        prompts.append(reward_tokenizer(tokenizer.decode(prompt, skip_special_tokens=True),
                                        split_special_tokens=True)["input_ids"])
        eos = [reward_tokenizer.eos_token_id] if (response == tokenizer.eos_token_id).any() else []
        text = tokenizer.decode(response, skip_special_tokens=True)
        # A response of special tokens only, without EOS, decodes to nothing: its score is read at an EOS.
        responses.append(reward_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                         + eos or [reward_tokenizer.eos_token_id])
    P, R, pad = max(map(len, prompts)), max(map(len, responses)), reward_tokenizer.pad_token_id
    if P + R > reward_tokenizer.model_max_length:
        fail(f"a prompt + response is {P + R} tokens for the reward model, more than its tokenizer's model_max_length "
             f"{reward_tokenizer.model_max_length}; lower --max-prompt-len or --max-new-tokens")
    rows = [[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(prompts, responses)]
    masks = [[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)) for p, r in zip(prompts, responses)]
    return torch.tensor(rows, device=sequences.device), torch.tensor(masks, device=sequences.device), P

def batch_mean_var(x: torch.Tensor, mask: torch.Tensor, across_ranks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of x [B, R] over the in-mask positions of this rank's batch, or of every rank's
    batch together (sums of x, x^2 and the count added over the ranks). (0, 1), which whitens nothing, when fewer
    than two positions are in the mask."""
    x = torch.where(mask.bool(), x.double(), 0.0)
    moments = torch.stack([mask.sum().double(), x.sum(), (x**2).sum()])
    if across_ranks:
        dist.all_reduce(moments)
    n, total, total_squares = moments
    if n < 2:
        return torch.zeros((), device=x.device), torch.ones((), device=x.device)
    mean = total / n
    return mean.float(), ((total_squares - n * mean**2).clamp(min=0) / (n - 1)).float()


def tokens_per_mini_batch(mask: torch.Tensor, mini_batches: list[torch.Tensor]) -> torch.Tensor:
    """The in-mask tokens of each mini-batch, all ranks together: [num_mini_batches]. The update mask is [B, R];
    each mini-batch holds row indices."""
    counts = torch.stack([mask[mini_batch].sum() for mini_batch in mini_batches]).float()
    dist.all_reduce(counts)
    return counts


def loss_weight(mask: torch.Tensor, mini_batch_tokens: torch.Tensor, args: Args):
    """The factor on a micro-batch's token-mean loss (docs/implementation_details.md, detail 38). DeepSpeed divides
    each micro-batch's loss by the accumulation steps and averages the ranks' gradients: a micro-batch gets the
    weight 1 / (micro-batches in the mini-batch, all ranks). token-mean reweighs it to its share of the mini-batch's
    tokens, so that every token weighs the same however the mini-batch is split; micro-batch-mean leaves it
    (DeepSpeed-Chat and TRL)."""
    if args.loss_aggregation != "token-mean":
        return 1.0
    return mask.bool().sum() * args.gradient_accumulation_steps * args.world_size / mini_batch_tokens.clamp(min=1)


def prompts_of_iteration(prompts: list, iteration: int, rank: int, args: Args) -> list:
    """This rank's share of an iteration's prompts. The prompts are shuffled once per pass over the data set, by a
    seed of that pass, so that a resumed run draws the prompts an uninterrupted one would have."""
    batches_per_pass = len(prompts) // args.batch_size
    order = np.random.default_rng([args.seed, iteration // batches_per_pass]).permutation(len(prompts))
    first = (iteration % batches_per_pass) * args.batch_size + rank * args.per_device_rollout_batch_size
    return [prompts[i] for i in order[first : first + args.per_device_rollout_batch_size]]


# ---------------------------------------------------------------------------------------------------------------
# Checks of the arguments, models, data and numbers: a mistake stops the run with one line that says what to fix.
# fail, is_hub_name, check_model_folder, load_pretrained, check_finite_weights, load_tokenizer, load_split, text_of,
# load_prompts and check_finite_args are the same in every stage that has them.
# ---------------------------------------------------------------------------------------------------------------
def fail(message: str) -> None:
    """Stop with a one-line message that says what to fix, instead of a stack trace from inside a library."""
    raise SystemExit(f"ppo.py: error: {message}")

def exact_div(a: int, b: int, what: str) -> int:
    """a / b, which must divide exactly: batch arithmetic is never silently rounded."""
    if b <= 0 or a % b != 0:
        fail(f"{what}: {a} is not divisible by {b}")
    return a // b

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


def check_finite_args(args) -> None:
    """Every float flag must be a number: inf or nan slip through `> 0` checks."""
    for field in fields(args):
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{field.name.replace('_', '-')} must be a finite number, not {value}")


def check_args(args: Args) -> None:
    """Bad flags stop the script here, with a message that names them, before anything is loaded. The ranges are
    read from the fields' annotations (PositiveInt, Fraction, ...)."""
    for name, hint in get_type_hints(Args, include_extras=True).items():
        value = getattr(args, name)
        for rule in getattr(hint, "__metadata__", ()):
            if value is not None and not RANGES[rule](value):
                fail(f"--{name.replace('_', '-')} must {rule}, not {value}")
    if args.missing_eos_penalty is not None and not 0 < args.missing_eos_penalty <= args.clip_score:
        fail(f"--missing-eos-penalty {args.missing_eos_penalty} must be in (0, --clip-score {args.clip_score}]: "
             "the score it replaces is clipped to [-clip_score, clip_score]")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed must be between 0 and 2**32 - 1, not {args.seed}")
    if os.path.isfile(args.output_dir):
        fail(f"--output-dir {args.output_dir!r} is a file; name a folder")
    if args.only_optimize_lora and not args.actor_lora_dim:
        fail("--only-optimize-lora needs the actor's adapters: set --actor-lora-dim (and --critic-lora-dim for the "
             "critic's)")
    if args.align_overflow and args.dtype != "fp16":
        fail("--align-overflow is for --dtype fp16 (a GPU's loss-scaled training); bf16 and fp32 do not overflow")
    if args.enable_hybrid_engine and (args.actor_lora_dim or args.critic_lora_dim):
        fail("--enable-hybrid-engine does not support LoRA: DeepSpeed's hybrid engine knows only DeepSpeed-Chat's "
             "own LoRA layers, not peft's")
    if args.inference_tp_size > 1 and not (args.enable_hybrid_engine and args.actor_zero_stage == 3):
        fail("--inference-tp-size above 1 needs --enable-hybrid-engine and --actor-zero-stage 3")
    check_finite_args(args)


def check_models(args: Args, is_main: bool):
    """The three model folders and their tokenizers, checked before any model loads. Returns the actor's tokenizer,
    which pads prompts on the left (its pad token must not be EOS: stage 1 makes sure), the reward model's when it
    is another (else None), and the critic's folder. Prompt + response must fit the model's positions."""
    check_model_folder(args.actor_model_name_or_path, "run sft.py first or check --actor-model-name-or-path")
    check_model_folder(args.reward_model_name_or_path,
                       "run reward_model.py first or check --reward-model-name-or-path")
    tokenizer = load_tokenizer(args.actor_model_name_or_path, "check --actor-model-name-or-path",
                               args.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        fail(f"the tokenizer of {args.actor_model_name_or_path!r} needs a pad token distinct from EOS; "
             "a model saved by sft.py has one")
    reward_tokenizer = load_tokenizer(args.reward_model_name_or_path, "check --reward-model-name-or-path",
                                      args.trust_remote_code)
    if reward_tokenizer.get_vocab() == tokenizer.get_vocab():
        reward_tokenizer = None
    elif reward_tokenizer.eos_token_id is None or reward_tokenizer.pad_token_id is None:
        fail(f"the tokenizer of the reward model {args.reward_model_name_or_path!r} needs an EOS and a pad token; "
             "a model saved by reward_model.py has both")
    # The critic reads the actor's tokens: a reward model that reads others cannot be its start.
    critic_path = args.critic_model_name_or_path or \
        (args.actor_model_name_or_path if reward_tokenizer else args.reward_model_name_or_path)
    check_model_folder(critic_path, "run reward_model.py first or check --critic-model-name-or-path")
    if reward_tokenizer and is_main:
        print(f"the reward model has another tokenizer than the actor: every prompt + response is decoded to text "
              f"and tokenized again for it; the critic starts from {critic_path!r}"
              + (" with a fresh value head" if critic_path == args.actor_model_name_or_path else ""))
    actor_config = AutoConfig.from_pretrained(args.actor_model_name_or_path, trust_remote_code=args.trust_remote_code)
    if args.max_prompt_len + args.max_new_tokens > getattr(actor_config, "max_position_embeddings", float("inf")):
        fail(f"--max-prompt-len {args.max_prompt_len} + --max-new-tokens {args.max_new_tokens} is longer than the "
             f"model's {actor_config.max_position_embeddings} positions; lower them")
    return tokenizer, reward_tokenizer, critic_path


def check_finite_rollout(response_mask, logprobs, ref_logprobs, values, scores, iteration: int, start: int) -> None:
    """A forward pass that gives inf or NaN (a model broken by its weights or its precision) stops the run before it
    can reach the rewards."""
    in_mask = response_mask.bool()
    for name, x in [("actor's log-probs", logprobs[in_mask]), ("reference's log-probs", ref_logprobs[in_mask]),
                    ("critic's values", values[in_mask]), ("reward model's scores", scores)]:
        if not torch.isfinite(x).all():
            fail(f"iteration {iteration}: the {name} are not finite (inf or nan); check that model, or use "
                 "--dtype fp32" + ("" if iteration == start else ", or lower the learning rates"))


def reuse_last_valid_rollout(last_valid_rollout, iteration: int, rank: int, args: Args):
    """When every response of a rank's batch is invalid there is nothing to learn from: DeepSpeed-Chat's fallback is
    to train on the last valid batch again (sampled by an older policy, so its first ratio is not 1)."""
    if last_valid_rollout is None:
        fail(f"iteration {iteration}: no response has --min-response-tokens {args.min_response_tokens} "
             "real tokens, and there is no earlier batch to reuse; check the SFT model and max_new_tokens")
    print(f"warning: rank {rank}, iteration {iteration}: every response is invalid; reusing the last valid batch")
    return last_valid_rollout


def check_first_ratio(new_logprobs, old_logprobs, mask, iteration: int, args: Args) -> None:
    """Before the first optimizer step the policy is the one that sampled: in fp32 every log-prob equals the
    rollout's, bit for bit, on one rank or several, ZeRO-3 included. If not, the update computes them differently
    (dropout on, another temperature, a nondeterministic kernel)."""
    mask = mask.bool()
    if args.dtype == "fp32" and not torch.equal(new_logprobs[mask], old_logprobs[mask]):
        gap = (new_logprobs - old_logprobs)[mask].abs().max().item()
        fail(f"iteration {iteration}: before the first optimizer step the PPO ratio is not exactly 1 (log-probs "
             f"differ from the rollout's by up to {gap:.2e}): is dropout on (--disable-dropout) or the model "
             "nondeterministic?")


def check_finite_losses(pg_loss, vf_loss, iteration: int) -> None:
    """A NaN loss stops the run instead of training on it."""
    for name, loss in [("loss/policy_avg", pg_loss), ("loss/value_avg", vf_loss)]:
        if not torch.isfinite(loss):
            fail(f"iteration {iteration}: {name} is {loss.item()}; lower the learning rates, raise --kl-coef or use "
                 "--dtype fp32 (bf16 log-probs are too coarse for the PPO ratio)")


# ---------------------------------------------------------------------------------------------------------------
# The four DeepSpeed engines, as DeepSpeed-Chat's RLHF engine builds them: one config and one ZeRO stage each.
# ---------------------------------------------------------------------------------------------------------------
def set_up_distributed(args: Args) -> torch.device:
    """Join the ranks' process group and return this rank's device. deepspeed and torchrun set RANK, LOCAL_RANK and
    WORLD_SIZE; a plain `python` run is one rank."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))  # any free port for the one-rank process group
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args.local_rank = int(os.environ["LOCAL_RANK"])
    on_cpu = get_accelerator().device_name() == "cpu"
    if args.dtype == "fp16" and on_cpu:
        fail("--dtype fp16 needs a GPU: DeepSpeed has no fp16 on CPU; use --dtype bf16 or fp32")
    if args.enable_hybrid_engine and on_cpu:
        fail("--enable-hybrid-engine needs a GPU: DeepSpeed's hybrid engine runs CUDA inference kernels")
    get_accelerator().set_device(args.local_rank)
    if on_cpu:
        one_openmp_thread_for_new_threads()  # before gloo starts the threads that run the collectives
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    # Leave the process group before Python shuts down: a gloo group still alive at interpreter exit aborts the
    # process now and then ("terminate called without an active exception", exit code -6), a finished run too
    # (torch 2.13). Checked first, since tests run a script several times in one process.
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if on_cpu:
        remove_shared_memory_file()
    args.world_size = dist.get_world_size()
    return torch.device(get_accelerator().device_name(args.local_rank))


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

def init_engine(model_class, path: str, flag: str, ds_config: dict, args: Args, learning_rate: float | None = None,
                gradient_checkpointing: bool = False, lora_dim: int = 0, lora_learning_rate: float = 0.0):
    """Load a model and wrap it in its DeepSpeed engine: with an optimizer and a learning-rate schedule when a
    learning rate is given (actor, critic), frozen and without gradients otherwise (reference, reward, EMA). With
    lora_dim > 0 it gets LoRA adapters first. Every weight must load (load_pretrained)."""
    # Under ZeRO-3, HfDeepSpeedConfig (alive while from_pretrained runs) loads the weights already partitioned.
    hf_ds_config = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None  # noqa: F841
    config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if args.disable_dropout:
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
    # Loaded in the precision the engine trains in (fp32 unless its config says bf16 or fp16), not in the checkpoint's:
    # transformers would otherwise keep an fp16 checkpoint in fp16 in an fp32 run.
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float16 if ds_config["fp16"]["enabled"] \
        else torch.float32
    # A critic from a causal LM (the actor, when the reward model reads other tokens) gets a fresh 1-label head.
    new_head = model_class is AutoModelForSequenceClassification and \
        any(name.endswith("ForCausalLM") for name in config.architectures or [])
    if new_head:
        config.num_labels = 1
    model = load_pretrained(model_class, path, f"check {flag}", new_head=new_head, config=config, dtype=dtype,
                            trust_remote_code=args.trust_remote_code)
    if lora_dim:
        model = add_lora(model, lora_dim, args)
        if new_head and learning_rate is not None:
            model.score.requires_grad_(True)  # a fresh value head must learn, even with --only-optimize-lora
    if learning_rate is None:
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        engine.eval()
        return engine
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # torch's fused AdamW updates every weight in one kernel (the for-loop default launches several per weight); with
    # --offload the step runs on the CPU, where DeepSpeed wants its own vectorised CPU Adam.
    adam = deepspeed.ops.adam.DeepSpeedCPUAdam if args.offload else functools.partial(
        torch.optim.AdamW, fused=get_accelerator().device_name() in ("cpu", "cuda"))
    # Two parameter groups: the model's own weights and, with LoRA, its adapters with their own learning rate.
    groups = [{"params": [p for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n],
               "lr": learning_rate},
              {"params": [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n],
               "lr": lora_learning_rate}]
    optimizer = adam([group for group in groups if group["params"]], lr=learning_rate, weight_decay=args.weight_decay)
    num_steps = args.num_iterations * args.num_ppo_epochs * args.num_mini_batches
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=num_steps)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    engine.train()  # dropout is off, so train and eval mode compute the same; train mode enables checkpointing
    if engine.zero_optimization_stage() == 0 and dist.get_world_size() == 1:
        # One rank has no gradients to average, but DeepSpeed would still copy them all into one buffer, all-reduce
        # it and copy them back after every backward pass (checked with DeepSpeed 0.19.8).
        engine.enable_backward_allreduce = False
    return engine


def check_score_head(engine, name: str) -> None:
    """Critic and reward model are sequence classifiers whose head we apply at every position."""
    if not isinstance(getattr(engine.module, "score", None), torch.nn.Linear) or engine.module.config.num_labels != 1:
        fail(f"the {name} must be a 1-label AutoModelForSequenceClassification with a linear `score` head "
             "(as reward_model.py saves it)")


def build_engines(args: Args, critic_path: str):
    """Actor, reference, critic and reward model (and with --enable-ema the actor's EMA, else None), each checked:
    critic and reward model have a 1-label score head, and no weight is inf or NaN."""
    # The reference follows the actor's ZeRO stage and the reward model the critic's, but only ZeRO-3 is worth
    # anything to a model without gradients or optimizer (it shards the parameters), so both are ZeRO-3 or plain
    # (DeepSpeed-Chat's rule). Their own offload keeps their parameters in CPU memory, which needs ZeRO-3.
    reference_stage = 3 if args.actor_zero_stage == 3 or args.offload_reference_model else 0
    reward_stage = 3 if args.critic_zero_stage == 3 or args.offload_reward_model else 0
    actor_ds_config = deepspeed_config(args.actor_zero_stage, True, args.offload, args)
    if args.enable_hybrid_engine:
        actor_ds_config["hybrid_engine"] = hybrid_engine_config(args)
    actor = init_engine(AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
                        actor_ds_config, args, args.actor_learning_rate, args.actor_gradient_checkpointing,
                        args.actor_lora_dim, args.actor_lora_learning_rate)
    # With only the actor's adapters trained, the actor with its adapters off is the SFT model: it is the reference
    # (adapters_disabled), and a whole model copy is never loaded.
    reference = actor if args.only_optimize_lora else init_engine(
        AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
        deepspeed_config(reference_stage, False, args.offload_reference_model, args), args)
    critic = init_engine(AutoModelForSequenceClassification, critic_path, "--critic-model-name-or-path",
                         deepspeed_config(args.critic_zero_stage, True, args.offload, args), args,
                         args.critic_learning_rate, args.critic_gradient_checkpointing, args.critic_lora_dim,
                         args.critic_lora_learning_rate)
    reward = init_engine(AutoModelForSequenceClassification, args.reward_model_name_or_path,
                         "--reward-model-name-or-path",
                         deepspeed_config(reward_stage, False, args.offload_reward_model, args), args)
    check_score_head(critic, "critic")
    check_score_head(reward, "reward model")
    # Each weights file is checked once: the reference (and the EMA) load the actor's, and the critic, unless
    # --critic-model-name-or-path is set, the reward model's.
    check_finite_weights(actor.module, f"model {args.actor_model_name_or_path!r} (--actor-model-name-or-path)")
    check_finite_weights(reward.module, f"model {args.reward_model_name_or_path!r} (--reward-model-name-or-path)")
    if critic_path != args.reward_model_name_or_path:
        check_finite_weights(critic.module, f"model {critic_path!r} (--critic-model-name-or-path)")
    ema = init_ema(actor, args) if args.enable_ema else None
    return actor, reference, critic, reward, ema


@contextlib.contextmanager
def gathered(engine, enabled: bool):
    """Under ZeRO-3, gather a model's full weights once and take DeepSpeed's hooks off, so that generating and
    scoring do not gather the weights again block by block for every new token and every forward pass (the recipe of
    TRL's unwrap_model_for_generation). Only for no-gradient work: the hooks are back for the update. Beyond TRL's
    recipe, the weights come in one coalesced all-gather, not one per parameter; the engine's own hooks around each
    forward pass are off too; and the hooks come back as they were, in their modules' hook tables, instead of being
    registered anew, which makes DeepSpeed forget the module order it traced, so that the next forward and backward
    would trace it again without prefetching. Does nothing below ZeRO-3.

    DeepSpeed has no public API for this: it uses the hook handles of the engine's parameter coordinator
    (forward_hooks, backward_hooks, fwd_pre_hook) and of the engine (module_forward_pre_hook,
    module_forward_post_hook), the tables torch keeps hooks in (a handle's hooks_dict_ref and extra_dict_ref) and
    ds_active_sub_modules, checked with DeepSpeed 0.19.8 and torch 2.13
    (test_gathered_rollout_weights_are_whole_and_hooks_come_back)."""
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


def sample_responses(actor, prompt_ids, prompt_mask, generation_config, weights_gathered: bool, iteration: int,
                     start: int) -> torch.Tensor:
    """One response sampled from the actor for each prompt: [B, P] -> [B, max_new_tokens], padded on the right. Under
    ZeRO-3 without gathered weights every new token all-gathers each layer, and synced_gpus keeps the ranks stepping
    together until all are done, so that none waits forever. Non-finite probabilities stop the run with one line."""
    actor.eval()  # in train mode, gradient checkpointing would switch generate's key-value cache off
    try:
        sequences = actor.module.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config,
            synced_gpus=actor.zero_optimization_stage() == 3 and not weights_gathered)
    except RuntimeError as error:  # torch.multinomial's "probability tensor contains inf, nan or < 0"
        if "inf" not in str(error):
            raise
        fail(f"iteration {iteration}: the actor's next-token probabilities are not finite while sampling "
             f"({str(error).strip()}); " + ("lower the learning rates" if iteration > start
                                            else "check --actor-model-name-or-path and --temperature"))
    actor.train()
    responses = sequences[:, prompt_ids.shape[1] :]
    return torch.nn.functional.pad(responses, (0, generation_config.max_new_tokens - responses.shape[1]),
                                   value=generation_config.pad_token_id)


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


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints for --resume, and the saved models.
# ---------------------------------------------------------------------------------------------------------------
# Settings that --resume lets change (the `resume` flag's help lists them): they change how the run is saved, logged
# or laid out in memory, not what it computes. The runtime fields derive from the others and the number of ranks.
RESUME_MAY_CHANGE = ["resume", "overwrite", "local_rank", "save_every", "sample_every", "snapshot_every", "track",
                     "wandb_project_name", "actor_zero_stage", "critic_zero_stage", "offload", "offload_reference_model",
                     "offload_reward_model", "gather_weights_for_rollout", "actor_gradient_checkpointing",
                     "critic_gradient_checkpointing", "release_inference_cache", "unpin_actor_parameters",
                     "tp_gather_partition_size"]

def changed_settings(saved: dict, args: Args) -> list[str]:
    """The settings of this run that differ from those a checkpoint was written with, but for RESUME_MAY_CHANGE."""
    return [f"--{name.replace('_', '-')} {saved[name]!r} (now {value!r})" for name, value in asdict(args).items()
            if name not in RESUME_MAY_CHANGE and name in saved and saved[name] != value]

def complete_checkpoints(checkpoint_dir: str) -> list[str]:
    """The complete checkpoints of OUTPUT_DIR/resume, newest first: the one `latest` names, then the others (a folder
    is complete once renamed from its .tmp)."""
    if not os.path.isdir(checkpoint_dir):
        return []
    names = sorted((name for name in os.listdir(checkpoint_dir) if re.fullmatch(r"iteration_\d+", name)),
                   key=lambda name: int(name.removeprefix("iteration_")), reverse=True)
    with contextlib.suppress(OSError), open(os.path.join(checkpoint_dir, "latest")) as f:
        latest = f.read().strip()
        if latest in names:
            names.insert(0, names.pop(names.index(latest)))
    return [os.path.join(checkpoint_dir, name) for name in names]

def read_state(checkpoint: str) -> dict | None:
    """A checkpoint's state.json, or None if it does not read."""
    try:
        with open(os.path.join(checkpoint, "state.json")) as f:
            state = json.load(f)
        return state if isinstance(state, dict) and {"iteration", "kl_coef", "actor", "critic", "args"} <= set(state) \
            else None
    except (OSError, ValueError):
        return None

def checkpoint_problem(checkpoint: str, engines: dict) -> str | None:
    """Why --resume cannot continue from this checkpoint, or None: its state.json must read and each engine's files
    must be whole safetensors files that hold a tensor for every parameter (and Adam's two moments of each)."""
    if read_state(checkpoint) is None:
        return "its state.json is missing or damaged"
    for folder, engine in engines.items():
        names = {name for name, _ in engine.module.named_parameters()}
        files = {"model.safetensors": names}
        if folder != "actor_ema":
            files["adam.safetensors"] = {f"{name}.{moment}" for name in names for moment in ("exp_avg", "exp_avg_sq")}
        for file, expected in files.items():
            try:
                with safetensors.safe_open(os.path.join(checkpoint, folder, file), "pt") as f:
                    if set(f.keys()) != expected:
                        return f"{folder}/{file} does not hold this model's parameters"
            except (OSError, safetensors.SafetensorError) as error:
                return f"{folder}/{file}: {' '.join(str(error).split())[:200]}"
    return None

def start_run(args: Args) -> dict:
    """Rank 0's checks of the output folder before anything loads (claim_output_dir), and the run they lead to: a new
    run, or with --resume the unfinished one in OUTPUT_DIR, whose settings must not have changed (changed_settings).
    Returns the run's name (its runs/ folder), its metrics.jsonl and the checkpoints to resume from, newest first."""
    inputs = {"--actor-model-name-or-path": args.actor_model_name_or_path,
              "--reward-model-name-or-path": args.reward_model_name_or_path,
              "--critic-model-name-or-path": args.critic_model_name_or_path, "--dataset": args.dataset,
              "--unsup-dataset": args.unsup_dataset}
    record = read_record(args.output_dir) or {}  # an earlier run's, if ppo.py wrote this folder before
    if record.get("script") != "ppo.py":
        record = {}
    claim_output_dir(args.output_dir, inputs, args.overwrite)
    checkpoint_dir = os.path.join(args.output_dir, "resume")
    checkpoints = complete_checkpoints(checkpoint_dir) if record else []
    if args.resume:
        if "run_name" not in record:
            fail(f"--resume: no run of ppo.py in {args.output_dir!r} to continue")
        if record.get("finished"):
            fail(f"--resume: the run in {args.output_dir!r} has finished all its iterations; nothing to resume (its "
                 "actor and critic are in actor/ and critic/)")
        states = [state for state in map(read_state, checkpoints) if state is not None]
        if not states:
            fail(f"--resume: no complete checkpoint in {checkpoint_dir}; run with --save-every N first")
        changed = changed_settings(states[0]["args"], args)
        if changed:
            fail(f"--resume: the run was started with other settings: {', '.join(changed)}; resume with its "
                 "settings (only those listed under --resume in --help may change)")
        run_name, metrics_file = record["run_name"], record["metrics_file"]
    else:
        if checkpoints and not record.get("finished") and not args.overwrite:
            fail(f"{args.output_dir!r} holds checkpoints of an unfinished run ({os.path.basename(checkpoints[0])}): "
                 "continue it with --resume, or pass --overwrite to start a new run, which deletes them")
        if record:  # an earlier run's checkpoints and snapshots, which this run replaces
            for folder in ["resume", "snapshots"]:
                shutil.rmtree(os.path.join(args.output_dir, folder), ignore_errors=True)
        checkpoints = []
        run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
        metrics_file = os.path.abspath(os.path.join("runs", run_name, "metrics.jsonl"))
        write_json(os.path.join(args.output_dir, RECORD), {"script": "ppo.py", "finished": False, "run_name": run_name,
                                                            "metrics_file": metrics_file, "args": asdict(args)})
    make_run_dir(run_name)
    return {"run_name": run_name, "metrics_file": metrics_file, "checkpoints": checkpoints}

def continue_metrics_file(path: str, iteration: int) -> None:
    """On --resume, the run's metrics.jsonl keeps the lines of the iterations up to the checkpoint's and loses those
    after it (logged by the killed run, they are logged again), and any line cut short by the kill."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                if json.loads(line)["iteration"] <= iteration:
                    kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)

def save_weights(engine, path: str, is_main: bool) -> None:
    """Every parameter of a frozen engine (the EMA) under the engine's own names (LoRA adapters unmerged), gathered
    whole under ZeRO-3 (every rank takes part; rank 0 writes), in path/model.safetensors: for --resume."""
    weights = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters(param, enabled=engine.zero_optimization_stage() == 3):
            if is_main:
                weights[name] = param.detach().cpu().clone()
    if is_main:
        os.makedirs(path, exist_ok=True)
        safetensors.torch.save_file(weights, os.path.join(path, "model.safetensors"))

def load_weights(engine, weights: dict[str, torch.Tensor]) -> None:
    """The inverse of save_weights: every parameter set from `weights` (a loaded model.safetensors, by the engine's own
    names), under ZeRO-3 into every rank's partition (modifier_rank)."""
    for name, param in engine.module.named_parameters():
        with torch.no_grad(), deepspeed.zero.GatheredParameters(
                param, modifier_rank=0, enabled=engine.zero_optimization_stage() == 3):
            param.data.copy_(weights[name])

def torch_optimizer(engine):
    """The torch optimizer inside an engine, whose state holds Adam's step count. Under ZeRO or bf16 DeepSpeed wraps it
    and keeps it in the wrapper's `optimizer` attribute, for which it has no public accessor; under ZeRO-0 in fp32 the
    engine's optimizer is the torch one. Checked with DeepSpeed 0.19.8 (test_killed_run_resumes_to_the_same_metrics,
    every ZeRO stage)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def save_training_state(engine, path: str, is_main: bool) -> dict:
    """What --resume needs of a trained model, in safetensors (nothing that a load would unpickle): the fp32 master
    weights in model.safetensors and Adam's moments in adam.safetensors, under the engine's own parameter names (LoRA
    adapters unmerged). Each tensor is whole, gathered from the ranks' partitions under ZeRO (every rank takes part;
    rank 0 writes). Returns the optimizer's step count and the scheduler's state, for state.json."""
    # DeepSpeed wraps the torch optimizer (ZeRO, bf16) and keeps an fp32 master copy of each parameter, which its
    # tensor-fragment API assembles; under ZeRO-0 in fp32 it does not: each parameter is its own master copy.
    base_optimizer = torch_optimizer(engine)
    plain = engine.optimizer is base_optimizer
    weights, moments = {}, {}
    for name, param in engine.module.named_parameters():
        if plain:
            master, state = param.detach(), engine.optimizer.state[param]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
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
    return {"adam_step": adam_step, "scheduler": engine.lr_scheduler.state_dict()}

def load_training_state(engine, path: str, saved: dict, device: torch.device) -> None:
    """Restore the weights, Adam's moments, step count and learning rate that save_training_state wrote, into an
    engine built from the model the run started from: the model's own weights (in its dtype) and, under bf16 or
    ZeRO, the fp32 master copy that the optimizer updates."""
    # DeepSpeed creates Adam's moments lazily, at the first optimizer step. One step with learning rate 0 and zero
    # gradients creates them without moving any weight; everything is overwritten below.
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(engine(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device)).logits.sum() * 0.0)
        engine.step()
    weights = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    load_weights(engine, weights)
    moments = safetensors.torch.load_file(os.path.join(path, "adam.safetensors"))
    base_optimizer = torch_optimizer(engine)
    plain = engine.optimizer is base_optimizer  # ZeRO-0 in fp32, as in save_training_state
    for name, param in engine.module.named_parameters():
        if plain:
            state = engine.optimizer.state[param]
            state["exp_avg"].copy_(moments[f"{name}.exp_avg"])
            state["exp_avg_sq"].copy_(moments[f"{name}.exp_avg_sq"])
        else:
            deepspeed.utils.safe_set_full_fp32_param(param, weights[name].to(device))
            deepspeed.utils.safe_set_full_optimizer_state(param, moments[f"{name}.exp_avg"].to(device), "exp_avg")
            deepspeed.utils.safe_set_full_optimizer_state(param, moments[f"{name}.exp_avg_sq"].to(device), "exp_avg_sq")
    for state in base_optimizer.state.values():
        state["step"] = torch.full_like(state["step"], saved["adam_step"]) if torch.is_tensor(state["step"]) \
            else saved["adam_step"]
    engine.lr_scheduler.load_state_dict(saved["scheduler"])
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr


def save_checkpoint(iteration: int, kl_coef: float, actor, critic, ema, args: Args) -> None:
    """A checkpoint for --resume in OUTPUT_DIR/resume/iteration_N: written to a temporary folder, flushed to disk,
    renamed into place once complete, and only then named in `latest`. The one before it is kept, for a latest that
    cannot be read. Every rank takes part (ZeRO gathers); rank 0 writes."""
    is_main = dist.get_rank() == 0
    checkpoint_dir = os.path.join(args.output_dir, "resume")
    path = os.path.join(checkpoint_dir, f"iteration_{iteration}")
    try:
        state = {"iteration": iteration, "kl_coef": kl_coef, "args": asdict(args),
                 "actor": save_training_state(actor, os.path.join(path + ".tmp", "actor"), is_main),
                 "critic": save_training_state(critic, os.path.join(path + ".tmp", "critic"), is_main)}
        if ema is not None:
            save_weights(ema, os.path.join(path + ".tmp", "actor_ema"), is_main)
        if is_main:
            write_json(os.path.join(path + ".tmp", "state.json"), state)
            fsync_tree(path + ".tmp")
            shutil.rmtree(path, ignore_errors=True)
            os.replace(path + ".tmp", path)
            with open(os.path.join(checkpoint_dir, "latest.tmp"), "w") as f:
                f.write(os.path.basename(path))
            fsync_tree(checkpoint_dir)
            os.replace(os.path.join(checkpoint_dir, "latest.tmp"), os.path.join(checkpoint_dir, "latest"))
            fsync_tree(checkpoint_dir)
            keep = [os.path.basename(c) for c in complete_checkpoints(checkpoint_dir)[:2]]
            for old in os.listdir(checkpoint_dir):  # older checkpoints, and a temporary folder left by a kill
                if old.startswith("iteration_") and old not in keep:
                    shutil.rmtree(os.path.join(checkpoint_dir, old))
    except OSError as error:  # a full disk, a folder made read-only meanwhile
        fail(f"cannot write the checkpoint {path!r} ({error}); the one before it, if any, can be resumed from")


def load_checkpoint(checkpoints: list[str], actor, critic, ema, args: Args, device) -> tuple[int, float]:
    """--resume: the engines, built as at the start, take the weights and optimizer states of the newest checkpoint
    that reads whole (checkpoint_problem); returns its iteration and KL coefficient."""
    is_main = dist.get_rank() == 0
    engines = {"actor": actor, "critic": critic, **({"actor_ema": ema} if ema is not None else {})}
    for resume_dir in checkpoints:
        problem = checkpoint_problem(resume_dir, engines)
        if problem is None:
            break
        if is_main:
            print(f"warning: cannot resume from {resume_dir} ({problem}); trying the checkpoint before it")
    else:
        fail(f"--resume: no checkpoint in {os.path.join(args.output_dir, 'resume')} reads whole; start a new run "
             "with --overwrite")
    state = read_state(resume_dir)
    load_training_state(actor, os.path.join(resume_dir, "actor"), state["actor"], device)
    load_training_state(critic, os.path.join(resume_dir, "critic"), state["critic"], device)
    if ema is not None:
        load_weights(ema, safetensors.torch.load_file(os.path.join(resume_dir, "actor_ema", "model.safetensors")))
    if is_main:
        left = args.num_iterations - state["iteration"]
        print(f"resumed from {resume_dir} at iteration {state['iteration']}; "
              + (f"{left} iterations left" if left else "no iteration left: saving the actor and the critic"))
    return state["iteration"], state["kl_coef"]


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


def save_engine_folder(engine, tokenizer, path: str, record: dict) -> None:
    """An engine's model as a Hugging Face folder (save_model_folder), with any LoRA adapters merged into the weights
    (merged_state_dict). Under ZeRO-3 the full weights are gathered first (every rank takes part; rank 0 writes)."""
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=engine.zero_optimization_stage() == 3):
        if dist.get_rank() == 0:
            save_model_folder(engine.module, tokenizer, path, record, merged_state_dict(engine.module))


# ---------------------------------------------------------------------------------------------------------------
# Logging: TRL's metric names (README, "Metrics"), to tensorboard, metrics.jsonl and, with --track, wandb.
# ---------------------------------------------------------------------------------------------------------------
def start_logging(run: dict, start_iteration: int, args: Args):
    """Rank 0's tensorboard writer and metrics.jsonl of the run, with the hyperparameters as a table. A resumed run
    continues its own logs: the events and metrics lines after its checkpoint are dropped."""
    run_dir = os.path.join("runs", run["run_name"])
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, name=run["run_name"], config=asdict(args), sync_tensorboard=True)
    writer = SummaryWriter(run_dir, purge_step=start_iteration * args.batch_size + 1 if args.resume else None)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
    continue_metrics_file(run["metrics_file"], start_iteration)
    print(f"{args.num_iterations} iterations of {args.batch_size} episodes; logging to {run_dir}")
    return writer, open(run["metrics_file"], "a")


def sum_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each value (a scalar tensor) summed over all ranks, in one all_reduce, in float64."""
    summed = torch.stack([value.double() for value in values.values()])
    dist.all_reduce(summed)
    return dict(zip(values, summed.tolist()))


def new_update_sums(device) -> dict[str, torch.Tensor]:
    """Sums over this rank's in-mask tokens of every micro-batch of an iteration's update, for the token means."""
    return {name: torch.zeros((), dtype=torch.float64, device=device) for name in [
        "tokens", "pg_loss", "vf_loss", "approxkl", "clipfrac", "vf_clipfrac", "entropy", "ratio",
        "micro_batches", "ratio_means", "ratio_means_squared", "unsup_loss"]}


@torch.no_grad()
def add_update_sums(sums, new_logits, mask, pg_loss, vf_loss, pg_stats, vf_clipfrac, args: Args) -> None:
    """Add one micro-batch to the update's sums: each token-mean statistic times its micro-batch's token count."""
    num_tokens = mask.bool().sum()
    entropy = rlhf_math.masked_mean(rlhf_math.entropy_from_logits(new_logits, args.temperature), mask)
    for name, value in [("pg_loss", pg_loss), ("vf_loss", vf_loss), ("entropy", entropy),
                        ("approxkl", pg_stats["approxkl"]), ("clipfrac", pg_stats["clipfrac"]),
                        ("vf_clipfrac", vf_clipfrac), ("ratio", pg_stats["ratio"])]:
        sums[name] += value.detach() * num_tokens
    sums["tokens"] += num_tokens
    if num_tokens > 0:  # the spread of the micro-batches' mean ratios, for val/ratio_var
        sums["micro_batches"] += 1
        sums["ratio_means"] += pg_stats["ratio"]
        sums["ratio_means_squared"] += pg_stats["ratio"] ** 2


def iteration_metrics(update_sums, rollout: dict, kl_coef: float, lr: float, iteration: int, times: dict,
                      args: Args) -> dict[str, float]:
    """One iteration's metrics. Each figure is a mean over all ranks' responses or tokens (sums and counts are added
    over the ranks, never a mean of the ranks' means); objective/ is over the valid responses, whose scores and KL
    enter the rewards; the token statistics are over the update's in-mask tokens."""
    valid, scores = rollout["valid"], rollout["scores"]
    with torch.no_grad():
        valid_scores = torch.where(valid, scores, 0.0)
        sums = sum_over_ranks({
            **update_sums,
            "responses": torch.tensor(float(len(valid)), device=scores.device), "valid": valid.sum(),
            "kl": rollout["kl"].sum(dim=1).sum(), "scores": valid_scores.sum(),
            "scores_squared": (valid_scores**2).sum(),
            "scores_clipped": (valid & (scores.abs() >= args.clip_score)).sum(),
            "sequence_entropy": torch.where(rollout["update_mask"].bool(), -rollout["logprobs"], 0.0).sum(),
            "eos": rollout["contains_eos"].sum(), "length": rollout["response_mask"].sum(),
        })
    per_response, per_token = max(sums["valid"], 1), max(sums["tokens"], 1)
    mean_score = sums["scores"] / per_response
    metrics = {
        "objective/kl": sums["kl"] / per_response,
        "objective/entropy": sums["sequence_entropy"] / per_response,
        "objective/non_score_reward": -kl_coef * sums["kl"] / per_response,
        "objective/rlhf_reward": mean_score - kl_coef * sums["kl"] / per_response,
        "objective/scores": mean_score,
        "objective/scores_std": max(sums["scores_squared"] / per_response - mean_score**2, 0.0) ** 0.5,
        "objective/scores_clipfrac": sums["scores_clipped"] / per_response,
        "objective/kl_coef": kl_coef,
        "policy/approxkl_avg": sums["approxkl"] / per_token,
        "policy/clipfrac_avg": sums["clipfrac"] / per_token,
        "policy/entropy_avg": sums["entropy"] / per_token,
        "loss/policy_avg": sums["pg_loss"] / per_token,
        "loss/value_avg": sums["vf_loss"] / per_token,
        "val/clipfrac_avg": sums["vf_clipfrac"] / per_token,
        "val/ratio": sums["ratio"] / per_token,
        # Unbiased variance of the micro-batches' mean ratios, over every micro-batch of every rank.
        "val/ratio_var": max(sums["ratio_means_squared"] - sums["ratio_means"] ** 2 / sums["micro_batches"], 0.0)
        / (sums["micro_batches"] - 1) if sums["micro_batches"] > 1 else 0.0,
        "val/num_eos_tokens": sums["eos"],
        "val/response_length": sums["length"] / sums["responses"],
        "val/num_invalid": sums["responses"] - sums["valid"],
        "lr": lr,
        "episode": (iteration + 1) * args.batch_size,
        **times,
        # Peak memory of this rank so far (on a GPU, torch's allocated and reserved figures; on a CPU, DeepSpeed
        # reports the process's peak resident memory for both).
        "memory/max_allocated_gb": get_accelerator().max_memory_allocated() / 2**30,
        "memory/max_reserved_gb": get_accelerator().max_memory_reserved() / 2**30,
    }
    if args.unsup_dataset is not None:  # one micro-batch of blocks per PPO micro-batch, all of the same length
        metrics["loss/unsup_avg"] = sums["unsup_loss"] / (
            args.world_size * args.num_ppo_epochs * args.num_mini_batches * args.gradient_accumulation_steps)
    return metrics


def log_iteration(metrics: dict, iteration: int, writer, metrics_file, tokenizer, samples, args: Args) -> None:
    """Rank 0 writes an iteration's metrics to tensorboard and metrics.jsonl, prints a line, and every
    --sample-every iterations a table of a few prompts, responses and scores (samples: their token ids and scores)."""
    for name, value in metrics.items():
        writer.add_scalar(name, value, metrics["episode"])
    metrics_file.write(json.dumps({"iteration": iteration + 1, **metrics}) + "\n")
    metrics_file.flush()
    print(f"iteration {iteration + 1}/{args.num_iterations}: score {metrics['objective/scores']:+.3f}, "
          f"kl {metrics['objective/kl']:.3f}, length {metrics['val/response_length']:.1f}, "
          f"approxkl {metrics['policy/approxkl_avg']:.4f}, value loss {metrics['loss/value_avg']:.3f}, "
          f"rollout {metrics['time/rollout']:.1f}s, update {metrics['time/update']:.1f}s")
    if args.sample_every and (iteration + 1) % args.sample_every == 0:
        prompt_ids, responses, scores = samples
        table = Table("prompt", "response", "score", title=f"iteration {iteration + 1}", show_lines=True)
        for i in range(min(4, len(prompt_ids))):
            table.add_row(tokenizer.decode(prompt_ids[i], skip_special_tokens=True),
                          tokenizer.decode(responses[i], skip_special_tokens=True), f"{scores[i].item():+.2f}")
        Console().print(table)


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed-Chat's extras, each off by default and called from one place in the loop: LoRA, an EMA of the actor,
# InstructGPT's pretraining mix, and on a GPU the hybrid engine and fp16 overflow alignment (docs/extras.md).
# ---------------------------------------------------------------------------------------------------------------
def hybrid_engine_config(args: Args) -> dict:
    """DeepSpeed's hybrid engine (DeepSpeed-Chat, GPU only): during generation the actor runs on inference kernels,
    with its own tensor parallelism and key-value cache; between eval() and train() DeepSpeed swaps them in and out."""
    return {"enabled": True, "max_out_tokens": args.max_prompt_len + args.max_new_tokens,
            "inference_tp_size": args.inference_tp_size, "release_inference_cache": args.release_inference_cache,
            "pin_parameters": not args.unpin_actor_parameters,
            "tp_gather_partition_size": args.tp_gather_partition_size}


def add_lora(model, lora_dim: int, args: Args):
    """LoRA (Hu et al. 2021): beside each targeted linear layer W, a trainable low-rank update (alpha / r) B A, with
    B = 0 at the start so that the model is unchanged; peft builds the layers in place. The value head `score` stays
    plain (the critic's values come from it), and the adapters have no dropout (PPO's first ratio must be 1)."""
    lora_config = peft.LoraConfig(r=lora_dim, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                  target_modules=args.lora_target_modules,
                                  exclude_modules=["score"] if hasattr(model, "score") else None)
    try:
        model = peft.inject_adapter_in_model(lora_config, model)  # freezes all but the adapters
    except ValueError as error:  # no module matches
        fail(f"--lora-target-modules {args.lora_target_modules!r}: {' '.join(str(error).split())[:300]}")
    if not args.only_optimize_lora:
        model.requires_grad_(True)  # DeepSpeed-Chat's default: the adapters train alongside the whole model
    return model

@contextlib.contextmanager
def adapters_disabled(model):
    """Switch a model's LoRA adapters off for a while (a model without adapters is unchanged): with
    --only-optimize-lora the actor with its adapters off is the SFT model, so it serves as the reference."""
    lora_layers = [m for m in model.modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)]
    for layer in lora_layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in lora_layers:
            layer.enable_adapters(True)

def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights as a plain model's state dict, each LoRA adapter folded into the layer it adapts:
    W + (alpha / r) B A under W's own name (a model without adapters: its state dict as it is)."""
    state = {name.replace(".base_layer.", "."): value for name, value in model.state_dict().items()
             if "lora_" not in name}
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            state[f"{name}.weight"] = state[f"{name}.weight"] + module.get_delta_weight("default")
    return state


def init_ema(actor, args: Args):
    """An exponential moving average of the actor's weights (DeepSpeed-Chat's --enable_ema), for evaluation only:
    frozen, ZeRO-3 when the actor is. It stays in fp32 whatever --dtype: each step moves a weight by (1 - decay) =
    0.8% of its gap to the actor's, mostly far below bf16's resolution (0.4% of the weight), so in bf16 most steps
    would round away. It starts as the actor (decay 0), the same adapters included."""
    ema_ds_config = deepspeed_config(3 if args.actor_zero_stage == 3 else 0, False, False, args)
    ema_ds_config["bf16"]["enabled"] = ema_ds_config["fp16"]["enabled"] = False
    ema = init_engine(AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
                      ema_ds_config, args, lora_dim=args.actor_lora_dim)
    update_ema(ema, actor, 0.0)
    return ema


def update_ema(ema, actor, decay: float) -> None:
    """ema = decay * ema + (1 - decay) * actor for every parameter (rlhf_math.ema_update). Under ZeRO-3 each pair is
    gathered in turn and the EMA's new value written back to the ranks' partitions (modifier_rank)."""
    zero3 = actor.zero_optimization_stage() == 3  # the EMA's stage follows the actor's
    with torch.no_grad():
        for ema_param, param in zip(ema.module.parameters(), actor.module.parameters()):
            with deepspeed.zero.GatheredParameters(param, enabled=zero3), \
                    deepspeed.zero.GatheredParameters(ema_param, modifier_rank=0, enabled=zero3):
                ema_param.data.copy_(rlhf_math.ema_update(ema_param.data, param.data.to(ema_param.dtype), decay))


def load_pretraining_blocks(tokenizer, args: Args) -> torch.Tensor:
    """The pretraining mix's plain text (InstructGPT's PPO-ptx), tokenized, joined with EOS between documents and cut
    into blocks as long as a rollout's sequences, as DeepSpeed-Chat's unsupervised data set does: [blocks, P + R]."""
    text_data = load_split(args.unsup_dataset, "train", [args.unsup_text_column], "--unsup-dataset",
                           args.unsup_dataset_config, (".txt", ".json", ".jsonl", ".parquet"))
    texts = [text for text in text_data[args.unsup_text_column] if isinstance(text, str) and text.strip()]
    token_stream = [t for ids in tokenizer(texts, split_special_tokens=True)["input_ids"]
                    for t in ids + [tokenizer.eos_token_id]]
    block_len = args.max_prompt_len + args.max_new_tokens
    num_blocks = len(token_stream) // block_len
    if num_blocks < args.per_device_train_batch_size:
        fail(f"--unsup-dataset {args.unsup_dataset!r} holds {len(token_stream)} tokens, fewer than one "
             f"micro-batch of {args.per_device_train_batch_size} blocks of {block_len}; give it more text")
    return torch.tensor(token_stream[: num_blocks * block_len]).view(num_blocks, block_len)


def pretraining_loss(actor, unsup_blocks: torch.Tensor, update_sums: dict, iteration: int, args: Args):
    """The pretraining mix (InstructGPT eq. 2, PPO-ptx): the objective adds gamma E_x~D_pretrain [log pi(x)], so the
    actor's loss adds gamma times the language-modelling loss of a micro-batch of plain-text blocks, in the same
    backward pass and optimizer step. Returns that loss (before gamma) and adds it to the update's sums."""
    blocks = unsup_blocks[torch.randint(len(unsup_blocks), (args.per_device_train_batch_size,))]
    blocks = blocks.to(actor.device)
    unsup_loss = actor.module(input_ids=blocks, labels=blocks, use_cache=False).loss
    if not torch.isfinite(unsup_loss):
        fail(f"iteration {iteration}: loss/unsup_avg is {unsup_loss.item()}; lower the learning rates")
    update_sums["unsup_loss"] += unsup_loss.detach()
    return unsup_loss


def found_overflow(engine) -> bool:
    """Whether this accumulation's fp16 gradients hold inf or NaN, the way the engine's optimizer will see it in
    step() (a collective call: every rank takes part). Private DeepSpeed attributes, as aligned_overflow."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow_checker"):  # ZeRO-0: FP16_Optimizer, FP16_UnfusedOptimizer
        return optimizer.overflow_checker.check()
    return optimizer.has_overflow(partition_gradients=getattr(optimizer, "partition_gradients", True))  # ZeRO 1-3

@contextlib.contextmanager
def aligned_overflow(actor, critic, enabled: bool):
    """--align-overflow (DeepSpeed-Chat's align_overflow), around the two engines' step() calls. In fp16 an optimizer
    whose gradients overflow skips its step (and lowers its loss scale), so actor and critic could drift apart by a
    step. At the end of an accumulation both are checked, and the one that did not overflow is made to see an
    overflow for this one step: it takes DeepSpeed's own skip path (no update, no scheduler step, gradients
    cleared), keeping its loss scale. (DeepSpeed-Chat sets optimizer.skip_step and calls
    check_overflow(external=True); DeepSpeed 0.19 has neither.)

    DeepSpeed has no public API for this: it shadows the optimizers' private overflow checks (has_overflow, check,
    check_using_norm, _update_scale) for one step. Checked with DeepSpeed 0.19.8, ZeRO 0 to 3
    (test_align_overflow_skips_both_steps)."""
    if not enabled or not actor.is_gradient_accumulation_boundary():
        yield
        return
    actor_overflow, critic_overflow = found_overflow(actor), found_overflow(critic)
    patched = []  # (object, method name): instance attributes that shadow the class's methods for this one step
    for engine, skip in [(actor, critic_overflow and not actor_overflow),
                         (critic, actor_overflow and not critic_overflow)]:
        if skip:
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


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    watch_launcher()  # before the set-up: a rank waiting there for a peer must not outlive its launcher either
    device = set_up_distributed(args)
    rank, is_main = dist.get_rank(), dist.get_rank() == 0
    stop_on_signals()

    # Batch arithmetic, checked once: an iteration answers batch_size prompts; each PPO epoch splits every rank's
    # share into num_mini_batches optimizer steps of gradient_accumulation_steps forward passes each.
    args.batch_size = args.per_device_rollout_batch_size * args.world_size
    args.num_iterations = exact_div(args.total_episodes, args.batch_size, "--total-episodes / (rollout batch x ranks)")
    args.per_device_mini_batch_size = exact_div(
        args.per_device_rollout_batch_size, args.num_mini_batches, "--per-device-rollout-batch-size / --num-mini-batches")
    args.gradient_accumulation_steps = exact_div(
        args.per_device_mini_batch_size, args.per_device_train_batch_size,
        "rollout batch per mini-batch / --per-device-train-batch-size")

    # The output folder, checked, locked and claimed before anything loads, and the run: a new one, or the one that
    # --resume continues (its name, so that its logs continue; its checkpoints, newest first).
    run = on_rank_0(lambda: start_run(args))
    saved_by = {"script": "ppo.py", "run_name": run["run_name"], "metrics_file": run["metrics_file"]}
    tokenizer, reward_tokenizer, critic_path = check_models(args, is_main)
    prompts = load_prompts(tokenizer, args.dataset, args.train_split, args.prompt_column, args.max_prompt_len, is_main,
                           args.assistant_marker if args.split_conversations else None)
    if len(prompts) < args.batch_size:
        fail(f"{len(prompts)} usable prompts, fewer than one iteration's {args.batch_size}; "
             "raise --max-prompt-len or lower --per-device-rollout-batch-size")
    unsup_blocks = load_pretraining_blocks(tokenizer, args) if args.unsup_dataset is not None else None

    torch.manual_seed(args.seed)  # LoRA's A matrices start random: the same seed gives the same adapters
    actor, reference, critic, reward, ema = build_engines(args, critic_path)
    # Reward normalization (Ziegler et al. 2019): reward_model.py stored the mean and standard deviation of its scores
    # on the SFT policy's responses; (score - reward_mean) / reward_std has mean 0 and std 1 where PPO starts. The
    # critic starts as a copy of the reward model, so its outputs are mapped the same way, with its own config's values.
    reward_mean = getattr(reward.module.config, "reward_mean", 0.0)
    reward_std = getattr(reward.module.config, "reward_std", 1.0)
    critic_mean = getattr(critic.module.config, "reward_mean", 0.0)
    critic_std = getattr(critic.module.config, "reward_std", 1.0)
    if is_main and not hasattr(reward.module.config, "reward_std"):
        print("the reward model's config has no reward_mean and reward_std (not saved by reward_model.py): scores "
              "are used unnormalized")
    generation_config = sampling_config(tokenizer, args.max_new_tokens, args.temperature)
    actor.module.generation_config = generation_config  # replaces the model's own, so that nothing else is applied

    start_iteration, kl_coef = 0, args.kl_coef
    if args.resume:
        start_iteration, kl_coef = load_checkpoint(run["checkpoints"], actor, critic, ema, args, device)
    writer, metrics_file = start_logging(run, start_iteration, args) if is_main else (None, None)
    # Under ZeRO-3, each model's weights are gathered once per rollout (gathered); the hybrid engine gathers its own.
    gather_actor = args.gather_weights_for_rollout and not args.enable_hybrid_engine
    last_valid_rollout = None
    start_time = time.time()
    for iteration in range(start_iteration, args.num_iterations):
        # Seeds of the iteration's own: a resumed run repeats exactly what an uninterrupted one would have done.
        batch_prompts = prompts_of_iteration(prompts, iteration, rank, args)
        torch.manual_seed(args.seed * 100_003 + iteration * args.world_size + rank)  # sampling, mini-batch shuffles
        padded = tokenizer.pad({"input_ids": batch_prompts}, return_tensors="pt")  # left padding
        prompt_ids, prompt_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device)
        P = prompt_ids.shape[1]  # prompt length of this batch, padding included

        # ROLLOUT
        rollout_start = time.time()
        with torch.no_grad():
            # 1. Generate: sample a response to every prompt from the current policy pi_theta.
            with gathered(actor, gather_actor):  # one gather for the actor's generation and its log-probs
                responses = sample_responses(actor, prompt_ids, prompt_mask, generation_config, gather_actor,
                                             iteration, start_iteration)
                generation_time = time.time() - rollout_start
                # 2. Truncate after the stop token: response_mask is 1 up to and including the first EOS, then pad.
                response_mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
                responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
                sequences = torch.cat([prompt_ids, responses], dim=1)
                attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
                contains_eos = (responses == tokenizer.eos_token_id).any(dim=1)
                # 3. Log-probs and values, one model at a time, in micro-batches: log pi_theta(a_t|s_t) and
                # log pi_ref(a_t|s_t) at the sampling temperature, and V(s_t) from the token before a_t.
                chunks = [slice(i, i + args.per_device_train_batch_size)
                          for i in range(0, len(sequences), args.per_device_train_batch_size)]
                logprobs = torch.cat([response_logprobs(actor.module, sequences[c], attention_mask[c], P,
                                                        args.temperature) for c in chunks])
            with gathered(reference, args.gather_weights_for_rollout), adapters_disabled(reference.module):
                ref_logprobs = torch.cat([response_logprobs(reference.module, sequences[c], attention_mask[c], P,
                                                            args.temperature) for c in chunks])
            with gathered(critic, args.gather_weights_for_rollout):
                values = torch.cat([critic_values(critic.module, sequences[c], attention_mask[c], P, critic_mean,
                                                  critic_std) for c in chunks])
            # 4. Score prompt + truncated response at its last real token (the EOS, or the last token of a response
            # cut at max_new_tokens), normalized: (r(x, y) - reward_mean) / reward_std, in the reward model's tokens.
            with gathered(reward, args.gather_weights_for_rollout):
                scores = torch.cat([reward_scores(reward.module, *reward_model_inputs(sequences[c], attention_mask[c], P,
                                    tokenizer, reward_tokenizer), reward_mean, reward_std) for c in chunks])
            # The EOS trick (N+ detail 23): a response that never stopped gets a fixed low score.
            if args.missing_eos_penalty is not None:
                scores = torch.where(contains_eos, scores, -args.missing_eos_penalty)
            check_finite_rollout(response_mask, logprobs, ref_logprobs, values, scores, iteration, start_iteration)

            # 5. Invalid generations, too short to learn from, are left out of the update (their mask is zeroed).
            real_tokens = response_mask.sum(dim=1) - contains_eos.long()
            valid = real_tokens >= args.min_response_tokens
            update_mask = response_mask * valid.unsqueeze(1)

            # 6. Per-token rewards r_t = -beta KL_t, plus the clipped score on the last token; GAE advantages.
            rewards, kl = rlhf_math.per_token_rewards(
                scores, logprobs, ref_logprobs, update_mask, kl_coef, args.clip_score, args.kl_estimator)
            if args.whiten_rewards:
                rewards = rlhf_math.masked_whiten(rewards, update_mask, shift_mean=False,
                                                  stats=batch_mean_var(rewards, update_mask, args.whiten_across_ranks))
            advantages, returns = rlhf_math.gae_advantages_and_returns(rewards, values, update_mask, args.gamma, args.lam)
            if args.whiten_advantages:
                advantages = rlhf_math.masked_whiten(
                    advantages, update_mask, stats=batch_mean_var(advantages, update_mask, args.whiten_across_ranks))
            rollout = dict(sequences=sequences, attention_mask=attention_mask, logprobs=logprobs, values=values,
                           advantages=advantages, returns=returns, mask=update_mask)
            reused = not valid.any()  # nothing to learn from: DeepSpeed-Chat trains on the last valid batch again
            if reused:
                rollout, P = reuse_last_valid_rollout(last_valid_rollout, iteration, rank, args)
            last_valid_rollout = (rollout, P)
        rollout_time = time.time() - rollout_start

        # UPDATE: num_ppo_epochs passes; each splits the batch into num_mini_batches optimizer steps of micro-batches.
        update_start = time.time()
        lr = actor.get_lr()[0]  # the rate of this iteration's first step
        update_sums = new_update_sums(device)
        for epoch in range(args.num_ppo_epochs):
            mini_batches = torch.randperm(len(rollout["mask"]), device=device).split(args.per_device_mini_batch_size)
            mini_batch_tokens = tokens_per_mini_batch(rollout["mask"], mini_batches)
            for mini_batch_index, mini_batch in enumerate(mini_batches):
                for micro_batch in mini_batch.split(args.per_device_train_batch_size):
                    mb = {k: v[micro_batch] for k, v in rollout.items()}
                    new_logits = response_logits(actor.module, mb["sequences"], mb["attention_mask"], P)
                    new_logprobs = rlhf_math.logprobs_from_logits(new_logits, mb["sequences"][:, P:], args.temperature)
                    pg_loss, pg_stats = rlhf_math.policy_loss(
                        new_logprobs, mb["logprobs"], mb["advantages"], mb["mask"], args.cliprange)
                    new_values = critic_values(critic.module, mb["sequences"], mb["attention_mask"], P, critic_mean,
                                               critic_std)
                    vf_loss, vf_clipfrac = rlhf_math.value_loss(
                        new_values, mb["values"], mb["returns"], mb["mask"], args.cliprange_value)
                    if epoch == 0 and mini_batch_index == 0 and not reused:  # before the first optimizer step
                        check_first_ratio(new_logprobs, mb["logprobs"], mb["mask"], iteration, args)
                    check_finite_losses(pg_loss, vf_loss, iteration)
                    weight = loss_weight(mb["mask"], mini_batch_tokens[mini_batch_index], args)
                    actor_loss = weight * pg_loss
                    if unsup_blocks is not None:  # InstructGPT's PPO-ptx: + gamma * the language-modelling loss
                        actor_loss = actor_loss + args.unsup_coef * pretraining_loss(actor, unsup_blocks, update_sums,
                                                                                     iteration, args)
                    actor.backward(actor_loss)
                    critic.backward(weight * vf_loss)
                    with aligned_overflow(actor, critic, args.align_overflow):
                        actor.step()  # DeepSpeed steps the optimizer at the end of each mini-batch's accumulation
                        critic.step()
                    add_update_sums(update_sums, new_logits, mb["mask"], pg_loss, vf_loss, pg_stats, vf_clipfrac, args)
                if ema is not None:
                    update_ema(ema, actor, args.ema_decay)  # after every actor optimizer step
        update_time = time.time() - update_start

        # LOGGING: TRL's metric names, each a mean over all ranks' responses or tokens (iteration_metrics).
        rollout_stats = dict(kl=kl, scores=scores, valid=valid, logprobs=logprobs, update_mask=update_mask,
                             response_mask=response_mask, contains_eos=contains_eos)
        times = {"eps": (iteration + 1 - start_iteration) * args.batch_size / (time.time() - start_time),
                 "time/rollout": rollout_time, "time/generation": generation_time, "time/update": update_time}
        metrics = iteration_metrics(update_sums, rollout_stats, kl_coef, lr, iteration, times, args)
        if args.target_kl is not None and metrics["val/num_invalid"] < args.batch_size:
            # Ziegler et al.'s adaptive controller: beta grows when the KL overshoots the target, shrinks below it.
            kl_coef = rlhf_math.adaptive_kl_coef(kl_coef, metrics["objective/kl"], args.target_kl, args.kl_horizon,
                                                 args.batch_size)
        if is_main:
            log_iteration(metrics, iteration, writer, metrics_file, tokenizer, (prompt_ids, responses, scores), args)
        if args.snapshot_every and ((iteration + 1) % args.snapshot_every == 0 or iteration + 1 == args.num_iterations):
            snapshot = os.path.join(args.output_dir, "snapshots", f"iteration_{iteration + 1}")
            save_engine_folder(actor, tokenizer, snapshot, {**saved_by, "iteration": iteration + 1, "finished": False})
        if args.save_every and (iteration + 1) % args.save_every == 0:
            save_checkpoint(iteration + 1, kl_coef, actor, critic, ema, args)

    # Save the trained actor and critic as ordinary Hugging Face folders, then mark the run finished.
    record = {**saved_by, "iteration": args.num_iterations, "finished": True}
    for name, engine in [("actor", actor), ("critic", critic), ("actor_ema", ema)]:
        if engine is not None:
            save_engine_folder(engine, tokenizer, os.path.join(args.output_dir, name), record)
    if is_main:
        write_json(os.path.join(args.output_dir, RECORD), {**read_record(args.output_dir), "finished": True})
        print(f"saved the actor and the critic to {args.output_dir}/actor and {args.output_dir}/critic "
              f"in {time.time() - start_time:.0f}s")
        metrics_file.close()
        writer.close()
