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

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

import deepspeed
import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import tyro
from deepspeed.accelerator import get_accelerator
from rich.console import Console
from rich.table import Table
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig,
                          StaticCache, get_scheduler)
from transformers.integrations import HfDeepSpeedConfig

import plumbing
import rlhf_math
from plumbing import CountInt, Fraction, NonNegativeFloat, PositiveFloat, PositiveInt, Seed


@dataclass
class Args:
    # Experiment
    exp_name: str = "ppo"
    """the name of this experiment, the first part of the run name"""
    seed: Seed = 1
    """seed of the experiment (prompt order, sampling)"""
    output_dir: str = "checkpoints/ppo"
    """where the actor and critic are saved (actor/, critic/), and checkpoints for --resume (resume/): a new or empty
    folder, or one that ppo.py wrote"""

    # Models and data
    actor_model_name_or_path: str = "checkpoints/sft"
    """the SFT model (stage 1): the actor and the reference start from it"""
    reward_model_name_or_path: str = "checkpoints/reward_model"
    """the reward model (stage 2), frozen; its score is normalized by its config's: (score - reward_mean) / reward_std.
    One with another tokenizer than the actor's reads each prompt + response as text tokenized again"""
    critic_model_name_or_path: str | None = None
    """where the critic starts; when not set, the reward model, or, if the reward model has another tokenizer, the
    actor with a fresh value head (the critic reads the actor's tokens)"""
    dataset: str = "toy_task/data"
    """a Hugging Face hub data set name, or a local .json/.jsonl/.parquet file or folder; only prompts are used"""
    train_split: str = "train"
    """the split whose prompts are sampled"""
    prompt_column: str = "prompt"
    """the column that holds the prompt: text, or {"role", "content"} chat messages (the chat template applies)"""
    split_conversations: bool = False
    """the hh-rlhf layout: each cell of --prompt-column (pass --prompt-column chosen) holds the whole conversation,
    and the prompt is its text up to and including the last --assistant-marker"""
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
    sampler: Literal["auto", "eager", "static"] = "auto"
    """eager: `sample`, token by token; static: `sample_static`, fixed shapes for one decode step, compiled and on CUDA
    replayed as a CUDA graph; auto: static on CUDA unless the actor has LoRA adapters, --enable-hybrid-engine, or
    --no-gather-weights-for-rollout under ZeRO-3"""
    min_response_tokens: int = 1
    """responses with fewer real tokens (EOS not counted) are invalid and left out of the update"""
    missing_eos_penalty: float | None = None
    """the EOS trick: a response without EOS gets the score -MISSING_EOS_PENALTY, not the reward model's (TRL's)"""

    # PPO
    num_ppo_epochs: PositiveInt = 1
    """passes of PPO updates over each rollout batch (TRL's default is 4; one keeps the toy run under 2 minutes)"""
    num_mini_batches: PositiveInt = 4
    """optimizer steps per PPO epoch: the rollout batch is split into this many mini-batches"""
    per_device_train_batch_size: PositiveInt = 16
    """sequences per rank per forward pass, in the rollout's scoring and the update (accumulated to a mini-batch)"""
    actor_learning_rate: PositiveFloat = 2e-4
    """actor learning rate, decayed linearly to 0 (the toy default; real models of 1B parameters want about 3e-6)"""
    critic_learning_rate: PositiveFloat = 1e-4
    """critic learning rate, decayed linearly to 0"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """the learning rates of actor and critic: decayed linearly to 0 over the run, or constant"""
    weight_decay: float = 0.0
    """AdamW weight decay of actor and critic"""
    gradient_clipping: float = 1.0
    """clip each trained model's gradient norm to this (0: no clipping)"""
    kl_coef: NonNegativeFloat = 0.1
    """beta, the coefficient of the per-token KL penalty (the initial value, with --target-kl)"""
    target_kl: Annotated[float | None, "be positive"] = None
    """turn on Ziegler et al.'s adaptive KL controller, which steers the mean KL per response toward this"""
    kl_horizon: PositiveFloat = 10000
    """horizon of the adaptive KL controller, in episodes"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """the per-token KL estimator of the penalty (see rlhf_math.kl_per_token)"""
    clip_score: PositiveFloat = 5.0
    """the normalized score is clipped to [-clip_score, clip_score] (standard deviations of the SFT policy's scores)"""
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
    """whiten over all ranks' batch; --no-whiten-across-ranks, each rank's share alone as TRL (erasing, with few
    responses per rank, which of them was good)"""
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
    trace_every: CountInt = 0
    """every this many iterations, print one response token by token with each RL quantity the loop computed for it
    (docs/algorithm.md, "One response, position by position") and append it to runs/RUN_NAME/trace.jsonl (0: never)"""
    trace_response: Literal["stopped", "cut"] = "stopped"
    """the response --trace-every shows: the first that stopped with EOS (and padding), or the first cut at the limit"""
    snapshot_every: CountInt = 0
    """save the actor as a Hugging Face folder in OUTPUT_DIR/snapshots/iteration_N every this many iterations and at
    the last (0: never), for evaluate.py's picture of reward-model and gold scores along training"""
    resume: bool = False
    """continue the unfinished run in OUTPUT_DIR from its latest complete checkpoint with its settings. Only those that
    change how the run is saved, logged or laid out in memory may change: --save-every, --sample-every,
    --snapshot-every, --trace-every, --trace-response, --track, --wandb-project-name, --actor-zero-stage,
    --critic-zero-stage, --offload, --offload-reference-model, --offload-reward-model, --gather-weights-for-rollout,
    --actor-gradient-checkpointing, --critic-gradient-checkpointing, --release-inference-cache,
    --unpin-actor-parameters, --tp-gather-partition-size; and --actor-model-name-or-path, --reward-model-name-or-path,
    --critic-model-name-or-path may name moved folders that hold the same models"""
    overwrite: bool = False
    """write into a non-empty --output-dir that ppo.py did not write (replacing only what has the names it writes), or
    start a new run in one that holds an unfinished run's checkpoints (deleting them)"""

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
    """the layers that get adapters: peft's "all-linear" (all but the output head), or a regex of full module names"""
    actor_lora_learning_rate: PositiveFloat = 5e-4
    """learning rate of the actor's adapters (the rest of the actor keeps --actor-learning-rate)"""
    critic_lora_learning_rate: PositiveFloat = 5e-4
    """learning rate of the critic's adapters"""
    only_optimize_lora: bool = False
    """train only the adapters; the reference model is then the actor with its adapters off, one model less"""
    unsup_dataset: str | None = None
    """plain text for InstructGPT's pretraining mix (PPO-ptx): a hub data set, or a local .txt/.json/.jsonl/.parquet
    file (the toy task's: toy_task/pretrain.txt)"""
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
    """fp16 only (DeepSpeed-Chat's extra): when the actor's or the critic's loss scaler overflows, both skip the step"""
    enable_hybrid_engine: bool = False
    """generate with DeepSpeed's hybrid engine (DeepSpeed-Chat's extra, GPU only): inference kernels and TP"""
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


def main(args: Args) -> None:
    """Stage 3: PPO of the SFT model against the reward model, then the actor and the critic saved."""
    check_args(args)
    device = plumbing.init_distributed(args, zero3=3 in zero_stages(args).values())
    rank, is_main = dist.get_rank(), dist.get_rank() == 0

    # Batch arithmetic, checked once: an iteration answers batch_size prompts; each PPO epoch splits every rank's
    # share into num_mini_batches optimizer steps of gradient_accumulation_steps forward passes each.
    args.batch_size = args.per_device_rollout_batch_size * args.world_size
    args.num_iterations = plumbing.exact_div(args.total_episodes, args.batch_size,
                                             "--total-episodes / (rollout batch x ranks)")
    args.per_device_mini_batch_size = plumbing.exact_div(args.per_device_rollout_batch_size, args.num_mini_batches,
                                                         "--per-device-rollout-batch-size / --num-mini-batches")
    args.gradient_accumulation_steps = plumbing.exact_div(
        args.per_device_mini_batch_size, args.per_device_train_batch_size,
        "rollout batch per mini-batch / --per-device-train-batch-size")

    # The output folder, checked, locked and claimed before anything loads, and the run: a new one, or the one that
    # --resume continues.
    run = plumbing.on_rank_0(lambda: start_run(args))
    saved_by = {"script": "ppo.py", "run_name": run["run_name"], "metrics_file": run["metrics_file"]}
    tokenizer, reward_tokenizer, critic_path = check_models(args, is_main)
    prompts = plumbing.load_prompts(tokenizer, args.dataset, args.train_split, args.prompt_column, args.max_prompt_len,
                                    is_main, args.assistant_marker if args.split_conversations else None)
    if len(prompts) < args.batch_size:
        plumbing.fail(f"{len(prompts)} usable prompts, fewer than one iteration's {args.batch_size}; "
                      "raise --max-prompt-len or lower --per-device-rollout-batch-size")
    unsup_blocks = None if args.unsup_dataset is None else plumbing.load_text_blocks(  # PPO-ptx's text, [blocks, P + R]
        tokenizer, args.unsup_dataset, args.unsup_dataset_config, args.unsup_text_column,
        args.max_prompt_len + args.max_new_tokens, args.per_device_train_batch_size)

    torch.manual_seed(args.seed)  # LoRA's A matrices start random: the same seed gives the same adapters
    actor, reference, critic, reward, ema = build_engines(args, critic_path)
    # Reward normalization (Ziegler et al. 2019): (score - reward_mean) / reward_std has mean 0 and std 1 where PPO
    # starts. The critic starts as a copy of the reward model: its outputs are mapped the same way, by its own config.
    reward_mean, reward_std = score_normalization(reward.module.config)
    critic_mean, critic_std = score_normalization(critic.module.config)
    check_normalization(reward.module.config, run["inputs"]["--actor-model-name-or-path"], args)
    generation_config = sampling_config(tokenizer, args.max_new_tokens, args.temperature)
    actor.module.generation_config = generation_config  # replaces the model's own, so that nothing else is applied
    sampler = static_sampler(actor, generation_config, is_main, args, device) if samples_static(args, device) else None

    start_iteration, kl_coef, last_valid = 0, args.kl_coef, None  # last_valid: the last valid batch and its P
    if args.resume:
        start_iteration, kl_coef, last_valid = load_checkpoint(run["checkpoints"], actor, critic, ema, args, device)
    writer, metrics_file = start_logging(run, start_iteration, args) if is_main else (None, None)
    # Under ZeRO-3, each model's weights are gathered once per rollout (plumbing.gathered); the hybrid engine its own.
    gather_actor = args.gather_weights_for_rollout and not args.enable_hybrid_engine
    micro_batch = args.per_device_train_batch_size  # rows per forward pass, in the rollout's scoring and the update
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
            # (gathered: nothing below ZeRO-3; under it, one gather for the actor's generation and its log-probs.)
            with plumbing.gathered(actor, gather_actor):
                responses = sample_responses(actor, sampler, prompt_ids, prompt_mask, generation_config, gather_actor,
                                             args.enable_hybrid_engine, iteration, start_iteration)
                generation_time = time.time() - rollout_start
                # 2. Truncate after the stop token: response_mask is 1 up to and including the first EOS, then pad.
                response_mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
                responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
                sequences = torch.cat([prompt_ids, responses], dim=1)
                attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
                contains_eos = (responses == tokenizer.eos_token_id).any(dim=1)
                # 3. Log-probs and values, one model at a time, in micro-batches: log pi_theta(a_t|s_t) and
                # log pi_ref(a_t|s_t) at the sampling temperature, and V(s_t) from the token before a_t.
                logprobs = in_micro_batches(response_logprobs, micro_batch, actor.module, sequences, attention_mask,
                                            P, args.temperature)
            # (adapters_disabled: nothing without LoRA; with actor LoRA the reference is the actor, adapters off.)
            with plumbing.gathered(reference, args.gather_weights_for_rollout), \
                    plumbing.adapters_disabled(reference.module):
                ref_logprobs = in_micro_batches(response_logprobs, micro_batch, reference.module, sequences,
                                                attention_mask, P, args.temperature)
            with plumbing.gathered(critic, args.gather_weights_for_rollout):
                values = in_micro_batches(critic_values, micro_batch, critic.module, sequences, attention_mask, P,
                                          critic_mean, critic_std)
            # 4. Score prompt + truncated response at its last real token (the EOS, or the last token of a response
            # cut at max_new_tokens), normalized: (r(x, y) - reward_mean) / reward_std, in the reward model's tokens.
            with plumbing.gathered(reward, args.gather_weights_for_rollout):
                scores = in_micro_batches(reward_scores, micro_batch, reward.module, sequences, attention_mask, P,
                                          reward_mean, reward_std, tokenizer, reward_tokenizer)
            # The EOS trick (N+ detail 23): a response that never stopped gets a fixed low score.
            if args.missing_eos_penalty is not None:
                scores = torch.where(contains_eos, scores, -args.missing_eos_penalty)
            check_finite_rollout(response_mask, logprobs, ref_logprobs, values, scores, iteration, start_iteration)

            # 5. Invalid generations, too short to learn from, are left out of the update (their mask is zeroed).
            # The loop's three masks, each made once: attention_mask [B, P + R], what the models read (the prompt's
            # padding off); response_mask [B, R], each response up to its EOS (lengths, the EOS count); update_mask
            # [B, R], the valid responses' response_mask: rlhf_math's one mask, the only one that the rewards, the
            # advantages and the losses see.
            real_tokens = response_mask.sum(dim=1) - contains_eos.long()
            valid = real_tokens >= args.min_response_tokens
            update_mask = response_mask * valid.unsqueeze(1)

            # 6. Per-token rewards r_t = -beta KL_t, plus the clipped score on the last token; GAE advantages.
            rewards, kl = rlhf_math.per_token_rewards(
                scores, logprobs, ref_logprobs, update_mask, kl_coef, args.clip_score, args.kl_estimator)
            if args.whiten_rewards:
                rewards = rlhf_math.masked_whiten(rewards, update_mask, shift_mean=False,
                                                  stats=batch_mean_var(rewards, update_mask, args.whiten_across_ranks))
            gae_advantages, returns = rlhf_math.gae_advantages_and_returns(rewards, values, update_mask, args.gamma,
                                                                           args.lam)
            advantages = rlhf_math.masked_whiten(gae_advantages, update_mask, stats=batch_mean_var(
                gae_advantages, update_mask, args.whiten_across_ranks)) if args.whiten_advantages else gae_advantages
            rollout = dict(sequences=sequences, attention_mask=attention_mask, logprobs=logprobs, values=values,
                           advantages=advantages, returns=returns, mask=update_mask)
            # The update's batch and its prompt length P: this rollout, or, when none of its responses is valid, the
            # last valid batch (DeepSpeed-Chat's fallback; by default only bare EOS responses are invalid).
            batch, P = last_valid = last_valid_batch(rollout, P, valid, last_valid, iteration, rank, args)
        rollout_time = time.time() - rollout_start

        # UPDATE: num_ppo_epochs passes; each splits the batch into num_mini_batches optimizer steps of micro-batches.
        update_start = time.time()
        lr = actor.get_lr()[0]  # the rate of this iteration's first step
        update_sums, first_logprobs = new_update_sums(device), torch.full_like(logprobs, float("nan"))
        for epoch in range(args.num_ppo_epochs):
            mini_batches = torch.randperm(len(batch["mask"]), device=device).split(args.per_device_mini_batch_size)
            mini_batch_tokens = tokens_per_mini_batch(batch["mask"], mini_batches)
            for mini_batch_index, mini_batch in enumerate(mini_batches):
                for micro_batch_rows in mini_batch.split(micro_batch):
                    mb = {k: v[micro_batch_rows] for k, v in batch.items()}
                    # The policy's and the value function's new outputs on the rollout's sequences.
                    new_logits = response_logits(actor.module, mb["sequences"], mb["attention_mask"], P)
                    new_logprobs = rlhf_math.logprobs_from_logits(new_logits, mb["sequences"][:, P:],
                                                                  args.temperature)
                    new_values = critic_values(critic.module, mb["sequences"], mb["attention_mask"], P,
                                               critic_mean, critic_std)
                    # PPO's clipped surrogate objective and clipped value loss.
                    pg_loss, pg_stats = rlhf_math.policy_loss(
                        new_logprobs, mb["logprobs"], mb["advantages"], mb["mask"], args.cliprange)
                    vf_loss, vf_clipfrac = rlhf_math.value_loss(
                        new_values, mb["values"], mb["returns"], mb["mask"], args.cliprange_value)
                    first_step = epoch == 0 and mini_batch_index == 0 and batch is rollout
                    check_update(new_logprobs, mb, pg_loss, vf_loss, first_step, iteration, args)
                    if first_step and args.trace_every:  # before any optimizer step, for the trace
                        first_logprobs[micro_batch_rows] = new_logprobs.detach()
                    # Backward: each loss weighed by its micro-batch's share of the tokens; the actor's with PPO-ptx's
                    # gamma * language-modelling loss when --unsup-dataset is set (else ptx_loss is 0).
                    weight = loss_weight(mb["mask"], mini_batch_tokens[mini_batch_index], args)
                    ptx_loss = pretraining_loss(actor, unsup_blocks, update_sums, iteration, args)
                    actor.backward(weight * pg_loss + ptx_loss)
                    critic.backward(weight * vf_loss)
                    with aligned_overflow(actor, critic, args.align_overflow):  # nothing unless --align-overflow
                        actor.step()  # DeepSpeed steps the optimizer at the end of each mini-batch's accumulation
                        critic.step()
                    add_update_sums(update_sums, new_logits, mb["mask"], pg_loss, vf_loss, pg_stats, vf_clipfrac, args)
                update_ema(ema, actor, args.ema_decay)  # nothing unless --enable-ema: after every actor step
        update_time = time.time() - update_start

        # LOGGING: TRL's metric names, each a mean over all ranks' responses or tokens (iteration_metrics).
        rollout_stats = dict(kl=kl, scores=scores, valid=valid, logprobs=logprobs, update_mask=update_mask,
                             response_mask=response_mask, contains_eos=contains_eos)
        times = {"eps": (iteration + 1 - start_iteration) * args.batch_size / (time.time() - start_time),
                 "time/rollout": rollout_time, "time/generation": generation_time, "time/update": update_time,
                 **({"perf/decode_step_recordings": sampler["recordings"]} if sampler else {})}
        metrics = iteration_metrics(update_sums, rollout_stats, kl_coef, lr, iteration, times, args)
        if is_main:
            log_iteration(metrics, iteration, writer, metrics_file, tokenizer, (prompt_ids, responses, scores), args)
        # (trace_response, adapted_kl_coef, save_snapshot: nothing in a default run; they act with --trace-every,
        # --target-kl and --snapshot-every.)
        trace_response(iteration, tokenizer, responses, scores, first_logprobs, run, args, mask=update_mask,
                       logprob=logprobs, ref_logprob=ref_logprobs, kl=kl, reward=rewards, value=values,
                       advantage=gae_advantages, whitened=advantages, **{"return": returns})
        kl_coef = adapted_kl_coef(kl_coef, kl, valid, args)  # Ziegler et al.'s adaptive KL controller
        save_snapshot(actor, tokenizer, iteration + 1, saved_by, args)
        if args.save_every and (iteration + 1) % args.save_every == 0:
            save_checkpoint(iteration + 1, kl_coef, actor, critic, ema, last_valid, run["run_name"], args)

    # Save the trained actor and critic as ordinary Hugging Face folders, then mark the run finished.
    record = {**saved_by, "iteration": args.num_iterations, "finished": True}
    for name, engine in [("actor", actor), ("critic", critic), ("actor_ema", ema)]:
        if engine is not None:
            plumbing.save_engine_folder(engine, tokenizer, os.path.join(args.output_dir, name), record,
                                        merge_lora=True)
    if is_main:
        plumbing.write_json(os.path.join(args.output_dir, plumbing.RECORD),
                            {**(plumbing.read_record(args.output_dir) or saved_by), "finished": True})
        print(f"saved the actor and the critic to {args.output_dir}/actor and {args.output_dir}/critic "
              f"in {time.time() - start_time:.0f}s")
        metrics_file.close()
        writer.close()
    plumbing.end_run()


# ---------------------------------------------------------------------------------------------------------------
# The loop's helpers, in the order it first calls them: log-probs, values and scores, and the batches around them.
# ---------------------------------------------------------------------------------------------------------------
def score_normalization(config) -> tuple[float, float]:
    """The reward_mean and reward_std that reward_model.py stored in a model's config: the mean and standard deviation
    of its scores of the SFT policy's responses. (0, 1), no normalization, for a config without them."""
    if hasattr(config, "reward_mean") != hasattr(config, "reward_std"):
        has, lacks = ("reward_mean", "reward_std") if hasattr(config, "reward_mean") else ("reward_std", "reward_mean")
        plumbing.fail(f"{config.name_or_path!r}'s config.json has {has} but no {lacks}: the scores would be normalized "
                      f"by half a rule; run reward_model.py again on it, or delete {has} for no normalization")
    mean, std = getattr(config, "reward_mean", 0.0), getattr(config, "reward_std", 1.0)
    if not (all(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                for value in (mean, std)) and std > 0):
        plumbing.fail(f"the score normalization in {config.name_or_path!r}'s config.json, reward_mean {mean!r} and "
                      f"reward_std {std!r}, must be numbers with reward_std > 0: run reward_model.py again on it, or "
                      "delete both for none")
    return mean, std

def sampling_config(tokenizer, max_new_tokens: int, temperature: float) -> GenerationConfig:
    """Plain multinomial sampling from the temperature-scaled policy, the distribution whose log-probs are computed
    (no top-k, no top-p, no min_new_tokens, which would suppress EOS). The pad token is suppressed: a young policy
    samples it, and a pad inside a response breaks every mask built from padding (the log-probs keep pad in their
    softmax; its probability under the SFT model, and so the difference, is negligible)."""
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0,
                            top_p=1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            suppress_tokens=[tokenizer.pad_token_id])

