"""Stage 1 of PPO-RLHF: supervised fine-tuning (SFT).

The base model learns to continue each prompt with its preferred response (the `chosen` column of a preference data
set, as DeepSpeed-Chat does): next-token cross-entropy on the response tokens only, the prompt tokens masked out,
with EOS appended to every response so that the policy learns to stop. The result is the starting point of the
reward model (stage 2) and of the PPO actor and reference (stage 3).

    python sft.py                                   # the bundled toy task, a few minutes on a laptop CPU
    deepspeed --num_gpus 2 sft.py --zero-stage 3    # the same, on 2 ranks with ZeRO-3
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.integrations import HfDeepSpeedConfig


@dataclass
class Args:
    # Experiment
    exp_name: str = "sft"
    """the name of this experiment, the first part of the run name"""
    seed: int = 1
    """seed of the experiment (data order, initialisation)"""
    output_dir: str = "checkpoints/sft"
    """where the fine-tuned model is saved, as a Hugging Face folder (safetensors + tokenizer)"""
    track: bool = False
    """log to Weights & Biases (tensorboard logs are always written to runs/)"""
    wandb_project_name: str = "ppo-rlhf"
    """the wandb project, with --track"""
    logging_steps: int = 10
    """print and log the train loss every this many optimizer steps"""

    # Model and data
    model_name_or_path: str = "toy_task/base_model"
    """the base model: a Hugging Face hub name or a local folder"""
    tokenizer_name_or_path: str | None = None
    """the tokenizer, if not the model's own"""
    dataset: str = "toy_task/data"
    """a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder"""
    train_split: str = "train"
    """the split to train on"""
    eval_split: str = "test"
    """the held-out split for the evaluation loss and perplexity"""
    prompt_column: str = "prompt"
    """the column that holds the prompt"""
    response_column: str = "chosen"
    """the column that holds the demonstration (the preferred response)"""
    max_seq_len: int = 64
    """longest prompt + response + EOS, in tokens; longer rows are dropped (and counted), never truncated"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""

    # Optimization
    num_train_epochs: int = 2
    """passes over the training data"""
    per_device_train_batch_size: int = 16
    """sequences per rank per micro-batch"""
    per_device_eval_batch_size: int = 32
    """sequences per rank per evaluation batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    learning_rate: float = 1e-3
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
    """sequences per optimizer step: per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_training_steps: int = 0
    """optimizer steps in the whole run"""


def fail(message: str) -> None:
    """Stop with a one-line message that says what to fix, instead of a stack trace from inside a library."""
    raise SystemExit(f"sft.py: error: {message}")


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


def tokenize_demonstrations(data, tokenizer, args: Args, split: str) -> list[dict]:
    """prompt + response + EOS as token ids, with labels -100 on the prompt so that only the response is learned.

    Prompt and response are tokenized separately and their ids concatenated, so the boundary between them is exact.
    """
    examples, too_long = [], 0
    for i, row in enumerate(data):
        prompt, response = row[args.prompt_column], row[args.response_column]
        if not isinstance(prompt, str) or not prompt.strip():
            fail(f"row {i} of split {split!r} has an empty {args.prompt_column!r}; remove or fill it")
        if not isinstance(response, str) or not response.strip():
            fail(f"row {i} of split {split!r} has an empty {args.response_column!r}; remove or fill it")
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(prompt_ids) + len(response_ids) > args.max_seq_len:
            too_long += 1
            continue
        examples.append({"input_ids": prompt_ids + response_ids, "labels": [-100] * len(prompt_ids) + response_ids})
    if too_long and args.local_rank <= 0:
        print(f"dropped {too_long} of {len(data)} rows of split {split!r} longer than --max-seq-len {args.max_seq_len}")
    if not examples:
        fail(f"no row of split {split!r} fits --max-seq-len {args.max_seq_len}; raise it")
    return examples


def collate(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into a batch: input_ids, attention_mask, labels (-100 on padding)."""
    length = max(len(e["input_ids"]) for e in examples)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for e in examples:
        n_pad = length - len(e["input_ids"])
        batch["input_ids"].append(e["input_ids"] + [pad_token_id] * n_pad)
        batch["attention_mask"].append([1] * len(e["input_ids"]) + [0] * n_pad)
        batch["labels"].append(e["labels"] + [-100] * n_pad)
    return {k: torch.tensor(v) for k, v in batch.items()}


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


@torch.no_grad()
def evaluate(engine, loader, device) -> float:
    """Held-out loss: the mean cross-entropy per response token, over every rank's share of the split."""
    engine.eval()
    total = torch.zeros(2, device=device)  # [sum of token losses, number of tokens]
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # The logits at position i predict the token at position i + 1.
        labels = batch["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100, reduction="sum"
        )
        total += torch.stack([losses, (labels != -100).sum().float()])
    dist.all_reduce(total)
    engine.train()
    return (total[0] / total[1]).item()


