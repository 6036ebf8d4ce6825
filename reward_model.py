"""Stage 2 of PPO-RLHF: the reward model.

A copy of the SFT model with a scalar head instead of the language-model head learns to score prompt + response so
that the preferred response of each pair scores higher (InstructGPT eq. 1, a Bradley-Terry model of preferences):

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))          (rlhf_math.pairwise_reward_loss)

The score of a sequence is the head's output at its last real token: the EOS that ends every response it trains on,
the place where ppo.py reads it and where its score lands. A response cut at the length limit has no EOS and is scored
at its last token, by the normalization as by ppo.py (unless its --missing-eos-penalty replaces that score). After
training, the policy that PPO starts from (the SFT model) answers training prompts, and the mean and standard
deviation of the scores of its responses, the cut ones included, are stored in the checkpoint's config.json as
`reward_mean` and `reward_std`; ppo.py and evaluate.py use (score - reward_mean) / reward_std, which has mean 0 and
standard deviation 1 on those responses, and about that on PPO's first rollouts when they sample that policy at the
same temperature and length (ppo.py warns otherwise): reward normalization with a gain and a bias (Ziegler et al. 2019).

    python reward_model.py                                   # the bundled toy task, from checkpoints/sft
    deepspeed --num_gpus 2 reward_model.py --zero-stage 3    # the same, on 2 ranks with ZeRO-3
"""

import functools
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Literal

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import tyro
from torch.utils.data import DataLoader, DistributedSampler
from tqdm.auto import tqdm
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig,
                          get_cosine_schedule_with_warmup)
from transformers.integrations import HfDeepSpeedConfig

import plumbing
import rlhf_math
from plumbing import Fraction, PositiveFloat, PositiveInt, Seed


@dataclass
class Args:
    # Experiment
    exp_name: str = "reward_model"
    """the name of this experiment, the first part of the run name"""
    seed: Seed = 1
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
    logging_steps: PositiveInt = 10
    """print and log the train loss and accuracy (means over the optimizer steps since the last log) every this many
    optimizer steps, and at the last"""

    # Model and data
    model_name_or_path: str = "checkpoints/sft"
    """the model the reward model starts from: the SFT checkpoint (stage 1), a hub name or a local folder"""
    tokenizer_name_or_path: str | None = None
    """the tokenizer, when the model's own is not the one to use"""
    dataset: str = os.path.join(plumbing.TOY_TASK, "data")
    """the preference pairs: a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder (the
    bundled toy task's by default, found from any working folder)"""
    train_split: str = "train"
    """the split of pairs to train on"""
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
    max_seq_len: PositiveInt = 64
    """longest prompt + response + EOS, in tokens; pairs with a longer side are dropped (and counted), never truncated"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes with their hub repository"""

    # Optimization
    num_train_epochs: PositiveInt = 1
    """passes over the training pairs"""
    per_device_train_batch_size: PositiveInt = 16
    """pairs per rank per micro-batch (each pair is two sequences)"""
    per_device_eval_batch_size: PositiveInt = 32
    """pairs per rank per evaluation batch"""
    gradient_accumulation_steps: PositiveInt = 1
    """micro-batches of pairs accumulated into one optimizer step"""
    learning_rate: PositiveFloat = 4e-4
    """peak learning rate of AdamW (the toy default; real models of 1B parameters want about 1e-5)"""
    warmup_ratio: Fraction = 0.05
    """share of the optimizer steps spent warming the learning rate up, before its cosine decay to 0"""
    weight_decay: float = 0.0
    """AdamW's weight decay"""
    gradient_clipping: float = 1.0
    """the largest gradient norm of an optimizer step; larger ones are scaled down to it"""
    gradient_checkpointing: bool = False
    """recompute the activations during the backward pass (less memory, about a third more compute)"""
    disable_dropout: bool = True
    """every dropout probability 0, as PPO's models have it (--no-disable-dropout keeps the model's own)"""

    # Reward normalization: the scores of the policy's own responses set reward_mean and reward_std
    normalization_samples: int = 1024
    """responses sampled from the policy for training prompts, after training (rounded up to a multiple of the ranks);
    their scores' mean and standard deviation are stored as reward_mean and reward_std, so that the normalized score
    has mean 0 and std 1 on them"""
    policy_model_name_or_path: str | None = None
    """the policy that samples them, the one PPO starts from; --model-name-or-path (the SFT model) when not set"""
    max_new_tokens: PositiveInt = 24
    """longest sampled response: ppo.py's --max-new-tokens"""
    temperature: PositiveFloat = 1.0
    """sampling temperature: ppo.py's --temperature"""

    # DeepSpeed
    zero_stage: Literal[0, 1, 2, 3] = 0
    """the reward model's ZeRO stage: 0 data parallel, 1 + optimizer states sharded, 2 + gradients, 3 + parameters"""
    offload: bool = False
    """keep the optimizer states (and at ZeRO-3 the parameters) in CPU memory"""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """precision of training and of the normalization's sampling; fp16 needs a GPU"""
    local_rank: int = -1
    """this process's rank on its node (the deepspeed launcher passes it)"""

    # Filled in at runtime
    world_size: int = 0
    """number of ranks"""
    batch_size: int = 0
    """pairs per optimizer step: per_device_train_batch_size x gradient_accumulation_steps x world_size"""
    num_training_steps: int = 0
    """optimizer steps in the whole run"""