def prompts_of_iteration(prompts: list, iteration: int, rank: int, args: Args) -> list:
    """This rank's share of an iteration's prompts. The prompts are shuffled once per pass over the data set, by a
    seed of that pass, so that a resumed run draws the prompts an uninterrupted one would have."""
    batches_per_pass = len(prompts) // args.batch_size
    order = np.random.default_rng([args.seed, iteration // batches_per_pass]).permutation(len(prompts))
    first = (iteration % batches_per_pass) * args.batch_size + rank * args.per_device_rollout_batch_size
    return [prompts[i] for i in order[first : first + args.per_device_rollout_batch_size]]

def sample_responses(actor, sampler: dict | None, prompt_ids, prompt_mask, generation_config, weights_gathered: bool,
                     hybrid: bool, iteration: int, start: int) -> torch.Tensor:
    """A response to each prompt, [B, P] -> [B, max_new_tokens] right-padded: `sample` (synced under ZeRO-3 without
    gathered weights), `sample_static` with a sampler, or the hybrid engine's generate; non-finite probabilities, or
    its failure, stop with one line."""
    actor.eval()  # in train mode, gradient checkpointing would switch the key-value cache off
    synced = actor.zero_optimization_stage() == 3 and not weights_gathered
    try:
        if hybrid:
            responses = actor.module.generate(input_ids=prompt_ids, attention_mask=prompt_mask, synced_gpus=synced,
                                              generation_config=generation_config)[:, prompt_ids.shape[1] :]
        elif sampler:
            responses = sample_static(sampler, actor.module, prompt_ids, prompt_mask, generation_config)
        else:
            responses = sample(actor.module, prompt_ids, prompt_mask, generation_config, synced)
    except Exception as error:
        if "probability tensor contains" in str(error):  # torch.multinomial's "... contains inf, nan or < 0"
            plumbing.fail(f"iteration {iteration}: the actor's next-token probabilities are not finite while "
                          f"sampling ({str(error).strip()}); " + ("lower the learning rates" if iteration > start
                                                else "check --actor-model-name-or-path and --temperature"))
        if hybrid and iteration == start and not isinstance(error, torch.OutOfMemoryError):  # its first generation
            plumbing.fail(f"DeepSpeed's hybrid engine failed on {type(actor.module).__name__} ({type(error).__name__}: "
                          f"{' '.join(str(error).split())}); its layers are transformers 4's (docs/extras.md): drop "
                          "--enable-hybrid-engine")
        raise  # a lost rank's error, or any other
    actor.train()
    return torch.nn.functional.pad(responses, (0, generation_config.max_new_tokens - responses.shape[1]),
                                   value=generation_config.pad_token_id)

def sample(model, prompt_ids, prompt_mask, config: GenerationConfig, synced: bool) -> torch.Tensor:
    """model.generate(generation_config=config) written out, the same tokens from the same seed (test_ppo): a_t ~
    softmax(logits / tau) with the key-value cache. [B, P] -> [B, <= max_new_tokens], pad after each EOS; it stops
    when all have, on every rank if synced."""
    cache, attention_mask, position_ids, tokens = None, prompt_mask, position_ids_from(prompt_mask), prompt_ids
    running, responses = torch.ones(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device), []  # no EOS yet
    for _ in range(config.max_new_tokens):
        out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                    use_cache=True, logits_to_keep=1)
        z = out.logits[:, -1].float() / config.temperature
        z[:, config.suppress_tokens] = -math.inf
        tokens = torch.where(running.unsqueeze(1), torch.multinomial(torch.softmax(z, dim=-1), 1), config.pad_token_id)
        responses.append(tokens)
        running &= tokens.squeeze(1) != config.eos_token_id
        # Synced (ZeRO-3 all-gathers each layer for every token), a rank that stopped alone would leave others waiting.
        if (plumbing.sum_over_ranks({"running": running.sum()})["running"] if synced else running.sum()) == 0:
            break
        cache = getattr(out, "cache", None)
        if cache is None:  # a model that ignores transformers' `cache` would go on from the last token alone
            plumbing.fail(f"{type(model).__name__} returns no key-value cache for transformers 5.24's `cache` "
                          "argument, which ppo.py samples with: upgrade transformers, or use one of its own models")
        attention_mask, position_ids = torch.cat([attention_mask, torch.ones_like(tokens)], 1), position_ids[:, -1:] + 1
    return torch.cat(responses, dim=1)

def sample_static(sampler: dict, actor, prompt_ids, prompt_mask, config: GenerationConfig) -> torch.Tensor:
    """`sample` with every shape fixed, so that one decode step is compiled once and, on CUDA, replayed from a recorded
    CUDA graph (a few launches a token, not hundreds): the prompts left-padded to --max-prompt-len, a static key-value
    cache, the stop check left on the device and read every 16 tokens. The same draw (test_ppo), from a copy of the
    actor (static_sampler); its logits only pick tokens: the update's log-probs come from the eager forward."""
    model, cache, R = sampler["model"], sampler["cache"], config.max_new_tokens
    plumbing.copy_weights(actor, model)  # pi_theta of this rollout, into the storage that the step reads
    if step_reads(model, cache) != sampler["reads"]:  # never for a kept copy: a graph would read freed memory
        record_decode_step(sampler, len(prompt_ids), config)
    pad = sampler["prompt_len"] - prompt_ids.shape[1]
    prompt_ids = torch.nn.functional.pad(prompt_ids, (pad, 0), value=config.pad_token_id)
    prompt_mask = torch.nn.functional.pad(prompt_mask, (pad, 0))
    cache.reset()
    # [B, P + R] from the start: the positions not yet written are hidden by causality, not by the mask.
    attention_mask, position_ids = torch.nn.functional.pad(prompt_mask, (0, R), value=1), position_ids_from(prompt_mask)
    tokens, running, responses = prompt_ids, torch.ones(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device), []
    for t in range(R):
        step = sampler["step"] if t else decode_step  # the prompt's pass, in the prompt's shape, runs eager
        _, tokens, running = step(model, cache, tokens, attention_mask, position_ids, running, config)
        tokens, running = tokens.clone(), running.clone()  # the next replay overwrites a recorded graph's outputs
        responses.append(tokens)
        if t % 16 == 15 and not running.any():  # a host sync every 16 tokens, not every token
            break
        position_ids = position_ids[:, -1:] + 1
    return torch.cat(responses, dim=1)

def decode_step(model, cache, tokens, attention_mask, position_ids, running, config: GenerationConfig):
    """One token of `sample` for every sequence: tokens [B, t] (the prompt, or the last token) in; out the scaled
    logits z [B, V], the next tokens [B, 1] and which sequences have no EOS yet [B]. a_t ~ softmax(z) is drawn as
    argmax_i p_i / q_i with q_i ~ Exp(1) > 0 (the race gives i with probability p_i): torch.multinomial syncs with the
    host."""
    out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=True, logits_to_keep=1)
    z = out.logits[:, -1].float() / config.temperature
    z[:, config.suppress_tokens] = -math.inf
    draw = (torch.softmax(z, dim=-1) / torch.empty_like(z).exponential_()).argmax(dim=-1, keepdim=True)
    tokens = torch.where(running.unsqueeze(1), draw, config.pad_token_id)
    return z, tokens, running & (tokens.squeeze(1) != config.eos_token_id)

