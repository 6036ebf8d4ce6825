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
import time
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import tyro
from torch.utils.data import DataLoader, DistributedSampler
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup
from transformers.integrations import HfDeepSpeedConfig

import plumbing
from plumbing import Fraction, PositiveFloat, PositiveInt, Seed


@dataclass
class Args:
    # Experiment
    exp_name: str = "sft"
    """the name of this experiment, the first part of the run name"""
    seed: Seed = 1
    """seed of the experiment (data order, initialisation)"""
    output_dir: str = "checkpoints/sft"
    """where the fine-tuned model is saved, as a Hugging Face folder (safetensors + tokenizer); a new or empty folder,
    or one that sft.py wrote before"""
    overwrite: bool = False
    """write into a non-empty --output-dir that sft.py did not write: files of the same names are replaced, nothing
    else is deleted"""
    track: bool = False
    """log to Weights & Biases (tensorboard logs are always written to runs/)"""
    wandb_project_name: str = "ppo-rlhf"
    """the wandb project, with --track"""
    logging_steps: PositiveInt = 10
    """print and log the train loss (the mean over the optimizer steps since the last log) every this many optimizer
    steps, and at the last"""

    # Model and data
    model_name_or_path: str = os.path.join(plumbing.TOY_TASK, "base_model")
    """the base model: a Hugging Face hub name or a local folder (the bundled toy task's, found from any folder)"""
    tokenizer_name_or_path: str | None = None
    """the tokenizer, if not the model's own"""
    dataset: str = os.path.join(plumbing.TOY_TASK, "data")
    """a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder (the toy task's by default)"""
    train_split: str = "train"
    """the split to train on"""
    eval_split: str = "test"
    """the held-out split for the evaluation loss and perplexity"""
    prompt_column: str = "prompt"
    """the column that holds the prompt: text, or a list of {"role", "content"} chat messages (the tokenizer's chat
    template makes it a prompt)"""
    response_column: str = "chosen"
    """the column that holds the demonstration (the preferred response)"""
    split_conversations: bool = False
    """the hh-rlhf layout: --response-column holds the whole conversation, and the prompt is its text up to and including the
    last --assistant-marker"""
    assistant_marker: str = "\n\nAssistant:"
    """where the last assistant turn opens in a whole conversation (--split-conversations)"""
    max_seq_len: PositiveInt = 64
    """longest prompt + response + EOS, in tokens; longer rows are dropped (and counted), never truncated"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""

    # Optimization
    num_train_epochs: PositiveInt = 2
    """passes over the training data"""
    per_device_train_batch_size: PositiveInt = 16
    """sequences per rank per micro-batch"""
    per_device_eval_batch_size: PositiveInt = 32
    """sequences per rank per evaluation batch"""
    gradient_accumulation_steps: PositiveInt = 1
    """micro-batches per optimizer step"""
    learning_rate: PositiveFloat = 1e-3
    """peak learning rate of AdamW (the toy default; real models of 1B parameters want about 1e-5)"""
    warmup_ratio: Fraction = 0.05
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
    """this process's rank on its node (the deepspeed launcher passes it; torchrun sets LOCAL_RANK)"""

    # Filled in at runtime
    world_size: int = 0
    """number of ranks"""
    batch_size: int = 0
    """sequences per optimizer step: per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_training_steps: int = 0
    """optimizer steps in the whole run"""


def main(args: Args) -> None:
    """Stage 1: fine-tune the base model on the demonstrations, then save it (the whole loop inline)."""
    plumbing.check_ranges(args)  # bad flags stop here, before anything is loaded
    device = plumbing.init_distributed(args, zero3=args.zero_stage == 3)
    is_main = dist.get_rank() == 0
    # The output folder is checked, locked and claimed before anything loads: a run never trains for an hour to find
    # that it cannot save, nor writes over a folder it does not own.
    plumbing.on_rank_0(lambda: plumbing.claim_output_dir(args.output_dir, {
        "--model-name-or-path": args.model_name_or_path, "--tokenizer-name-or-path": args.tokenizer_name_or_path,
        "--dataset": args.dataset}, args.overwrite))
    run_name = plumbing.on_rank_0(lambda: plumbing.new_run_name(args.exp_name, args.seed))  # runs/RUN_NAME

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # Tokenizer, with a pad token distinct from EOS: the EOS that ends every response must be learned, not masked.
    plumbing.check_model_folder(args.model_name_or_path, "check --model-name-or-path")
    tokenizer, added_pad_token = plumbing.load_tokenizer_with_pad(
        args.tokenizer_name_or_path or args.model_name_or_path,
        "check --tokenizer-name-or-path" if args.tokenizer_name_or_path else "check --model-name-or-path",
        args.trust_remote_code, is_main, args.model_name_or_path)

    # Data
    columns = [args.response_column] if args.split_conversations else [args.prompt_column, args.response_column]
    train_data = tokenize_demonstrations(plumbing.load_split(args.dataset, args.train_split, columns), tokenizer, args,
                                         args.train_split)
    eval_data = tokenize_demonstrations(plumbing.load_split(args.dataset, args.eval_split, columns), tokenizer, args,
                                        args.eval_split)
    collate_fn = functools.partial(collate, pad_token_id=tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_data, args.per_device_train_batch_size, sampler=train_sampler,
                              collate_fn=collate_fn, drop_last=True)
    # Each rank evaluates every world_size-th example, so that the held-out figures cover the split exactly once; a
    # rank with one fewer evaluates a copy with no label counted too, in step with the others (plumbing.rank_share).
    eval_share = plumbing.rank_share(eval_data, dist.get_rank(), args.world_size,
                                     lambda example: {**example, "labels": [-100] * len(example["labels"])})
    eval_loader = DataLoader(eval_share, args.per_device_eval_batch_size, collate_fn=collate_fn)
    args.batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    if len(train_loader) < args.gradient_accumulation_steps:
        plumbing.fail(f"{len(train_data)} training rows make no optimizer step of {args.batch_size} sequences; lower "
                      "--per-device-train-batch-size or --gradient-accumulation-steps")
    # An epoch's last, incomplete accumulation is left out: it would take a step on fewer sequences.
    steps_per_epoch = len(train_loader) // args.gradient_accumulation_steps
    args.num_training_steps = steps_per_epoch * args.num_train_epochs

    # Model
    config = plumbing.model_config(args.model_name_or_path, args.disable_dropout, args.trust_remote_code)
    plumbing.check_positions(config, args.max_seq_len, f"--max-seq-len {args.max_seq_len}")
    # Under ZeRO-3, HfDeepSpeedConfig (kept alive until deepspeed.initialize) makes from_pretrained load the weights
    # already partitioned across ranks, so no rank ever holds the whole model.
    ds_config = deepspeed_config(args)
    hf_ds_config = HfDeepSpeedConfig(ds_config) if args.zero_stage == 3 else None  # noqa: F841
    # Loaded in the precision it trains in, not in the checkpoint's (transformers would keep an fp16 checkpoint in
    # fp16 in an fp32 run).
    model = plumbing.load_pretrained(AutoModelForCausalLM, args.model_name_or_path, "check --model-name-or-path",
                                     config=config, trust_remote_code=args.trust_remote_code,
                                     dtype=plumbing.TORCH_DTYPES[args.dtype])
    plumbing.check_finite_weights(model, f"model {args.model_name_or_path!r}")
    if added_pad_token:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    if args.gradient_checkpointing:
        model.config.use_cache = False
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    optimizer = plumbing.adamw(model, args.learning_rate, args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * args.num_training_steps), args.num_training_steps
    )
    engine = plumbing.initialize_engine(model, ds_config, optimizer, scheduler)
    writer = plumbing.start_tensorboard(run_name, args) if is_main else None

    start_loss = evaluate(engine, eval_loader, device)
    if not math.isfinite(start_loss):
        plumbing.fail(f"the held-out loss before training is {start_loss}: the model's forward pass gives non-finite "
                      f"numbers; check --model-name-or-path (with --dtype {args.dtype}, try fp32)")
    if is_main:
        print(f"{len(train_data)} train / {len(eval_data)} eval sequences; {args.num_training_steps} optimizer steps "
              f"of {args.batch_size} sequences; held-out loss before training {start_loss:.4f}")
        writer.add_scalar("eval/loss", start_loss, 0)

    # TRAINING LOOP: each optimizer step accumulates the gradients of gradient_accumulation_steps micro-batches.
    start_time = time.time()
    step = 0
    running_loss = torch.zeros((), device=device)  # summed over the micro-batches since the last log, across epochs
    progress = tqdm(total=args.num_training_steps, desc="sft", disable=not is_main)
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        micro_batches = iter(train_loader)
        for _ in range(steps_per_epoch):
            for _ in range(args.gradient_accumulation_steps):
                batch = {k: v.to(device) for k, v in next(micro_batches).items()}
                # ALGO LOGIC: cross-entropy on the response tokens; Hugging Face shifts the labels by one inside.
                loss = engine(**batch).loss
                if not torch.isfinite(loss):
                    plumbing.fail(f"the loss became {loss.item()} at step {step}; lower --learning-rate or use "
                                  "--dtype fp32")
                engine.backward(loss)
                engine.step()  # steps the optimizer and scheduler only after the accumulation's last micro-batch
                running_loss += loss.detach()
            step += 1
            progress.update()
            if step % args.logging_steps == 0 or step == args.num_training_steps:
                window = (step - 1) % args.logging_steps + 1  # optimizer steps since the last log; fewer in the last
                mean_loss = running_loss / (window * args.gradient_accumulation_steps)
                dist.all_reduce(mean_loss)
                mean_loss = mean_loss.item() / args.world_size
                running_loss.zero_()
                if is_main:
                    lr, sps = scheduler.get_last_lr()[0], step / (time.time() - start_time)
                    progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}")
                    progress.write(f"step {step}: train loss {mean_loss:.4f}, lr {lr:.2e}, {sps:.1f} steps/s")
                    for name, value in [("train/loss", mean_loss), ("train/lr", lr), ("charts/steps_per_second", sps)]:
                        writer.add_scalar(name, value, step)
    progress.close()

    final_loss = evaluate(engine, eval_loader, device)
    if is_main:
        print(f"held-out loss {start_loss:.4f} -> {final_loss:.4f}, perplexity {math.exp(start_loss):.2f} -> "
              f"{math.exp(final_loss):.2f}, in {time.time() - start_time:.0f}s")
        writer.add_scalar("eval/loss", final_loss, step)
        writer.add_scalar("eval/perplexity", math.exp(final_loss), step)

    # Save an ordinary Hugging Face folder (under ZeRO-3 the full weights are gathered from every rank's shards).
    plumbing.save_engine_folder(engine, tokenizer, args.output_dir,
                                {"script": "sft.py", "finished": True, "run_name": run_name, "args": asdict(args)})
    if is_main:
        print(f"saved the SFT model to {args.output_dir}")
        writer.close()
    plumbing.end_run()


def tokenize_demonstrations(data, tokenizer, args: Args, split: str) -> list[dict]:
    """prompt + response + EOS as token ids, with labels -100 on the prompt so that only the response is learned.

    Prompt and response are tokenized separately and their ids concatenated, so the boundary between them is exact.
    """
    examples, too_long = [], 0
    for i, row in enumerate(data):
        response = plumbing.text_of(row, i, args.response_column, split)
        if args.split_conversations:  # the response column holds the whole conversation, prompt included
            ids = plumbing.prompt_ids(tokenizer, row, i, args.response_column, split, args.assistant_marker)
            response = plumbing.split_conversation(response, args.assistant_marker, f"row {i} of split {split!r}")[1]
        else:
            ids = plumbing.prompt_ids(tokenizer, row, i, args.prompt_column, split)
            plumbing.refuse_repeated_prompt(row[args.prompt_column], {args.response_column: response}, i, split)
        response_ids = plumbing.response_ids(tokenizer, response, f"row {i} of split {split!r}, column "
                                                                  f"{args.response_column!r}")
        if len(ids) + len(response_ids) > args.max_seq_len:
            too_long += 1
            continue
        examples.append({"input_ids": ids + response_ids, "labels": [-100] * len(ids) + response_ids})
    if too_long and os.environ.get("RANK", "0") == "0":  # the global rank: every node has a local rank 0
        print(f"dropped {too_long} of {len(data)} rows of split {split!r} longer than --max-seq-len {args.max_seq_len}")
    if not examples:
        plumbing.fail(f"no row of split {split!r} fits --max-seq-len {args.max_seq_len}; raise it")
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
    """The DeepSpeed config of the model being fine-tuned: micro-batch, gradient accumulation and clipping, ZeRO stage,
    offload and precision, from the flags."""
    # stage3_param_persistence_threshold 0: under ZeRO-3 no small parameter (a norm, a bias) stays whole on every rank
    # (DeepSpeed-Chat keeps those under 10k elements whole): each one kept whole would cost an all-gather of its own
    # after every optimizer step, while a partitioned one comes in the coalesced all-gather that prefetches its layer.
    # memory_efficient_linear off: otherwise loading the model under ZeRO-3 replaces torch.nn.functional.linear, for
    # the whole process, with a slower autograd function.
    zero = {"stage": args.zero_stage, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False}
    if args.offload:  # Adam's states in CPU memory
        zero["offload_optimizer"] = {"device": "cpu"}
    if args.offload and args.zero_stage == 3:  # and the weights
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "gradient_clipping": args.gradient_clipping, "zero_optimization": zero, "steps_per_print": 10**9,
            "bf16": {"enabled": args.dtype == "bf16"}, "fp16": {"enabled": args.dtype == "fp16"}}


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


if __name__ == "__main__":
    main(tyro.cli(Args))