def check_args(args: Args) -> None:
    """Bad flags stop the script here, with a message that names them, before anything is loaded."""
    for flag, value in [("--per-device-train-batch-size", args.per_device_train_batch_size),
                        ("--per-device-eval-batch-size", args.per_device_eval_batch_size),
                        ("--gradient-accumulation-steps", args.gradient_accumulation_steps),
                        ("--num-train-epochs", args.num_train_epochs), ("--logging-steps", args.logging_steps),
                        ("--max-seq-len", args.max_seq_len)]:
        if value < 1:
            fail(f"{flag} must be at least 1, not {value}")
    if not args.learning_rate > 0:
        fail(f"--learning-rate must be positive, not {args.learning_rate}")
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

    # Tokenizer. Padding must not be EOS: then the real EOS would be masked like padding (DeepSpeed-Chat's trap).
    check_model_folder(args.model_name_or_path, "check --model-name-or-path")
    tokenizer_path = args.tokenizer_name_or_path or args.model_name_or_path
    tokenizer = load_tokenizer(tokenizer_path, "check --tokenizer-name-or-path" if args.tokenizer_name_or_path
                               else "check --model-name-or-path", args.trust_remote_code)
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {tokenizer_path!r} has no EOS token; set one, or pick another with --tokenizer-name-or-path")
    added_pad_token = tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id
    if added_pad_token:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        if is_main:
            print(f"the tokenizer had no pad token distinct from EOS: added '<|pad|>' (id {tokenizer.pad_token_id})")

    # Data
    columns = [args.prompt_column, args.response_column]
    train_data = tokenize_demonstrations(load_split(args.dataset, args.train_split, columns), tokenizer, args,
                                         args.train_split)
    eval_data = tokenize_demonstrations(load_split(args.dataset, args.eval_split, columns), tokenizer, args,
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
        fail(f"{len(train_data)} training rows make no optimizer step of {args.batch_size} sequences; lower "
             "--per-device-train-batch-size or --gradient-accumulation-steps")
    args.num_training_steps = steps_per_epoch * args.num_train_epochs

    # Model. Under ZeRO-3, HfDeepSpeedConfig (kept alive until deepspeed.initialize) makes from_pretrained load the
    # weights already partitioned across ranks, so no rank ever holds the whole model.
    ds_config = deepspeed_config(args)
    hf_ds_config = HfDeepSpeedConfig(ds_config) if args.zero_stage == 3 else None  # noqa: F841
    config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    if args.max_seq_len > getattr(config, "max_position_embeddings", args.max_seq_len):
        fail(f"--max-seq-len {args.max_seq_len} is longer than the model's {config.max_position_embeddings} positions; "
             "lower it")
    if args.disable_dropout:
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
    # Loaded in the precision it trains in, not in the checkpoint's (transformers would keep an fp16 checkpoint in
    # fp16 in an fp32 run).
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, config=config, use_safetensors=True, trust_remote_code=args.trust_remote_code,
        dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype],
    )
    if added_pad_token:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
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

    start_loss = evaluate(engine, eval_loader, device)
    if is_main:
        print(f"{len(train_data)} train / {len(eval_data)} eval sequences; {args.num_training_steps} optimizer steps "
              f"of {args.batch_size} sequences; held-out loss before training {start_loss:.4f}")
        writer.add_scalar("eval/loss", start_loss, 0)

    # TRAINING LOOP
    start_time = time.time()
    step = 0
    progress = tqdm(total=args.num_training_steps, desc="sft", disable=not is_main)
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        running_loss = torch.zeros((), device=device)
        for micro_step, batch in enumerate(train_loader):
            if micro_step >= steps_per_epoch * args.gradient_accumulation_steps:
                break  # a last, incomplete accumulation would take a step on fewer sequences
            batch = {k: v.to(device) for k, v in batch.items()}
            # ALGO LOGIC: cross-entropy on the response tokens; Hugging Face shifts the labels by one inside.
            loss = engine(**batch).loss
            if not torch.isfinite(loss):
                fail(f"the loss became {loss.item()} at step {step}; lower --learning-rate or use --dtype fp32")
            engine.backward(loss)
            engine.step()  # steps the optimizer and scheduler only at the end of each accumulation
            running_loss += loss.detach()
            if engine.is_gradient_accumulation_boundary():
                step += 1
                progress.update()
                if step % args.logging_steps == 0:
                    mean_loss = running_loss / (args.logging_steps * args.gradient_accumulation_steps)
                    dist.all_reduce(mean_loss)
                    mean_loss = mean_loss.item() / args.world_size
                    running_loss.zero_()
                    if is_main:
                        lr = scheduler.get_last_lr()[0]
                        sps = step / (time.time() - start_time)
                        progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}")
                        writer.add_scalar("train/loss", mean_loss, step)
                        writer.add_scalar("train/lr", lr, step)
                        writer.add_scalar("charts/steps_per_second", sps, step)
                        progress.write(f"step {step}: train loss {mean_loss:.4f}, lr {lr:.2e}, {sps:.1f} steps/s")
    progress.close()

    final_loss = evaluate(engine, eval_loader, device)
    if is_main:
        print(f"held-out loss {start_loss:.4f} -> {final_loss:.4f}, perplexity {math.exp(start_loss):.2f} -> "
              f"{math.exp(final_loss):.2f}, in {time.time() - start_time:.0f}s")
        writer.add_scalar("eval/loss", final_loss, step)
        writer.add_scalar("eval/perplexity", math.exp(final_loss), step)

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
        print(f"saved the SFT model to {args.output_dir}")
        writer.close()