def static_sampler(actor, config: GenerationConfig, is_main: bool, args: Args, device) -> dict:
    """What sample_static keeps from one rollout to the next, so that its recorded step reads the same memory every
    time: a copy of the actor (the weights copied in at each rollout; under ZeRO-3 the gathered ones are in new storage
    every time), a static key-value cache of --max-prompt-len + max_new_tokens positions, and the step. They stay
    through the update: freed, they would come back elsewhere, and the step would be recorded again."""
    if is_main:
        print("compiling the decode step of --sampler static (up to a minute) ...", flush=True)
    model = plumbing.inference_copy(actor.module, device, args.trust_remote_code)
    cache = StaticCache(config=model.config, max_cache_len=args.max_prompt_len + config.max_new_tokens)
    sampler = {"model": model, "cache": cache, "prompt_len": args.max_prompt_len, "recordings": 0}
    record_decode_step(sampler, args.per_device_rollout_batch_size, config)
    return sampler

@torch.no_grad()  # as in the rollout: a change of grad mode would compile the step again
def record_decode_step(sampler: dict, batch_size: int, config: GenerationConfig) -> None:
    """sampler["step"]: decode_step for [batch_size, 1] tokens, compiled, and on CUDA recorded as a CUDA graph, after a
    made-up prompt has laid out the static cache; the addresses it reads kept, its recordings counted."""
    model, cache = sampler["model"], sampler["cache"]
    vocabulary = model.get_input_embeddings().num_embeddings
    ids = torch.arange(batch_size * sampler["prompt_len"], device=model.device).view(batch_size, -1) % vocabulary
    mask, running = torch.ones_like(ids), torch.ones(batch_size, dtype=torch.bool, device=model.device)
    attention_mask = torch.nn.functional.pad(mask, (0, config.max_new_tokens), value=1)
    prompt = (model, cache, ids, attention_mask, position_ids_from(mask), running, config)
    decode_step(*prompt)  # lays out the cache's tensors
    step = torch.compile(decode_step, fullgraph=True, dynamic=False)
    position_ids = torch.full((batch_size, 1), sampler["prompt_len"], device=model.device)
    inputs = (model, cache, ids[:, -1:].contiguous(), attention_mask, position_ids, running, config)
    try:
        step(*inputs)  # compiled here, not in the first rollout
        sampler["step"] = plumbing.cuda_graph(step, inputs) if model.device.type == "cuda" else step
    except Exception as error:  # a model torch.compile cannot trace whole, a graph that cannot be recorded, memory
        plumbing.fail(f"--sampler static: the decode step of {type(model).__name__} could not be compiled and recorded "
                      f"({type(error).__name__}: {' '.join(str(error).split())[:300]}); use --sampler eager")
    # The recorded step against the eager one after the same prompt: a step that read the wrong memory would sample
    # from another policy, which nothing later sees (every log-prob is computed again by the eager forward).
    logits = []
    for run in (sampler["step"], decode_step):
        cache.reset()
        decode_step(*prompt)
        logits.append(run(*inputs)[0].clone())
    if not torch.allclose(*logits, rtol=0, atol=torch.where(logits[1].isfinite(), logits[1], 0).abs().max().item() / 8):
        plumbing.fail(f"--sampler static: the recorded decode step of {type(model).__name__} gives other logits than "
                      "the eager step; use --sampler eager")
    sampler["reads"], sampler["recordings"] = step_reads(model, cache), sampler["recordings"] + 1