def main(args: Args) -> None:
    """Stage 2: train the reward model on the preference pairs, measure its score normalization, then save it."""
    check_args(args)
    device = plumbing.init_distributed(args, zero3=args.zero_stage == 3)
    is_main = dist.get_rank() == 0
    # As in sft.py, the output folder is claimed before anything loads; the policy's folder is an input too.
    plumbing.on_rank_0(lambda: plumbing.claim_output_dir(args.output_dir, {
        "--model-name-or-path": args.model_name_or_path, "--tokenizer-name-or-path": args.tokenizer_name_or_path,
        "--policy-model-name-or-path": args.policy_model_name_or_path, "--dataset": args.dataset}, args.overwrite))
    run_name = plumbing.on_rank_0(lambda: plumbing.new_run_name(args.exp_name, args.seed))  # runs/RUN_NAME

    # The seed decides the order of the pairs, the head's initialisation and the normalization's samples.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # Tokenizer, with a pad token distinct from EOS: the score is read at the EOS, which Hugging Face's own pooling
    # (the saved model's logits, read by any tool) would take for padding, and skip, if pad were EOS.
    model_hint = "train stage 1 first (python sft.py) or check --model-name-or-path"
    plumbing.check_model_folder(args.model_name_or_path, model_hint)
    if args.policy_model_name_or_path is not None:
        plumbing.check_model_folder(args.policy_model_name_or_path, "check --policy-model-name-or-path")
    tokenizer, added_pad_token = plumbing.load_tokenizer_with_pad(
        args.tokenizer_name_or_path or args.model_name_or_path,
        "check --tokenizer-name-or-path" if args.tokenizer_name_or_path else model_hint, args.trust_remote_code,
        is_main, args.model_name_or_path)
    # The policy that samples the normalization's responses reads its own tokens: with another vocabulary than the
    # reward model's, each prompt is decoded to text and tokenized for it, and each response back for the reward model.
    policy_tokenizer = None
    if args.policy_model_name_or_path is not None:
        policy_tokenizer = plumbing.load_other_tokenizer(args.policy_model_name_or_path,
                                                         "check --policy-model-name-or-path", tokenizer,
                                                         args.trust_remote_code)
        plumbing.check_vocabulary(policy_tokenizer or tokenizer, args.policy_model_name_or_path,
                                  "check --policy-model-name-or-path", args.trust_remote_code,
                                  0 if policy_tokenizer else added_pad_token)

    # Data
    columns = [args.chosen_column, args.rejected_column]
    columns = columns if args.split_conversations else [args.prompt_column, *columns]
    train_data = tokenize_pairs(plumbing.load_split(args.dataset, args.train_split, columns), tokenizer, args,
                                args.train_split)
    eval_data = tokenize_pairs(plumbing.load_split(args.dataset, args.eval_split, columns), tokenizer, args,
                               args.eval_split)
    collate_fn = functools.partial(collate, pad_token_id=tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_data, args.per_device_train_batch_size, sampler=train_sampler,
                              collate_fn=collate_fn, drop_last=True)
    args.batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    steps_per_epoch = len(train_loader) // args.gradient_accumulation_steps
    if steps_per_epoch == 0:
        plumbing.fail(f"{len(train_data)} training pairs make no optimizer step of {args.batch_size} pairs; lower "
                      "--per-device-train-batch-size or --gradient-accumulation-steps")
    args.num_training_steps = steps_per_epoch * args.num_train_epochs

    # Model: the SFT model with a freshly initialised scalar head (num_labels=1), so that the saved reward model loads
    # in any tool that reads Hugging Face reward models. Under ZeRO-3, HfDeepSpeedConfig (kept alive until
    # deepspeed.initialize) makes from_pretrained load the weights already partitioned across ranks.
    ds_config = deepspeed_config(args)
    hf_ds_config = HfDeepSpeedConfig(ds_config) if args.zero_stage == 3 else None  # noqa: F841
    config = plumbing.model_config(args.model_name_or_path, args.disable_dropout, args.trust_remote_code, num_labels=1)
    plumbing.check_positions(config, args.max_seq_len, f"--max-seq-len {args.max_seq_len}")
    plumbing.check_positions(config, args.max_seq_len + args.max_new_tokens, f"--max-seq-len {args.max_seq_len} + "
                             f"--max-new-tokens {args.max_new_tokens} (a training prompt and a sampled response)")
    # Loaded in the precision it trains in, not in the checkpoint's (transformers would keep an fp16 checkpoint in
    # fp16 in an fp32 run).
    dtype = plumbing.TORCH_DTYPES[args.dtype]
    # Only the new head may be missing from the SFT checkpoint (its language-model head is left unused).
    model = plumbing.load_pretrained(AutoModelForSequenceClassification, args.model_name_or_path, model_hint,
                                     new_head=True, config=config, trust_remote_code=args.trust_remote_code,
                                     dtype=dtype)
    plumbing.check_finite_weights(model, f"model {args.model_name_or_path!r}")
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        plumbing.fail(f"{type(model).__name__} has no linear `score` head; use a model whose sequence-classification "
                      "head is called `score` (Llama, Mistral, Qwen, GPT-NeoX/Pythia, OPT, GPT-2, ...)")
    if args.gradient_checkpointing:
        model.config.use_cache = False
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if added_pad_token:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    # The head starts at N(0, 1/sqrt(hidden + 1)) (Stiennon et al. 2020; "N+ implementation details", detail 11), so
    # that the initial scores are small. Under ZeRO-3 the weight is a shard: gather it, let rank 0 write it.
    with deepspeed.zero.GatheredParameters([model.score.weight], modifier_rank=0):
        torch.nn.init.normal_(model.score.weight, std=1 / math.sqrt(model.config.hidden_size + 1))
    optimizer = plumbing.adamw(model, args.learning_rate, args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * args.num_training_steps), args.num_training_steps
    )
    engine = plumbing.initialize_engine(model, ds_config, optimizer, scheduler)
    writer = None
    if is_main:
        writer = plumbing.start_tensorboard(run_name, args)
        print(f"{len(train_data)} train / {len(eval_data)} eval pairs; {args.num_training_steps} optimizer steps "
              f"of {args.batch_size} pairs")

    # TRAINING LOOP: each optimizer step accumulates the gradients of gradient_accumulation_steps micro-batches.
    start_time = time.time()
    step = 0
    running = torch.zeros(2, device=device)  # [loss, accuracy] summed over the micro-batches since the last log
    progress = tqdm(total=args.num_training_steps, desc="reward model", disable=not is_main)
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        micro_batches = iter(train_loader)
        for _ in range(steps_per_epoch):  # an epoch's last, incomplete accumulation would take a step on fewer pairs
            for _ in range(args.gradient_accumulation_steps):
                batch = next(micro_batches)
                # ALGO LOGIC: score chosen and rejected in one forward pass, then the pairwise (Bradley-Terry) loss.
                scores = sequence_scores(engine.module, batch["input_ids"].to(device),
                                         batch["attention_mask"].to(device))
                chosen_scores, rejected_scores = scores.chunk(2)
                loss, accuracy = rlhf_math.pairwise_reward_loss(chosen_scores, rejected_scores)
                if not torch.isfinite(loss) and step == 0:
                    plumbing.fail(f"the loss is {loss.item()} before any training: the model's forward pass gives "
                                  f"non-finite numbers; check --model-name-or-path (with --dtype {args.dtype}, try "
                                  "fp32)")
                if not torch.isfinite(loss):
                    plumbing.fail(f"the loss became {loss.item()} at step {step}; lower --learning-rate or use "
                                  "--dtype fp32")
                engine.backward(loss)
                engine.step()  # steps the optimizer and scheduler only after the accumulation's last micro-batch
                running += torch.stack([loss.detach(), accuracy])
            step += 1
            progress.update()
            if step % args.logging_steps == 0 or step == args.num_training_steps:
                window = (step - 1) % args.logging_steps + 1  # optimizer steps since the last log; fewer in the last
                dist.all_reduce(running)
                mean_loss, mean_accuracy = (running / (window * args.gradient_accumulation_steps
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

    # Held-out figures: each rank evaluates every world_size-th pair, so that together they cover the split once; a
    # rank with one fewer evaluates a copy that is not counted too, in step with the others (plumbing.rank_share).
    eval_share = plumbing.rank_share(eval_data, dist.get_rank(), args.world_size,
                                     lambda pair: {**pair, "counted": False})
    eval_loader = DataLoader(eval_share, args.per_device_eval_batch_size, collate_fn=collate_fn)
    metrics = evaluate(engine, eval_loader, device)
    if is_main:
        print(f"held-out accuracy {metrics['accuracy']:.4f}, loss {metrics['loss']:.4f}, mean score chosen "
              f"{metrics['chosen_score']:.3f} / rejected {metrics['rejected_score']:.3f}, in {time.time() - start_time:.0f}s")
        for name, value in metrics.items():
            writer.add_scalar(f"eval/{name}", value, step)

    # REWARD NORMALIZATION (Ziegler et al. 2019; lm-human-preferences' gain and bias). The policy PPO starts from
    # answers training prompts, sampled as ppo.py samples, and the mean and standard deviation of the trained model's
    # scores of those responses (a response cut at --max-new-tokens scored at its last token, as ppo.py scores it)
    # go into config.json. ppo.py and evaluate.py use (score - reward_mean) / reward_std: mean 0 and std 1 on them,
    # about that where PPO starts, so --clip-score and --kl-coef mean the same whatever the model's own scale.
    engine.eval()
    policy_path = args.policy_model_name_or_path or args.model_name_or_path
    policy = plumbing.load_pretrained(AutoModelForCausalLM, policy_path, "check --policy-model-name-or-path",
                                      dtype=dtype, trust_remote_code=args.trust_remote_code)
    if added_pad_token and policy_tokenizer is None:  # the pad token added above pads the policy's prompts too
        policy.resize_token_embeddings(len(tokenizer))
    if args.zero_stage == 3:  # partitioned like the reward model (HfDeepSpeedConfig is still alive)
        # The engine stays referenced: freeing it would remove the hooks that gather the partitioned weights.
        policy_engine = plumbing.initialize_engine(policy, {
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
            "bf16": {"enabled": args.dtype == "bf16"}, "fp16": {"enabled": args.dtype == "fp16"}})
        policy = policy_engine.module
    else:
        policy = policy.to(device)
    policy.eval()
    # Plain multinomial sampling at the temperature, pad suppressed; this replaces the folder's own
    # generation_config.json, whose settings (a repetition penalty, min_new_tokens) would change what is sampled.
    sampler = policy_tokenizer or tokenizer
    policy.generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
        eos_token_id=sampler.eos_token_id, pad_token_id=sampler.pad_token_id, suppress_tokens=[sampler.pad_token_id])
    per_rank = math.ceil(args.normalization_samples / args.world_size)  # the same on every rank: ZeRO-3 steps together
    picked = random.Random(args.seed).choices(range(len(train_data)), k=per_rank * args.world_size)
    prompts = [train_data[i]["prompt"] for i in picked[dist.get_rank() :: args.world_size]]
    moments = torch.zeros(3, dtype=torch.float64, device=device)  # [number, sum, sum of squares] of the scores
    with torch.no_grad():
        for start in range(0, per_rank, args.per_device_eval_batch_size):
            batch = prompts[start : start + args.per_device_eval_batch_size]
            policy_batch = batch if policy_tokenizer is None else [policy_tokenizer(
                tokenizer.decode(p, skip_special_tokens=True), split_special_tokens=True)["input_ids"] for p in batch]
            width = max(len(p) for p in policy_batch)  # left padding: every response starts at position `width`
            prompt_ids = torch.tensor([[sampler.pad_token_id] * (width - len(p)) + p for p in policy_batch],
                                      device=device)
            prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in policy_batch], device=device)
            responses = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                        synced_gpus=args.zero_stage == 3)[:, width:]
            lengths = rlhf_math.response_mask_from_stop(responses, sampler.eos_token_id).sum(dim=1)  # EOS included
            responses = [r[:n].tolist() for r, n in zip(responses, lengths)]
            if policy_tokenizer is not None:  # the response's text in the reward model's tokens, its EOS kept
                responses = [tokenizer(policy_tokenizer.decode(r, skip_special_tokens=True), add_special_tokens=False,
                                       split_special_tokens=True)["input_ids"]
                             + [tokenizer.eos_token_id] * (sampler.eos_token_id in r) for r in responses]
            sequences = [p + r for p, r in zip(batch, responses)]
            scored = right_pad(sequences, tokenizer.pad_token_id)
            scores = sequence_scores(engine.module, scored["input_ids"].to(device),
                                     scored["attention_mask"].to(device)).double()
            moments += torch.stack([torch.tensor(float(len(scores)), dtype=torch.float64, device=device),
                                    scores.sum(), (scores**2).sum()])
    dist.all_reduce(moments)
    n, total, total_squares = moments.tolist()
    reward_mean, reward_std = total / n, math.sqrt(max(total_squares - n * (total / n) ** 2, 0.0) / (n - 1))
    if not (math.isfinite(reward_mean) and math.isfinite(reward_std) and reward_std > 0):
        plumbing.fail(f"the scores of the {int(n)} normalization responses have mean {reward_mean} and standard "
                      f"deviation {reward_std}: the reward model must score them finite and not all alike; train it "
                      "longer, or check --policy-model-name-or-path, --temperature and --max-new-tokens")
    engine.module.config.reward_mean, engine.module.config.reward_std = reward_mean, reward_std
    # What the scale was measured on, for ppo.py to compare with its actor and sampling (check_normalization).
    engine.module.config.reward_normalization = {"policy": policy_path,
                                                 "policy_identity": plumbing.folder_identity(policy_path),
                                                 "temperature": args.temperature,
                                                 "max_new_tokens": args.max_new_tokens}
    if is_main:
        print(f"reward normalization: on {int(n)} responses of {policy_path!r} to training prompts the scores have mean "
              f"{engine.module.config.reward_mean:.4f} and standard deviation {engine.module.config.reward_std:.4f}, "
              "stored as reward_mean and reward_std in config.json")

    # Save an ordinary Hugging Face folder, reward_mean and reward_std in its config.json (under ZeRO-3 the full
    # weights are gathered from every rank's shards).
    plumbing.save_engine_folder(engine, tokenizer, args.output_dir, {
        "script": "reward_model.py", "finished": True, "run_name": run_name, "args": asdict(args)})
    if is_main:
        print(f"saved the reward model to {args.output_dir}")
        writer.close()
    plumbing.end_run()


