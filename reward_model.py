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

import functools
import math
import os
import random
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from typing import Literal

import datasets
import deepspeed
import numpy as np
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
    """where the reward model is saved, as a Hugging Face folder (safetensors + tokenizer)"""
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
    """the column that holds the prompt"""
    chosen_column: str = "chosen"
    """the column that holds the preferred response"""
    rejected_column: str = "rejected"
    """the column that holds the other response"""
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
    The stages' own outputs (checkpoints/...) are local, even before the stage that writes them has run."""
    return not (os.path.exists(path) or path.startswith(("/", ".", "~", "checkpoints/")) or path.count("/") > 1
                or os.path.isdir(path.split("/")[0]))


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
    if not any(f.endswith(".safetensors") for f in files):
        if any(f.endswith(".bin") for f in files):
            fail(f"{path!r} has no model.safetensors; only safetensors weights are loaded (no pickle): if you trust "
                 "the file, convert it once with from_pretrained(path, use_safetensors=False).save_pretrained(path)")
        fail(f"{path!r} has no model weights (model.safetensors); {hint}")


def load_tokenizer(path: str, hint: str, trust_remote_code: bool):
    """AutoTokenizer.from_pretrained, or a one-line error that says what to fix."""
    if not is_hub_name(path) and not os.path.isdir(path):
        fail(f"no tokenizer folder at {path!r}; {hint}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        fail(f"cannot load a tokenizer from {path!r} ({' '.join(str(error).split())}); {hint}")


def load_split(dataset: str, split: str, columns: list[str]) -> datasets.Dataset:
    """One split of a hub data set or of local .json/.jsonl/.parquet files, checked for the columns we need."""
    if not os.path.exists(dataset) and not is_hub_name(dataset):
        fail(f"no data set at {dataset!r}; check --dataset")
    if os.path.isfile(dataset) and not dataset.endswith((".json", ".jsonl", ".parquet")):
        fail(f"--dataset {dataset!r} is not a .json, .jsonl or .parquet file")
    if os.path.isfile(dataset) and os.path.getsize(dataset) == 0:
        fail(f"--dataset {dataset!r} is an empty file")
    try:
        if os.path.isfile(dataset):  # one file is every split; a slice such as train[:64] still applies
            kind = "parquet" if dataset.endswith(".parquet") else "json"
            data = datasets.load_dataset(kind, data_files={split.split("[")[0]: dataset}, split=split)
        else:
            data = datasets.load_dataset(dataset, split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as error:
        error = error.__cause__ or error  # the generation error's cause says which row is malformed
        fail(f"cannot load split {split!r} of data set {dataset!r} ({error}); check --dataset and the split flags")
    missing = [c for c in columns if c not in data.column_names]
    if missing:
        fail(f"data set {dataset!r} split {split!r} has no column {missing}; its columns are {data.column_names}")
    return data


def tokenize_pairs(data, tokenizer, args: Args, split: str) -> list[dict]:
    """Each pair as two token-id lists, prompt + chosen + EOS and prompt + rejected + EOS.

    Prompt and response are tokenized separately and their ids concatenated, as sft.py and ppo.py do, so that the
    reward model sees exactly the token sequences that the policy produces.
    """
    examples, too_long = [], 0
    for i, row in enumerate(data):
        for column in [args.prompt_column, args.chosen_column, args.rejected_column]:
            if not isinstance(row[column], str) or not row[column].strip():
                fail(f"row {i} of split {split!r} has an empty {column!r}; remove or fill it")
        prompt_ids = tokenizer(row[args.prompt_column])["input_ids"]
        sides = []
        for column in [args.chosen_column, args.rejected_column]:
            response_ids = tokenizer(row[column], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            sides.append(prompt_ids + response_ids)
        if max(len(s) for s in sides) > args.max_seq_len:
            too_long += 1
            continue
        examples.append({"prompt": prompt_ids, "chosen": sides[0], "rejected": sides[1]})
    if too_long and args.local_rank <= 0:
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


def deepspeed_config(args: Args) -> dict:
    """The DeepSpeed config of a trained model (optimizer and scheduler are passed to deepspeed.initialize)."""
    zero = {"stage": args.zero_stage, "stage3_gather_16bit_weights_on_model_save": True}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if args.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.gradient_clipping,
        "zero_optimization": zero,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "steps_per_print": 10**9,
    }


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


if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)

    # Distributed set-up. The deepspeed launcher sets RANK, WORLD_SIZE and friends; a plain `python` run is one rank.
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
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    args.world_size = dist.get_world_size()
    is_main = dist.get_rank() == 0
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"

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
    columns = [args.prompt_column, args.chosen_column, args.rejected_column]
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
    ds_config = deepspeed_config(args)
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
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, config=config, use_safetensors=True, trust_remote_code=args.trust_remote_code,
        dtype=dtype)
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
    # With --offload the optimizer step runs on the CPU, and DeepSpeed wants its own vectorised CPU Adam there.
    adam = deepspeed.ops.adam.DeepSpeedCPUAdam if args.offload else torch.optim.AdamW
    optimizer = adam(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * args.num_training_steps), args.num_training_steps
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    engine.train()  # from_pretrained returns a model in eval mode, and gradient checkpointing only acts in train mode

    # Logging: tensorboard always, wandb with --track, and the hyperparameters as a table.
    writer = None
    if is_main:
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, name=run_name, config=asdict(args), sync_tensorboard=True)
        writer = SummaryWriter(f"runs/{run_name}")
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
    policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype, use_safetensors=True,
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
    # weights (every rank must take part) and let rank 0 write them. Written to a temporary folder, then renamed, so
    # that an interrupted save never leaves a half-written checkpoint behind.
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=args.zero_stage == 3):
        if is_main:
            tmp_dir = args.output_dir.rstrip("/") + ".tmp"
            shutil.rmtree(tmp_dir, ignore_errors=True)
            engine.module.save_pretrained(tmp_dir, safe_serialization=True)
            tokenizer.save_pretrained(tmp_dir)
            shutil.rmtree(args.output_dir, ignore_errors=True)
            os.replace(tmp_dir, args.output_dir)
    if is_main:
        print(f"saved the reward model to {args.output_dir}")
        writer.close()