def step_reads(model, cache) -> list[int]:
    """The addresses of the weights and the key-value cache that the decode step reads."""
    return [t.data_ptr() for t in [*model.parameters(), *model.buffers(), *(
        getattr(layer, name) for layer in cache.layers for name in ("keys", "values", "cumulative_length"))]]

def in_micro_batches(function, size: int, model, sequences: torch.Tensor, attention_mask: torch.Tensor, *args):
    """function(model, sequences, attention_mask, *args) over micro-batches of `size` rows, joined: one's memory."""
    return torch.cat([function(model, sequences[i : i + size], attention_mask[i : i + size], *args)
                      for i in range(0, len(sequences), size)])

def response_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      temperature: float) -> torch.Tensor:
    """log pi(a_t | s_t) of every response token, at the sampling temperature: [B, P + R] sequences -> [B, R]."""
    logits = response_logits(model, sequences, attention_mask, prompt_len)
    return rlhf_math.logprobs_from_logits(logits, sequences[:, prompt_len:], temperature)

def response_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits that predict each response token: [B, P + R] sequences -> [B, R, V]. Those at position P - 1 + t
    predict the token at P + t; only positions P - 1 to P + R - 1 go through the output layer (logits_to_keep)."""
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask),
                use_cache=False, logits_to_keep=sequences.shape[1] - prompt_len + 1)
    return out.logits[:, :-1]

def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip the left padding of the prompts: 0 at each prompt's first real token, as generate uses."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)

def critic_values(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, mean: float,
                  std: float) -> torch.Tensor:
    """V(s_t) for every response token: the critic's head at position P - 1 + t, the last token of the state before
    a_t, on the normalized reward scale ((output - mean) / std, as the scores). [B, P + R] -> [B, R]."""
    return (head_at_every_position(model, sequences, attention_mask)[:, prompt_len - 1 : -1] - mean) / std

def head_at_every_position(model, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A sequence classifier's scalar head applied at every position instead of only the last: [B, T] -> [B, T]."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=sequences, attention_mask=attention_mask,
                      position_ids=position_ids_from(attention_mask), use_cache=False).last_hidden_state
    return model.score(hidden).squeeze(-1).float()

def reward_scores(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, mean: float,
                  std: float, tokenizer=None, reward_tokenizer=None) -> torch.Tensor:
    """The normalized score (r(x, y) - mean) / std of each prompt + response, [B, P + R] -> [B]: the reward model's
    head at the last in-mask response position (the EOS, or the last token of a cut response), where
    rlhf_math.per_token_rewards lands it; with a tokenizer of its own, on the text tokenized again."""
    sequences, attention_mask, prompt_len = plumbing.retokenized(sequences, attention_mask, prompt_len, tokenizer,
                                                                 reward_tokenizer)
    token_scores = head_at_every_position(model, sequences, attention_mask)[:, prompt_len:]
    last = attention_mask[:, prompt_len:].sum(dim=1) - 1
    return (token_scores[torch.arange(len(token_scores), device=token_scores.device), last] - mean) / std

def batch_mean_var(x: torch.Tensor, mask: torch.Tensor, across_ranks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of x [B, R] over the in-mask positions of this rank's batch, or of every rank's
    batch together (sums of x, x^2 and the count added over the ranks); (0, 1), which whitens nothing, when fewer
    than two positions are in the mask (rlhf_math.mean_var_from_moments)."""
    x = torch.where(mask.bool(), x.double(), 0.0)
    moments = torch.stack([mask.sum().double(), x.sum(), (x**2).sum()])
    if across_ranks:
        dist.all_reduce(moments)
    return rlhf_math.mean_var_from_moments(*moments)

def last_valid_batch(rollout: dict, P: int, valid: torch.Tensor, last_valid, iteration: int, rank: int, args: Args):
    """The batch the update trains on and its prompt length: (rollout, P) if a response of this rank's rollout is
    valid (valid [B]); else DeepSpeed-Chat's fallback, the last valid batch again (last_valid, as this returned it
    before; sampled by an older policy, so its first ratio is not 1). Stops the run when there is none."""
    if valid.any():
        return rollout, P
    if last_valid is None:
        plumbing.fail(f"iteration {iteration}: no response has --min-response-tokens {args.min_response_tokens} "
                      "real tokens, and there is no earlier batch to reuse; check the SFT model and max_new_tokens")
    print(f"warning: rank {rank}, iteration {iteration}: every response is invalid; reusing the last valid batch")
    return last_valid

def tokens_per_mini_batch(mask: torch.Tensor, mini_batches: list[torch.Tensor]) -> torch.Tensor:
    """The in-mask tokens of each mini-batch, all ranks together: [num_mini_batches]. The update mask is [B, R];
    each mini-batch holds row indices."""
    counts = torch.stack([mask[mini_batch].sum() for mini_batch in mini_batches]).float()
    dist.all_reduce(counts)
    return counts

def loss_weight(mask: torch.Tensor, mini_batch_tokens: torch.Tensor, args: Args):
    """The factor on a micro-batch's loss, the mean over its n in-mask tokens (docs/implementation_details.md, detail
    38). token-mean: n / N, N the in-mask tokens of the whole mini-batch (all micro-batches, all ranks): the loss is
    the sum over the mini-batch's tokens divided by N, however it is split; times the accumulation steps and the
    ranks, the factor that undoes DeepSpeed's averaging (of the micro-batches' losses and of the ranks' gradients).
    micro-batch-mean: 1, DeepSpeed's average of the micro-batches' means (DeepSpeed-Chat and TRL)."""
    if args.loss_aggregation != "token-mean":
        return 1.0
    undo_deepspeed_average = args.gradient_accumulation_steps * args.world_size
    return mask.bool().sum() * undo_deepspeed_average / mini_batch_tokens.clamp(min=1)

def adapted_kl_coef(kl_coef: float, kl: torch.Tensor, valid: torch.Tensor, args: Args) -> float:
    """Ziegler et al.'s adaptive controller (rlhf_math.adaptive_kl_coef) on the mean KL per valid response, all ranks
    together (kl [B, R]); beta unchanged with no valid response, and without --target-kl."""
    if args.target_kl is None:
        return kl_coef
    kl_sum, num_valid = plumbing.sum_over_ranks({"kl": kl.sum(dim=1).sum(), "valid": valid.sum()}).values()
    if num_valid == 0:
        return kl_coef
    return rlhf_math.adaptive_kl_coef(kl_coef, kl_sum / num_valid, args.target_kl, args.kl_horizon, args.batch_size)