def tokenize_pairs(data, tokenizer, args: Args, split: str) -> list[dict]:
    """Each pair as two token-id lists, prompt + chosen + EOS and prompt + rejected + EOS.

    Prompt and response are tokenized separately and their ids concatenated, as sft.py and ppo.py do, so that the
    reward model reads each prompt in the tokens ppo.py gives the policy, and each response in the tokens sft.py taught
    the policy to produce.
    """
    examples, too_long, same = [], 0, 0
    for i, row in enumerate(data):
        chosen = plumbing.text_of(row, i, args.chosen_column, split)
        rejected = plumbing.text_of(row, i, args.rejected_column, split)
        if args.split_conversations:  # both hold the whole conversation; the prompt ends at chosen's last marker
            ids = plumbing.prompt_ids(tokenizer, row, i, args.chosen_column, split, args.assistant_marker)
            prompt, chosen = plumbing.split_conversation(chosen, args.assistant_marker, f"row {i} of split {split!r}")
            if not rejected.startswith(prompt):
                plumbing.fail(f"row {i} of split {split!r}: {args.rejected_column!r} does not begin with the "
                              f"conversation of {args.chosen_column!r} up to its last {args.assistant_marker!r}; fix "
                              "or remove the row")
            rejected = rejected[len(prompt) :]
        else:
            ids = plumbing.prompt_ids(tokenizer, row, i, args.prompt_column, split)
            plumbing.refuse_repeated_prompt(row[args.prompt_column],
                                            {args.chosen_column: chosen, args.rejected_column: rejected}, i, split)
        sides = [ids + plumbing.response_ids(tokenizer, response, f"row {i} of split {split!r}, column {column!r}")
                 for response, column in [(chosen, args.chosen_column), (rejected, args.rejected_column)]]
        if max(len(s) for s in sides) > args.max_seq_len:
            too_long += 1
            continue
        if sides[0] == sides[1]:  # no preference: with dropout off the loss's gradient is 0; never ranked right
            same += 1
            continue
        examples.append({"prompt": ids, "chosen": sides[0], "rejected": sides[1]})
    if os.environ.get("RANK", "0") == "0":  # the global rank: every node has a local rank 0
        if too_long:
            print(f"dropped {too_long} of {len(data)} pairs of split {split!r} longer than --max-seq-len "
                  f"{args.max_seq_len}")
        if same:
            print(f"dropped {same} of {len(data)} pairs of split {split!r} whose chosen and rejected responses are the "
                  "same tokens (no preference to learn)")
    if not examples and same:
        plumbing.fail(f"every pair of split {split!r} that fits --max-seq-len has the same chosen and rejected "
                      f"response: there is no preference to learn; check --chosen-column {args.chosen_column!r} and "
                      f"--rejected-column {args.rejected_column!r}")
    if not examples:
        plumbing.fail(f"no pair of split {split!r} fits --max-seq-len {args.max_seq_len}; raise it")
    return examples