# ---------------------------------------------------------------------------------------------------------------
# The four DeepSpeed engines, as DeepSpeed-Chat's RLHF engine builds them: one config and one ZeRO stage each.
# ---------------------------------------------------------------------------------------------------------------
def zero_stages(args: Args) -> dict[str, int]:
    """Each model's ZeRO stage (DeepSpeed-Chat's rule): the reference follows the actor's, the reward model the
    critic's, as ZeRO-3 (all that shards a frozen model) or plain; their own offload to CPU memory needs ZeRO-3."""
    return {"actor": args.actor_zero_stage, "critic": args.critic_zero_stage,
            "reference": 3 if args.actor_zero_stage == 3 or args.offload_reference_model else 0,
            "reward": 3 if args.critic_zero_stage == 3 or args.offload_reward_model else 0}

def build_engines(args: Args, critic_path: str):
    """Actor, reference, critic and reward model (and with --enable-ema the actor's EMA, else None), each checked:
    critic and reward model have a 1-label score head, and no weight is inf or NaN."""
    actor_ds_config = deepspeed_config(args.actor_zero_stage, True, args.offload, args)
    if args.enable_hybrid_engine:  # DeepSpeed-Chat's, GPU only: the actor generates on inference kernels, with its
        # own tensor parallelism and key-value cache, swapped in and out between eval() and train()
        actor_ds_config["hybrid_engine"] = {
            "enabled": True, "max_out_tokens": args.max_prompt_len + args.max_new_tokens,
            "inference_tp_size": args.inference_tp_size, "release_inference_cache": args.release_inference_cache,
            "pin_parameters": not args.unpin_actor_parameters,
            "tp_gather_partition_size": args.tp_gather_partition_size}
    actor = init_engine(AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
                        actor_ds_config, args, args.actor_learning_rate, args.actor_gradient_checkpointing,
                        args.actor_lora_dim, args.actor_lora_learning_rate)
    # With only the actor's adapters trained, the actor with its adapters off is the SFT model: it is the reference
    # (plumbing.adapters_disabled), and a whole model copy is never loaded.
    reference = actor if args.only_optimize_lora else init_engine(
        AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
        deepspeed_config(zero_stages(args)["reference"], False, args.offload_reference_model, args), args)
    critic = init_engine(AutoModelForSequenceClassification, critic_path, "--critic-model-name-or-path",
                         deepspeed_config(args.critic_zero_stage, True, args.offload, args), args,
                         args.critic_learning_rate, args.critic_gradient_checkpointing, args.critic_lora_dim,
                         args.critic_lora_learning_rate)
    reward = init_engine(AutoModelForSequenceClassification, args.reward_model_name_or_path,
                         "--reward-model-name-or-path",
                         deepspeed_config(zero_stages(args)["reward"], False, args.offload_reward_model, args), args)
    check_score_head(reward.module, args.reward_model_name_or_path, "--reward-model-name-or-path")
    check_score_head(critic.module, critic_path, "--critic-model-name-or-path")
    # Each weights file is checked once: the reference (and the EMA) load the actor's, and the critic, unless
    # --critic-model-name-or-path is set, the reward model's.
    plumbing.check_finite_weights(actor.module, f"model {args.actor_model_name_or_path!r} (--actor-model-name-or-path)")
    plumbing.check_finite_weights(reward.module,
                                  f"model {args.reward_model_name_or_path!r} (--reward-model-name-or-path)")
    if critic_path != args.reward_model_name_or_path:
        plumbing.check_finite_weights(critic.module, f"model {critic_path!r} (--critic-model-name-or-path)")
    ema = init_ema(actor, args) if args.enable_ema else None
    return actor, reference, critic, reward, ema

def deepspeed_config(stage: int, trained: bool, offload: bool, args) -> dict:
    """One model's DeepSpeed config. Trained models get gradient accumulation and clipping (their optimizer and
    scheduler are passed to deepspeed.initialize); frozen ones only run forward passes."""
    # ZeRO-3 keeps no small parameter whole on every rank (DeepSpeed-Chat keeps norms and biases): each costs an
    # all-gather of its own after every step, where a partitioned one comes in its layer's coalesced prefetch.
    # memory_efficient_linear off: else ZeRO-3 replaces torch.nn.functional.linear, process-wide, by a slower one.
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False}
    if offload and trained:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": args.per_device_train_batch_size, "zero_optimization": zero,
              "bf16": {"enabled": args.dtype == "bf16"}, "fp16": {"enabled": args.dtype == "fp16"},
              "steps_per_print": 10**9}
    if trained:
        config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        config["gradient_clipping"] = args.gradient_clipping
    return config

def init_engine(model_class, path: str, flag: str, ds_config: dict, args: Args, learning_rate: float | None = None,
                gradient_checkpointing: bool = False, lora_dim: int = 0, lora_learning_rate: float = 0.0):
    """A model (every weight must load) in its DeepSpeed engine, with LoRA adapters if lora_dim > 0: with an optimizer
    and a learning-rate schedule if given a learning rate (actor, critic), else frozen (reference, reward, EMA)."""
    # Under ZeRO-3, HfDeepSpeedConfig (alive while from_pretrained runs) loads the weights already partitioned.
    hf_ds_config = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None  # noqa: F841
    config = plumbing.model_config(path, args.disable_dropout, args.trust_remote_code)
    # Loaded in the engine's precision, not the checkpoint's (transformers would keep an fp16 one in fp16).
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float16 if ds_config["fp16"]["enabled"] \
        else torch.float32
    # A critic from a causal LM (the actor, when the reward model reads other tokens) gets a fresh 1-label head; a
    # reward model, frozen, must bring its trained one.
    new_head = model_class is AutoModelForSequenceClassification and \
        any(name.endswith("ForCausalLM") for name in config.architectures or [])
    if new_head and learning_rate is None:
        plumbing.fail(f"{path!r} is a causal language model, not a reward model: its score head would start random; "
                      f"name a folder that reward_model.py wrote ({flag})")
    if new_head:
        config.num_labels = 1
        if dist.get_rank() == 0:
            print(f"the critic starts from {path!r} with a fresh value head")
    model = plumbing.load_pretrained(model_class, path, f"check {flag}", new_head=new_head, config=config, dtype=dtype,
                                     trust_remote_code=args.trust_remote_code)
    if lora_dim:
        model = plumbing.add_lora(model, lora_dim, args)  # no dropout: PPO's first ratio must be 1; `score` stays plain
        if new_head and learning_rate is not None:
            model.score.requires_grad_(True)  # a fresh value head must learn, even with --only-optimize-lora
    if learning_rate is None:
        return plumbing.initialize_engine(model, ds_config)
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # Two parameter groups: the model's own weights and, with LoRA, its adapters with their own learning rate.
    groups = [{"params": [p for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n],
               "lr": learning_rate},
              {"params": [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n],
               "lr": lora_learning_rate}]
    optimizer = plumbing.adamw([group for group in groups if group["params"]], learning_rate, args.weight_decay)
    num_steps = args.num_iterations * args.num_ppo_epochs * args.num_mini_batches
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=num_steps)
    return plumbing.initialize_engine(model, ds_config, optimizer, scheduler)

def check_score_head(model, path: str, flag: str) -> None:
    """Critic and reward model are sequence classifiers of one score, whose head we apply at every position."""
    if not isinstance(getattr(model, "score", None), torch.nn.Linear) or model.config.num_labels != 1:
        plumbing.fail(f"{path!r} must be a 1-label AutoModelForSequenceClassification with a linear `score` head, as "
                      f"reward_model.py saves it (it has {model.config.num_labels} labels); check {flag}")


# ---------------------------------------------------------------------------------------------------------------
# Checks of the arguments, models and numbers: a mistake stops the run with one line that says what to fix.
# ---------------------------------------------------------------------------------------------------------------
def check_args(args: Args) -> None:
    """Bad flags stop the run before anything loads, with a line that names them (ranges: the fields' annotations)."""
    plumbing.check_ranges(args)
    if args.missing_eos_penalty is not None and not 0 < args.missing_eos_penalty <= args.clip_score:
        plumbing.fail(f"--missing-eos-penalty {args.missing_eos_penalty} must be in (0, --clip-score "
                      f"{args.clip_score}]: the score it replaces is clipped to [-clip_score, clip_score]")
    if args.target_kl is not None and args.kl_coef == 0:
        plumbing.fail("--target-kl adapts beta by a factor each iteration, which never moves it off --kl-coef 0: "
                      "give --kl-coef a positive start")
    if args.only_optimize_lora and not args.actor_lora_dim:
        plumbing.fail("--only-optimize-lora needs the actor's adapters: set --actor-lora-dim (and --critic-lora-dim "
                      "for the critic's)")
    if args.align_overflow and args.dtype != "fp16":
        plumbing.fail("--align-overflow is for --dtype fp16 (a GPU's loss-scaled training); bf16 and fp32 do not "
                      "overflow")
    if args.enable_hybrid_engine and (args.actor_lora_dim or args.critic_lora_dim):
        plumbing.fail("--enable-hybrid-engine does not support LoRA: DeepSpeed's hybrid engine knows only "
                      "DeepSpeed-Chat's own LoRA layers, not peft's")
    if args.enable_hybrid_engine and get_accelerator().device_name() == "cpu":
        plumbing.fail("--enable-hybrid-engine needs a GPU: DeepSpeed's hybrid engine runs CUDA inference kernels")
    if args.inference_tp_size > 1 and not (args.enable_hybrid_engine and args.actor_zero_stage == 3):
        plumbing.fail("--inference-tp-size above 1 needs --enable-hybrid-engine and --actor-zero-stage 3")
    if args.sampler == "static" and (blocker := static_sampler_blocker(args)):
        plumbing.fail(f"--sampler static {blocker}: use --sampler eager")

def samples_static(args: Args, device: torch.device) -> bool:
    """Whether the rollout samples with sample_static: --sampler static, or auto on CUDA where nothing blocks it."""
    auto = args.sampler == "auto" and device.type == "cuda" and not static_sampler_blocker(args)
    return args.sampler == "static" or auto

def static_sampler_blocker(args: Args) -> str | None:
    """Why sample_static cannot sample this run, or None."""
    if args.actor_lora_dim:
        return "samples from a plain copy of the actor, without its LoRA adapters (--actor-lora-dim)"
    if args.enable_hybrid_engine:
        return "and --enable-hybrid-engine are two ways to sample"
    if args.actor_zero_stage == 3 and not args.gather_weights_for_rollout:
        return "keeps a whole copy of the actor on each device, more than --no-gather-weights-for-rollout allows"
    return None

def check_models(args: Args, is_main: bool):
    """The model folders and tokenizers, checked before any model loads: the actor's tokenizer (left padding), the
    reward model's if it is another (else None), and the critic's folder."""
    plumbing.check_model_folder(args.actor_model_name_or_path, "run sft.py first or check --actor-model-name-or-path")
    plumbing.check_model_folder(args.reward_model_name_or_path,
                                "run reward_model.py first or check --reward-model-name-or-path")
    tokenizer = plumbing.load_tokenizer(args.actor_model_name_or_path, "check --actor-model-name-or-path",
                                        args.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        plumbing.fail(f"the tokenizer of {args.actor_model_name_or_path!r} needs a pad token distinct from EOS; "
                      "a model saved by sft.py has one")
    check_not_saved_by_ppo(args.reward_model_name_or_path, "--reward-model-name-or-path")
    reward_tokenizer = plumbing.load_other_tokenizer(args.reward_model_name_or_path, "check "
                                                     "--reward-model-name-or-path", tokenizer, args.trust_remote_code)
    # The critic reads the actor's tokens: a reward model that reads others cannot be its start.
    critic_path = args.critic_model_name_or_path or \
        (args.actor_model_name_or_path if reward_tokenizer else args.reward_model_name_or_path)
    plumbing.check_model_folder(critic_path, "run reward_model.py first or check --critic-model-name-or-path")
    for path, flag, path_tokenizer in [(args.actor_model_name_or_path, "actor", tokenizer), (critic_path, "critic",
                                       tokenizer), (args.reward_model_name_or_path, "reward", reward_tokenizer)]:
        plumbing.check_vocabulary(path_tokenizer or tokenizer, path, f"check --{flag}-model-name-or-path",
                                  args.trust_remote_code)
    # The reference and the critic (and the reward model, in the actor's tokens) read the ids the actor samples.
    readers = {"--reward-model-name-or-path": args.reward_model_name_or_path} if reward_tokenizer is None else {}
    plumbing.check_embedding_rows("--actor-model-name-or-path", args.actor_model_name_or_path,
                                  {**readers, "--critic-model-name-or-path": critic_path}, args.trust_remote_code)
    if reward_tokenizer and is_main:
        print("the reward model has another tokenizer than the actor: every prompt + response is decoded to text and "
              f"tokenized again for it; the critic starts from {critic_path!r}")
    actor_config = AutoConfig.from_pretrained(args.actor_model_name_or_path, trust_remote_code=args.trust_remote_code)
    if args.max_prompt_len + args.max_new_tokens > getattr(actor_config, "max_position_embeddings", float("inf")):
        plumbing.fail(f"--max-prompt-len {args.max_prompt_len} + --max-new-tokens {args.max_new_tokens} is longer "
                      f"than the model's {actor_config.max_position_embeddings} positions; lower them")
    return tokenizer, reward_tokenizer, critic_path

def check_not_saved_by_ppo(path: str, flag: str) -> None:
    """A folder that ppo.py saved (an actor or a critic: its training_run.json says so) is no reward model, though a
    critic loads as one: its value head would become the reward."""
    if (plumbing.read_record(path) or {}).get("script") == "ppo.py":
        plumbing.fail(f"{flag} {path!r} was saved by ppo.py (a trained actor or critic, says its {plumbing.RECORD}), "
                      "not by reward_model.py: a critic's values are no reward; give reward_model.py's output folder")

def check_normalization(config, actor_identity: str, args: Args) -> None:
    """Rank 0 says when the reward model's config has no reward_mean and reward_std, or when reward_model.py measured
    them (its reward_normalization) on another policy's responses (actor_identity: start_run's folder_identity of the
    actor) or at another temperature or length: the scores then do not start at mean 0 and std 1."""
    if dist.get_rank() != 0:
        return
    if not hasattr(config, "reward_std"):
        print("the reward model's config has no reward_mean and reward_std (not saved by reward_model.py): scores "
              "are used unnormalized")
    measured = getattr(config, "reward_normalization", None)
    if measured is None:
        return
    measured = measured if isinstance(measured, dict) else {}  # not reward_model.py's: every setting differs
    this = {"policy_identity": actor_identity, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    differ = [f"--actor-model-name-or-path {args.actor_model_name_or_path!r} (measured on {measured.get('policy')!r})"
              if key == "policy_identity" else
              f"--{key.replace('_', '-')} {value!r} (measured with {measured.get(key)!r})"
              for key, value in this.items() if measured.get(key) != value]
    if differ:
        print(f"warning: the reward model's reward_mean and reward_std were measured on other responses: "
              f"{'; '.join(differ)}. The normalized scores will not start at mean 0 and std 1; run reward_model.py "
              "with --policy-model-name-or-path, --temperature and --max-new-tokens of this run to measure them anew")

def check_finite_rollout(response_mask, logprobs, ref_logprobs, values, scores, iteration: int, start: int) -> None:
    """A forward pass that gives inf or NaN (a model broken by its weights or its precision) stops the run before it
    can reach the rewards."""
    in_mask = response_mask.bool()
    for name, x in [("actor's log-probs", logprobs[in_mask]), ("reference's log-probs", ref_logprobs[in_mask]),
                    ("critic's values", values[in_mask]), ("reward model's scores", scores)]:
        if not torch.isfinite(x).all():
            plumbing.fail(f"iteration {iteration}: the {name} are not finite (inf or nan); check that model, or use "
                          "--dtype fp32" + ("" if iteration == start else ", or lower the learning rates"))

def check_update(new_logprobs, mb: dict, pg_loss, vf_loss, first_step: bool, iteration: int, args: Args) -> None:
    """A NaN loss stops the run instead of training on it. And before the first optimizer step (first_step) the
    policy is the one that sampled: in fp32 every log-prob equals the rollout's, bit for bit (ZeRO-3 and several
    ranks included); if not, the update computes them differently (dropout, temperature, a nondeterministic kernel)."""
    mask = mb["mask"].bool()
    if first_step and args.dtype == "fp32" and not torch.equal(new_logprobs[mask], mb["logprobs"][mask]):
        gap = (new_logprobs - mb["logprobs"])[mask].abs().max().item()
        plumbing.fail(f"iteration {iteration}: before the first optimizer step the PPO ratio is not exactly 1 "
                      f"(log-probs differ from the rollout's by up to {gap:.2e}): is dropout on (--disable-dropout) "
                      "or the model nondeterministic?")
    for name, loss in [("loss/policy_avg", pg_loss), ("loss/value_avg", vf_loss)]:
        if not torch.isfinite(loss):
            plumbing.fail(f"iteration {iteration}: {name} is {loss.item()}; lower the learning rates, raise --kl-coef "
                          "or use --dtype fp32 (bf16 log-probs are too coarse for the PPO ratio)")


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints for --resume, and the saved models.
# ---------------------------------------------------------------------------------------------------------------
# What --resume lets change (its help lists them): how the run is saved, logged or laid out in memory, not what it
# computes; the models' folders, checked by content instead (plumbing.folder_identity); and the runtime fields.
RESUME_MAY_CHANGE = ["resume", "overwrite", "local_rank", "save_every", "sample_every", "snapshot_every", "trace_every",
                     "trace_response", "track", "wandb_project_name", "actor_zero_stage", "critic_zero_stage",
                     "offload", "offload_reference_model", "offload_reward_model", "gather_weights_for_rollout",
                     "actor_gradient_checkpointing", "critic_gradient_checkpointing", "release_inference_cache",
                     "unpin_actor_parameters", "tp_gather_partition_size", "actor_model_name_or_path",
                     "reward_model_name_or_path", "critic_model_name_or_path"]
OUTPUT_SUBFOLDERS = ["actor", "critic", "actor_ema", "snapshots", "resume"]  # what a run writes in --output-dir
LAST_VALID_BATCH = ["sequences", "attention_mask", "logprobs", "values", "advantages", "returns", "mask", "P"]
RUNTIME_FIELDS = ["world_size", "batch_size", "per_device_mini_batch_size", "gradient_accumulation_steps",
                  "num_iterations"]

STATE_TYPES = {"iteration": int, "kl_coef": (int, float), "actor": dict, "critic": dict, "args": dict}

def start_run(args: Args) -> dict:
    """Rank 0's checks of the output folder before anything loads, and the run: a new one, or with --resume the
    unfinished one in OUTPUT_DIR, with unchanged settings. Returns its name (runs/RUN_NAME), its metrics.jsonl and
    the checkpoints to resume from, newest first. Nothing is written but the claim (plumbing.claim_output_dir)."""
    inputs = {"--actor-model-name-or-path": args.actor_model_name_or_path,
              "--reward-model-name-or-path": args.reward_model_name_or_path,
              "--critic-model-name-or-path": args.critic_model_name_or_path, "--dataset": args.dataset,
              "--unsup-dataset": args.unsup_dataset}
    identities = {flag: plumbing.folder_identity(path) for flag, path in inputs.items() if "model" in flag}
    record = plumbing.read_record(args.output_dir) or {}  # an earlier run's, if ppo.py wrote this folder before
    record = record if record.get("script") == "ppo.py" else {}
    plumbing.claim_output_dir(args.output_dir, inputs, args.overwrite, OUTPUT_SUBFOLDERS)
    checkpoint_dir = os.path.join(args.output_dir, "resume")
    # The checkpoints of the folder's run (one whose state.json does not read stays: load_checkpoint says why).
    checkpoints = [checkpoint for checkpoint in plumbing.complete_checkpoints(checkpoint_dir) if record and
                   (read_state(checkpoint) or {}).get("run_name", record.get("run_name")) == record.get("run_name")]
    if args.resume:
        if "run_name" not in record:
            plumbing.fail(f"--resume: no run of ppo.py in {args.output_dir!r} to continue")
        if not (isinstance(record["run_name"], str) and plumbing.RUN_NAME.fullmatch(record["run_name"])
                and isinstance(record.get("inputs", {}), dict)):
            plumbing.fail(f"--resume: {os.path.join(args.output_dir, plumbing.RECORD)} is damaged (its run_name or "
                          "inputs are not those ppo.py writes); start a new run with --overwrite")
        if record.get("finished"):
            plumbing.fail(f"--resume: the run in {args.output_dir!r} has finished all its iterations; nothing to "
                          "resume (its actor and critic are in actor/ and critic/)")
        states = [state for state in map(read_state, checkpoints) if state is not None]
        if not states and checkpoints:
            plumbing.fail(f"--resume: the state.json of every checkpoint in {checkpoint_dir} is missing or damaged; "
                          "start a new run with --overwrite")
        if not states:
            plumbing.fail(f"--resume: no complete checkpoint in {checkpoint_dir}; run with --save-every N first")
        changed = plumbing.changed_settings(states[0]["args"], args, RESUME_MAY_CHANGE + RUNTIME_FIELDS)
        if changed:
            plumbing.fail(f"--resume: the run was started with other settings: {', '.join(changed)}; resume with its "
                          "settings (only those listed under --resume in --help may change)")
        replaced = [flag for flag, identity in record.get("inputs", {}).items() if identities.get(flag) != identity]
        if replaced:
            plumbing.fail(f"--resume: {replaced[0]} {inputs[replaced[0]]!r} does not hold the model the run started "
                          "from (its files differ); name that model's folder, wherever it is now")
        run_name = record["run_name"]
        # The metrics.jsonl it continues: the one its record names if that is the run's (else, said, one here).
        named = plumbing.run_metrics_file(record)
        metrics_file = named or os.path.abspath(os.path.join("runs", run_name, "metrics.jsonl"))
        if named is None:
            print(f"the run's record names {record.get('metrics_file')!r} as its metrics file, which is no "
                  f"runs/{run_name}/metrics.jsonl file: left alone; the metrics go to {metrics_file}")
        plumbing.make_run_dir(run_name)
    else:
        if checkpoints and not record.get("finished") and not args.overwrite:
            plumbing.fail(f"{args.output_dir!r} holds checkpoints of an unfinished run "
                          f"({os.path.basename(checkpoints[0])}): continue it with --resume, or pass --overwrite to "
                          "start a new run, which deletes them")
        checkpoints = []  # the earlier run's record, checkpoints and snapshots stay until this run writes its own
        run_name = plumbing.new_run_name(args.exp_name, args.seed)
        metrics_file = os.path.abspath(os.path.join("runs", run_name, "metrics.jsonl"))
    return {"run_name": run_name, "metrics_file": metrics_file, "checkpoints": checkpoints, "inputs": identities}

def read_state(checkpoint: str) -> dict | None:
    """A checkpoint's state.json, or None if it does not read or a value in it is not of its type (STATE_TYPES; a
    file read back from the output folder is untrusted)."""
    with contextlib.suppress(OSError, ValueError), open(os.path.join(checkpoint, "state.json")) as f:
        state = json.load(f)
        if isinstance(state, dict) and all(isinstance(state.get(key), kind) and not isinstance(state[key], bool)
                                           for key, kind in STATE_TYPES.items()) \
                and isinstance(state.get("run_name", ""), str) and math.isfinite(state["kl_coef"]):
            return state
    return None

def load_checkpoint(checkpoints: list[str], actor, critic, ema, args: Args, device):
    """--resume: the engines take the weights and optimizer states of the newest checkpoint that reads whole; returns
    its iteration, its KL coefficient and this rank's last valid batch (None from a checkpoint without one)."""
    is_main = dist.get_rank() == 0
    engines = {"actor": actor, "critic": critic, **({"actor_ema": ema} if ema is not None else {})}
    for resume_dir in checkpoints:
        state = read_state(resume_dir)
        problem = "its state.json is missing or damaged" if state is None else \
            plumbing.checkpoint_problem(resume_dir, engines, frozen={"actor_ema"}) or \
            state_problem(resume_dir, state, actor, critic, args)
        if problem is None:
            break
        if is_main:
            print(f"warning: cannot resume from {resume_dir} ({problem}); trying the checkpoint before it")
    else:
        plumbing.fail(f"--resume: no checkpoint in {os.path.join(args.output_dir, 'resume')} reads whole; start a "
                      "new run with --overwrite")
    plumbing.load_training_state(actor, os.path.join(resume_dir, "actor"), state["actor"], device)
    plumbing.load_training_state(critic, os.path.join(resume_dir, "critic"), state["critic"], device)
    if ema is not None:
        ema_weights = safetensors.torch.load_file(os.path.join(resume_dir, "actor_ema", "model.safetensors"))
        plumbing.load_weights(ema, ema_weights)
    if is_main:
        left = args.num_iterations - state["iteration"]
        print(f"resumed from {resume_dir} at iteration {state['iteration']}; "
              + (f"{left} iterations left" if left else "no iteration left: saving the actor and the critic"))
    batch_file = os.path.join(resume_dir, f"last_valid_batch_rank{dist.get_rank()}.safetensors")
    batch = safetensors.torch.load_file(batch_file, device=str(device)) if os.path.exists(batch_file) else None
    last_valid = None if batch is None else ({k: v for k, v in batch.items() if k != "P"}, int(batch["P"]))
    return state["iteration"], state["kl_coef"], last_valid

def state_problem(checkpoint: str, state: dict, actor, critic, args: Args) -> str | None:
    """Why a checkpoint's state (read_state's) cannot continue this run, or None: an iteration not the run's,
    optimizer or scheduler states not the engines' (plumbing.same_layout), a last valid batch not a rollout's."""
    if not 1 <= state["iteration"] <= args.num_iterations:
        return f"its iteration {state['iteration']} is not one of the run's 1 to {args.num_iterations}"
    for name, engine in [("actor", actor), ("critic", critic)]:
        if not plumbing.same_layout(state[name], {"adam_step": 0, "scheduler": engine.lr_scheduler.state_dict(),
                                                  "loss_scale": plumbing.loss_scale(engine)}):
            return f"its state.json's {name!r} is not the optimizer and scheduler state of this run's {name}"
    for file in os.listdir(checkpoint):
        if file.startswith("last_valid_batch_rank"):
            with safetensors.safe_open(os.path.join(checkpoint, file), "pt") as f:
                if set(f.keys()) != set(LAST_VALID_BATCH):
                    return f"{file} does not hold a rollout's tensors"
    return None

def save_snapshot(actor, tokenizer, iteration: int, saved_by: dict, args: Args) -> None:
    """The actor as a Hugging Face folder in OUTPUT_DIR/snapshots/iteration_N, after every --snapshot-every iterations
    and the last (N counts them); an earlier run's snapshots go now."""
    if not args.snapshot_every or (iteration % args.snapshot_every and iteration != args.num_iterations):
        return
    snapshots = os.path.join(args.output_dir, "snapshots")
    if dist.get_rank() == 0:
        plumbing.remove_earlier_runs(snapshots, saved_by["run_name"], plumbing.read_record)
    plumbing.save_engine_folder(actor, tokenizer, os.path.join(snapshots, f"iteration_{iteration}"),
                                {**saved_by, "iteration": iteration, "finished": False}, merge_lora=True)

def save_checkpoint(iteration: int, kl_coef: float, actor, critic, ema, last_valid, run_name: str,
                    args: Args) -> None:
    """A checkpoint for --resume in OUTPUT_DIR/resume/iteration_N, written whole or not at all: the training state of
    actor and critic (and the EMA's weights), the iteration, beta and each rank's last valid batch (every rank takes
    part, ZeRO gathers); rank 0 writes the rest, and removes an earlier run's checkpoints."""
    is_main = dist.get_rank() == 0
    checkpoint_dir = os.path.join(args.output_dir, "resume")
    path = os.path.join(checkpoint_dir, f"iteration_{iteration}")
    if is_main:  # before this run's own: their space is free, and a failed write names only this run's checkpoint
        plumbing.remove_earlier_runs(checkpoint_dir, run_name, read_state)
    try:
        state = {"iteration": iteration, "kl_coef": kl_coef, "args": asdict(args), "run_name": run_name,
                 "actor": plumbing.save_training_state(actor, os.path.join(path + ".tmp", "actor"), is_main),
                 "critic": plumbing.save_training_state(critic, os.path.join(path + ".tmp", "critic"), is_main)}
        if ema is not None:
            plumbing.save_weights(ema, os.path.join(path + ".tmp", "actor_ema"), is_main)
        rollout, P = last_valid
        os.makedirs(path + ".tmp", exist_ok=True)
        safetensors.torch.save_file({**{k: rollout[k].cpu().contiguous() for k in LAST_VALID_BATCH[:-1]},
                                     "P": torch.tensor(P)},
                                    os.path.join(path + ".tmp", f"last_valid_batch_rank{dist.get_rank()}.safetensors"))
        dist.barrier()  # every rank's batch is written before rank 0 commits
        if is_main:
            plumbing.write_json(os.path.join(path + ".tmp", "state.json"), state)
            plumbing.commit_checkpoint(path)
    except plumbing.WRITE_ERRORS as error:
        kept = plumbing.complete_checkpoints(checkpoint_dir)
        plumbing.stop_after_failed_write(error, path + ".tmp", f"the checkpoint {path!r}", f"--resume continues from "
                                         f"{kept[0]!r}" if kept else "no checkpoint is complete yet")


# ---------------------------------------------------------------------------------------------------------------
# Logging: TRL's metric names (README, "Metrics"), to tensorboard, metrics.jsonl and, with --track, wandb.
# ---------------------------------------------------------------------------------------------------------------
def start_logging(run: dict, start_iteration: int, args: Args):
    """Rank 0's tensorboard writer and metrics.jsonl, once every input has loaded; a new run's record replaces an
    earlier run's now. A resumed run continues its own logs, without the lines after its checkpoint."""
    if not args.resume:
        plumbing.write_json(os.path.join(args.output_dir, plumbing.RECORD), {
            "script": "ppo.py", "finished": False, "run_name": run["run_name"], "metrics_file": run["metrics_file"],
            "args": asdict(args), "inputs": run["inputs"]})
    writer = plumbing.start_tensorboard(run["run_name"], args,
                                        purge_step=start_iteration * args.batch_size + 1 if args.resume else None)
    trace_file = os.path.join(os.path.dirname(run["metrics_file"]), "trace.jsonl")
    for path in [run["metrics_file"], trace_file]:
        plumbing.continue_metrics_file(path, start_iteration)
    if args.trace_every:
        plumbing.open_log(trace_file).close()  # writable: checked before the first iteration
    print(f"{args.num_iterations} iterations of {args.batch_size} episodes; logging to {writer.log_dir}")
    return writer, plumbing.open_log(run["metrics_file"])

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
    """One iteration's metrics, each a mean over all ranks' responses or tokens (sums and counts added over the ranks):
    objective/ over the valid responses, whose scores and KL enter the rewards; token statistics over the update's."""
    valid, scores, clip = rollout["valid"], rollout["scores"], args.clip_score
    with torch.no_grad():
        valid_scores = torch.where(valid, scores, 0.0)
        sums = plumbing.sum_over_ranks({
            **update_sums, "responses": torch.tensor(float(len(valid)), device=scores.device), "valid": valid.sum(),
            "kl": rollout["kl"].sum(dim=1).sum(), "scores": valid_scores.sum(),
            "scores_squared": (valid_scores**2).sum(), "clipped_scores": valid_scores.clamp(-clip, clip).sum(),
            "scores_clipped": (valid & (scores.abs() >= clip)).sum(),
            "sequence_entropy": torch.where(rollout["update_mask"].bool(), -rollout["logprobs"], 0.0).sum(),
            "eos": rollout["contains_eos"].sum(), "length": rollout["response_mask"].sum()})
    per_response, per_token = max(sums["valid"], 1), max(sums["tokens"], 1)
    mean_score = sums["scores"] / per_response
    metrics = {
        "objective/kl": sums["kl"] / per_response,
        "objective/entropy": sums["sequence_entropy"] / per_response,
        "objective/non_score_reward": -kl_coef * sums["kl"] / per_response,
        # What PPO maximises: the clipped score the rewards carry, minus the KL penalty (objective/scores is unclipped).
        "objective/rlhf_reward": sums["clipped_scores"] / per_response - kl_coef * sums["kl"] / per_response,
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
        "lr": lr, "episode": (iteration + 1) * args.batch_size, **times,
        # Peak memory of this rank so far (on a GPU, torch's allocated and reserved; on a CPU, peak resident memory).
        **{f"memory/{name}": gb for name, gb in plumbing.peak_memory_gb().items()},
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
    plumbing.append_line(metrics_file, json.dumps({"iteration": iteration + 1, **metrics}))
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

def trace_response(iteration: int, tokenizer, responses, scores, first_logprobs, run: dict, args: Args,
                   **columns: torch.Tensor) -> None:
    """--trace-every: on rank 0, one response position by position with the loop's tensors (COLUMNS, [B, R] each),
    printed and appended to trace.jsonl: the first of the update's first mini-batch (FIRST_LOGPROBS, NaN elsewhere)
    that stopped with EOS (--trace-response stopped) or was cut at the limit (cut), else the first."""
    if dist.get_rank() != 0 or not args.trace_every or iteration % args.trace_every:
        return
    mask = columns.pop("mask")
    seen = first_logprobs.isfinite().any(dim=1)  # none when the update reused the last valid batch
    pool = seen if seen.any() else torch.ones_like(seen)
    stopped = responses[:, -1] == tokenizer.pad_token_id  # an EOS before the limit, then padding
    wanted = pool & mask.bool().any(dim=1) & (stopped if args.trace_response == "stopped" else ~stopped)
    if not wanted.any():
        kind = "stopped with EOS before" if args.trace_response == "stopped" else "was cut at"
        print(f"iteration {iteration + 1}: no response of rank 0 in the update {kind} the length limit "
              f"(--trace-response {args.trace_response}): the trace shows the first")
    row = int((wanted if wanted.any() else pool).int().argmax())
    last = int(mask[row].nonzero().max()) if mask[row].any() else None  # where the score lands
    lines = []
    for t, token in enumerate(responses[row].tolist()):
        line = {"iteration": iteration + 1, "row": row, "t": t, "token": tokenizer.decode([token]),
                "mask": int(mask[row, t]), **{name: float(value[row, t]) for name, value in columns.items()},
                "score": float(scores[row]) if t == last else None,
                "new_logprob": float(first_logprobs[row, t]) if seen[row] else None}
        line["ratio"] = math.exp(line["new_logprob"] - line["logprob"]) if seen[row] else None
        lines.append(line)
    print(f"iteration {iteration + 1}: response {row} of rank 0, position by position (--trace-every)")
    names = list(lines[0])[2:]
    print(" ".join(f"{name:>{14 if name == 'token' else 11}}" for name in names))
    for line in lines:
        print(" ".join(("-" if v is None else f"{v:.4f}" if isinstance(v, float) else repr(v)[:14] if isinstance(
            v, str) else str(v)).rjust(14 if isinstance(v, str) else 11) for v in map(line.get, names)))
    with plumbing.open_log(os.path.join(os.path.dirname(run["metrics_file"]), "trace.jsonl")) as f:
        plumbing.append_line(f, "\n".join(map(json.dumps, lines)))


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed-Chat's extras, each off by default and called from one place (docs/extras.md; LoRA: plumbing.add_lora).
# ---------------------------------------------------------------------------------------------------------------
def init_ema(actor, args: Args):
    """An exponential moving average of the actor's weights (DeepSpeed-Chat's --enable_ema), for evaluation: frozen,
    ZeRO-3 when the actor is, LoRA merged in, and fp32 whatever --dtype (a step moves a weight by 0.8% of its gap to
    the actor's, mostly below bf16's resolution of 0.4% of the weight, would round away). It starts as the actor."""
    ema_ds_config = deepspeed_config(3 if args.actor_zero_stage == 3 else 0, False, False, args)
    ema_ds_config["bf16"]["enabled"] = ema_ds_config["fp16"]["enabled"] = False
    ema = init_engine(AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
                      ema_ds_config, args)
    update_ema(ema, actor, 0.0)
    return ema

def pretraining_loss(actor, unsup_blocks: torch.Tensor | None, update_sums: dict, iteration: int, args: Args):
    """The pretraining mix (InstructGPT eq. 2, PPO-ptx): the objective adds gamma E_x~D_pretrain [log pi(x)], so the
    actor's loss adds gamma times the language-modelling loss of a micro-batch of plain-text blocks (added to the
    update's sums), in the same backward pass. Returns that term; 0 without --unsup-dataset (unsup_blocks None)."""
    if unsup_blocks is None:
        return 0.0
    blocks = unsup_blocks[torch.randint(len(unsup_blocks), (args.per_device_train_batch_size,))]
    blocks = blocks.to(actor.device)
    unsup_loss = actor.module(input_ids=blocks, labels=blocks, use_cache=False).loss
    if not torch.isfinite(unsup_loss):
        plumbing.fail(f"iteration {iteration}: loss/unsup_avg is {unsup_loss.item()}; lower the learning rates")
    update_sums["unsup_loss"] += unsup_loss.detach()
    return args.unsup_coef * unsup_loss

@contextlib.contextmanager
def aligned_overflow(actor, critic, enabled: bool):
    """--align-overflow (DeepSpeed-Chat's align_overflow), around the two engines' step() calls. In fp16 an optimizer
    whose gradients overflow skips its step, so actor and critic could drift apart by a step. At the end of an
    accumulation, the one that did not overflow is made to see an overflow for this one step and takes DeepSpeed's
    own skip path (no update, no scheduler step, gradients cleared, its loss scale kept). DeepSpeed 0.19 has no API
    for it (DeepSpeed-Chat's skip_step and check_overflow(external=True) are gone): the optimizers' private overflow
    checks are shadowed for one step. Checked with DeepSpeed 0.19.8, ZeRO 0-3 (test_align_overflow_skips_both_steps)."""
    if not enabled or not actor.is_gradient_accumulation_boundary():
        yield
        return
    actor_overflow, critic_overflow = plumbing.found_overflow(actor), plumbing.found_overflow(critic)
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

def update_ema(ema, actor, decay: float) -> None:
    """ema = decay * ema + (1 - decay) * actor for every weight (rlhf_math.ema_update), from the actor's fp32 master
    weights with each LoRA adapter merged in (plumbing.merged_master_weight); under ZeRO-3 the new value goes back to
    the ranks' partitions (modifier_rank). Nothing without an EMA (None)."""
    if ema is None:
        return
    with torch.no_grad():
        for name, ema_param in ema.module.named_parameters():
            value = plumbing.merged_master_weight(actor, name)
            with deepspeed.zero.GatheredParameters(ema_param, modifier_rank=0,
                                                   enabled=ema.zero_optimization_stage() == 3):
                ema_param.data.copy_(rlhf_math.ema_update(ema_param.data, value.to(ema_param.device), decay))


if __name__ == "__main__":
    main(tyro.cli(Args))