def right_pad(sequences: list[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Token-id lists -> input_ids and attention_mask [len(sequences), longest], padded on the right."""
    length = max(len(s) for s in sequences)
    input_ids = [s + [pad_token_id] * (length - len(s)) for s in sequences]
    attention_mask = [[1] * len(s) + [0] * (length - len(s)) for s in sequences]
    return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


def collate(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """B pairs -> one right-padded batch of 2B sequences, the B chosen first, then the B rejected; and `counted` [B],
    False for the copies that only keep an evaluation's ranks in step (plumbing.rank_share)."""
    batch = right_pad([e["chosen"] for e in examples] + [e["rejected"] for e in examples], pad_token_id)
    return {**batch, "counted": torch.tensor([e.get("counted", True) for e in examples])}


def deepspeed_config(args: Args) -> dict:
    """The DeepSpeed config of the reward model being trained, from the flags: micro-batch, gradient accumulation and
    clipping, ZeRO stage, offload and precision."""
    # Under ZeRO-3 the reward model keeps no small parameter (a norm, a bias, the scalar head) whole on every rank
    # (DeepSpeed-Chat keeps those under 10k elements whole): each one kept whole would cost an all-gather of its own
    # after every optimizer step, while a partitioned one comes in the coalesced all-gather that prefetches its layer.
    # memory_efficient_linear off: otherwise loading a ZeRO-3 model replaces torch.nn.functional.linear, for the
    # whole process (the policy that samples for the reward normalization too), with a slower autograd function.
    config = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.gradient_clipping,
        "zero_optimization": {"stage": args.zero_stage, "stage3_param_persistence_threshold": 0,
                              "memory_efficient_linear": False},
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "steps_per_print": 10**9,
    }
    if args.offload:  # Adam's states in CPU memory, and under ZeRO-3 the weights too
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if args.zero_stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return config


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward r(x, y) of each right-padded sequence: the scalar head at its last real token (the EOS; the last
    response token of a normalization response cut at --max-new-tokens, as ppo.reward_scores reads it).

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
        chosen, rejected = (side[batch["counted"].to(device)] for side in scores.chunk(2))
        n = len(chosen)
        if n > 0:
            loss, accuracy = rlhf_math.pairwise_reward_loss(chosen, rejected)
            total += torch.stack([loss * n, accuracy * n, chosen.sum(), rejected.sum(),
                                  torch.tensor(float(n), device=device)])
    dist.all_reduce(total)
    engine.train()
    n = total[4].item()
    return {"loss": total[0].item() / n, "accuracy": total[1].item() / n,
            "chosen_score": total[2].item() / n, "rejected_score": total[3].item() / n}


def check_args(args: Args) -> None:
    """Bad flags stop the script here, with a message that names them, before anything is loaded."""
    plumbing.check_ranges(args)
    if args.normalization_samples < 2:
        plumbing.fail(f"--normalization-samples must be at least 2 (a standard deviation needs two), not "
                      f"{args.normalization_samples}")


if __name__ == "__main__":
    main(tyro.cli(Args))
