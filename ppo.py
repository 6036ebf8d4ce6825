"""Stage 3 of PPO-RLHF: PPO with four models, the whole loop inline.

    actor      the policy pi_theta, from the SFT checkpoint (stage 1)          trained
    reference  pi_ref, the same SFT checkpoint                                  frozen: the KL penalty's anchor
    critic     the value function V(s_t), from the reward model (stage 2)      trained
    reward     the reward model r(x, y) (stage 2)                               frozen

Each model is its own DeepSpeed engine with its own config and ZeRO stage, as in DeepSpeed-Chat's RLHF engine. Each
iteration samples responses to a batch of prompts (the rollout), scores them, turns scores and the KL penalty into
per-token rewards and GAE advantages, then takes a few epochs of clipped PPO updates of actor and critic. The math is
in rlhf_math.py; its docstring shows the layout of one sequence (which position holds which log-prob and value).

Read top down: the algorithm's flags, main with the loop, then the helpers in the order the loop calls them and the
four engines. A banner then marks where a learner may stop: the other flags, checks, the output folder and resume,
logging and the trace, and DeepSpeed-Chat's extras (an EMA of the actor, LoRA, the pretraining mix, fp16 overflow
alignment), each off by default.

    python ppo.py                                          # the bundled toy task, a few minutes on a laptop CPU
    deepspeed --num_gpus 2 ppo.py --actor-zero-stage 3     # the same, on 2 ranks, the actor under ZeRO-3
"""

from __future__ import annotations  # Args, the flags that can wait, is defined below the banner

import copy
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import tyro
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig,
                          get_scheduler)
from transformers.integrations import HfDeepSpeedConfig

import plumbing
import rlhf_math
from plumbing import CountInt, Fraction, NonNegativeFloat, PositiveFloat, PositiveInt, Seed


@dataclass
class Algorithm:
    """PPO-RLHF's hyperparameters, the flags to read first; Args (below the banner) adds those that can wait: models
    and data, the experiment, scale and memory, the extras, the fields filled in at run time."""

    # The algorithm: the rollout
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
    """the EOS trick: a response without EOS gets the score -MISSING_EOS_PENALTY, not the reward model's (TRL's)"""
    disable_dropout: bool = True
    """set every dropout probability of the four models to 0, so that PPO's first ratio can be exactly 1 (detail 17)"""

    # The algorithm: rewards, advantages and the PPO update
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
    gamma: Fraction = 1.0
    """discount factor"""
    lam: Fraction = 0.95
    """GAE lambda"""
    whiten_advantages: bool = True
    """whiten the advantages over the rollout batch (--no-whiten-advantages for DeepSpeed-Chat's behaviour)"""
    whiten_rewards: bool = False
    """scale the per-token rewards to unit variance over the rollout batch, keeping their mean"""
    whiten_across_ranks: bool = True
    """whiten over all ranks' batch (--no-whiten-across-ranks: over each rank's own, as TRL does)"""
    num_ppo_epochs: PositiveInt = 1
    """passes of PPO updates over each rollout batch (TRL's default is 4; one keeps the toy run under 2 minutes)"""
    num_mini_batches: PositiveInt = 4
    """optimizer steps per PPO epoch: the rollout batch is split into this many mini-batches"""
    cliprange: PositiveFloat = 0.2
    """epsilon, PPO's clip range of the probability ratio"""
    cliprange_value: PositiveFloat = 0.2
    """the value function's clip range around the rollout's values"""
    loss_aggregation: Literal["token-mean", "micro-batch-mean"] = "token-mean"
    """token-mean: each in-mask token of a mini-batch (all its micro-batches and ranks) weighs the same in the losses;
    micro-batch-mean: each micro-batch's token mean does, as in DeepSpeed-Chat and TRL (detail 38)"""
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

    # The models checked, then the output folder claimed before anything loads, and the run: a new one, or the one
    # that --resume continues.
    tokenizer, reward_tokenizer, reward_config = check_models(args, is_main)
    run = plumbing.on_rank_0(lambda: new_or_resumed_run(args))
    check_normalization(reward_config, run["inputs"]["--actor-model-name-or-path"], args)
    saved_by = {"script": "ppo.py", "run_name": run["run_name"], "metrics_file": run["metrics_file"]}
    prompts = plumbing.load_prompts(tokenizer, args.dataset, args.train_split, args.prompt_column, args.max_prompt_len,
                                    is_main, args.assistant_marker if args.split_conversations else None)
    if len(prompts) < args.batch_size:
        plumbing.fail(f"{len(prompts)} usable prompts, fewer than one iteration's {args.batch_size}; "
                      "raise --max-prompt-len or lower --per-device-rollout-batch-size")
    unsup_blocks = None if args.unsup_dataset is None else plumbing.load_text_blocks(  # PPO-ptx's text, [blocks, P + R]
        tokenizer, args.unsup_dataset, args.unsup_dataset_config, args.unsup_text_column,
        args.max_prompt_len + args.max_new_tokens, args.per_device_train_batch_size)

    torch.manual_seed(args.seed)  # LoRA's A matrices start random: the same seed gives the same adapters
    actor, reference, critic, reward, ema = build_engines(args, reward_tokenizer)
    # Reward normalization (Ziegler et al. 2019): (score - reward_mean) / reward_std has mean 0 and std 1 where PPO
    # starts. The critic starts as a copy of the reward model: its outputs are mapped the same way, by its own config.
    reward_mean, reward_std = score_normalization(reward.module.config)
    critic_mean, critic_std = score_normalization(critic.module.config)
    generation_config = sampling_config(tokenizer, args.max_new_tokens, args.temperature)
    actor.module.generation_config = generation_config  # saved with the actor: the distribution it samples from
    sample_rollout = sample  # the rollout's sampler; with --sampler static, fast_sampling.py's (a GPU speed option)
    if args.sampler == "static":
        import fast_sampling
        sample_rollout = fast_sampling.sampler(actor, generation_config, is_main, args, device)
    synced = args.actor_zero_stage == 3 and not args.gather_weights_for_rollout  # all ranks sample until all stop
    micro_batch_size = args.per_device_train_batch_size  # rows per forward pass, in the rollout and the update

    start_iteration, kl_coef, last_valid = 0, args.kl_coef, None  # last_valid: the last rollout with a valid response
    saved = {"actor": actor, "critic": critic}, {"actor_ema": ema}  # a checkpoint's engines: trained, frozen
    if args.resume:  # from the newest checkpoint that reads whole: the engines, beta and this rank's last_valid
        state, last_valid = plumbing.load_checkpoint(run["checkpoints"], *saved, ["kl_coef"], ROLLOUT, args, device)
        start_iteration, kl_coef = state["iteration"], state["kl_coef"]
    if is_main:  # the run's record and logs: tensorboard, metrics.jsonl and with --trace-every trace.jsonl
        traces = ["trace.jsonl"] if args.trace_every else []
        writer, metrics_file = plumbing.start_logging(run, start_iteration, args, traces)
    start_time = time.time()
    for iteration in range(start_iteration, args.num_iterations):
        # Seeds of the iteration's own: a resumed run repeats exactly what an uninterrupted one would have done.
        batch_prompts = prompts_of_iteration(prompts, iteration, rank, args)
        torch.manual_seed(args.seed * 100_003 + iteration * args.world_size + rank)  # sampling, mini-batch shuffles
        padded = tokenizer.pad({"input_ids": batch_prompts}, return_tensors="pt")  # left padding
        prompt_ids, prompt_mask = padded["input_ids"].to(device), padded["attention_mask"].to(device)
        P = prompt_ids.shape[1]  # prompt length of this batch, padding included

        # ROLLOUT. Under ZeRO-3 each model's weights are gathered whole once for its work here (plumbing.gathered); with
        # --only-optimize-lora the reference is the actor with its adapters off (plumbing.adapters_disabled).
        rollout_start = time.time()
        with torch.no_grad():
            with plumbing.gathered(actor, args.gather_weights_for_rollout):
                # 1. Generate: sample a response to every prompt from the current policy pi_theta, [B, R].
                actor.eval()  # in train mode, gradient checkpointing would switch the key-value cache off
                with plumbing.stop_on(ValueError):  # sample's refusal (logits not finite), as the run's one line
                    responses = sample_rollout(actor.module, prompt_ids, prompt_mask, generation_config, synced)
                actor.train()
                generation_time = time.time() - rollout_start
                # 2. Truncate after the stop token: response_mask is 1 up to and including the first EOS, then pad.
                response_mask = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)
                responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
                sequences = torch.cat([prompt_ids, responses], dim=1)
                attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
                contains_eos = (responses == tokenizer.eos_token_id).any(dim=1)
                # 3. Log-probs and values, one model at a time, in micro-batches: log pi_theta(a_t|s_t) and
                # log pi_ref(a_t|s_t) at the sampling temperature, and V(s_t) from the token before a_t.
                logprobs = in_micro_batches(response_logprobs, micro_batch_size, actor.module, sequences,
                                            attention_mask, P, args.temperature)
            with (plumbing.gathered(reference, args.gather_weights_for_rollout),
                  plumbing.adapters_disabled(reference.module)):
                ref_logprobs = in_micro_batches(response_logprobs, micro_batch_size, reference.module, sequences,
                                                attention_mask, P, args.temperature)
            with plumbing.gathered(critic, args.gather_weights_for_rollout):
                values = in_micro_batches(critic_values, micro_batch_size, critic.module, sequences, attention_mask,
                                          P, critic_mean, critic_std)
            # 4. Score prompt + truncated response at its last real token (the EOS, or the last token of a response
            # cut at max_new_tokens), normalized: (r(x, y) - reward_mean) / reward_std, in the reward model's tokens.
            with plumbing.gathered(reward, args.gather_weights_for_rollout):
                scores = in_micro_batches(reward_scores, micro_batch_size, reward.module, sequences, attention_mask,
                                          P, reward_mean, reward_std, tokenizer, reward_tokenizer)
            # The EOS trick (detail 7): a response that never stopped gets a fixed low score.
            if args.missing_eos_penalty is not None:
                scores = torch.where(contains_eos, scores, -args.missing_eos_penalty)
            check_finite_rollout(response_mask, logprobs, ref_logprobs, values, scores, iteration, start_iteration)

            # 5. Invalid generations, too short to learn from, are left out of the update. The loop has three masks,
            # each made once: attention_mask [B, P + R], what the models read; response_mask [B, R], each response up
            # to its EOS (lengths, the EOS count); update_mask [B, R], the valid responses' response_mask, the one
            # mask that rlhf_math's rewards, advantages and losses see.
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
        # The update trains on this rollout; when none of its responses is valid, on the last valid rollout again
        # (DeepSpeed-Chat's fallback; by default only a bare EOS is invalid), whose prompt length is its own.
        if valid.any():
            last_valid = rollout
        else:
            check_last_valid(last_valid, iteration, rank, args)  # stops when there is none
        batch = last_valid
        batch_P = batch["sequences"].shape[1] - args.max_new_tokens  # every response is max_new_tokens long, padded
        rollout_time = time.time() - rollout_start

        # UPDATE: num_ppo_epochs passes; each splits the batch into num_mini_batches optimizer steps of micro-batches.
        update_start = time.time()
        lr = actor.get_lr()[0]  # the rate of this iteration's first step
        update_sums, first_logprobs = new_update_sums(device), torch.full_like(logprobs, float("nan"))
        for epoch in range(args.num_ppo_epochs):
            mini_batches = torch.randperm(len(batch["mask"]), device=device).split(args.per_device_mini_batch_size)
            mini_batch_tokens = tokens_per_mini_batch(batch["mask"], mini_batches)
            for mini_batch_index, mini_batch in enumerate(mini_batches):
                for micro_batch_rows in mini_batch.split(micro_batch_size):
                    mb = {k: v[micro_batch_rows] for k, v in batch.items()}
                    # The policy's and the value function's new outputs on the rollout's sequences.
                    new_logits = response_logits(actor.module, mb["sequences"], mb["attention_mask"], batch_P)
                    new_logprobs = rlhf_math.logprobs_from_logits(new_logits, mb["sequences"][:, batch_P:],
                                                                  args.temperature)
                    new_values = critic_values(critic.module, mb["sequences"], mb["attention_mask"], batch_P,
                                               critic_mean, critic_std)
                    # PPO's clipped surrogate objective and clipped value loss.
                    pg_loss, pg_stats = rlhf_math.policy_loss(
                        new_logprobs, mb["logprobs"], mb["advantages"], mb["mask"], args.cliprange)
                    vf_loss, vf_clipfrac = rlhf_math.value_loss(
                        new_values, mb["values"], mb["returns"], mb["mask"], args.cliprange_value)
                    first_step = epoch == 0 and mini_batch_index == 0 and batch is rollout  # no optimizer step yet
                    check_update(new_logprobs, mb, pg_loss, vf_loss, first_step, iteration, args)
                    if first_step:  # the policy that sampled, for the ratio column of --trace-every
                        first_logprobs[micro_batch_rows] = new_logprobs.detach()
                    # Backward: each loss weighed by its micro-batch's share of the tokens (detail 38); the actor's
                    # with PPO-ptx's gamma * language-modelling loss when --unsup-dataset is set (else 0).
                    weight = loss_weight(mb["mask"], mini_batch_tokens[mini_batch_index], args)
                    actor.backward(weight * pg_loss + pretraining_loss(actor, unsup_blocks, update_sums, iteration,
                                                                       args))
                    critic.backward(weight * vf_loss)
                    with plumbing.aligned_overflow([actor, critic], args.align_overflow):  # only with --align-overflow
                        actor.step()  # DeepSpeed steps the optimizer at the end of each mini-batch's accumulation
                        critic.step()
                    add_update_sums(update_sums, new_logits, mb["mask"], pg_loss, vf_loss, pg_stats, vf_clipfrac, args)
                update_ema(ema, actor, args.ema_decay)  # nothing unless --enable-ema: after every actor step
        # Ziegler et al.'s adaptive KL controller (with --target-kl): beta of the next rollout, from this one's KL.
        rollout_kl_coef, kl_coef = kl_coef, adapted_kl_coef(kl_coef, kl, valid, args)
        update_time = time.time() - update_start

        # LOGGING: TRL's metric names, each a mean over all ranks' responses or tokens (iteration_metrics), from all
        # that the rollout computed; with --trace-every, one response of it position by position.
        rollout_stats = dict(rollout, P=P, ref_logprobs=ref_logprobs, rewards=rewards, kl=kl, scores=scores,
                             gae_advantages=gae_advantages, valid=valid, response_mask=response_mask,
                             contains_eos=contains_eos, kl_coef=rollout_kl_coef)
        times = {"eps": (iteration + 1 - start_iteration) * args.batch_size / (time.time() - start_time),
                 "time/rollout": rollout_time, "time/generation": generation_time, "time/update": update_time}
        metrics = iteration_metrics(update_sums, rollout_stats, lr, iteration, times, args)
        if is_main:
            log_iteration(metrics, iteration, writer, metrics_file, tokenizer, (prompt_ids, responses, scores), args)
        if is_main and args.trace_every and iteration % args.trace_every == 0:
            trace_response(iteration, tokenizer, first_logprobs, rollout_stats, run, args)
        plumbing.save_snapshot(actor, tokenizer, iteration + 1, saved_by, args)  # nothing unless --snapshot-every
        if args.save_every and (iteration + 1) % args.save_every == 0:  # for --resume
            plumbing.save_checkpoint(iteration + 1, run["run_name"], *saved, {"kl_coef": kl_coef}, last_valid, args)

    # Save the trained actor and critic (and the EMA) as ordinary Hugging Face folders, then mark the run finished.
    plumbing.finish_run({"actor": actor, "critic": critic, "actor_ema": ema}, tokenizer, saved_by,
                        [metrics_file, writer] if is_main else [], start_time, args)
    plumbing.end_run()


# --- The loop's helpers, in the order it first calls them: sampling, log-probs, values and scores, the batches. ---
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
    (detail 3); the pad token suppressed: a pad sampled inside a response would break every mask built from padding.
    Pasted alone it needs `from transformers import GenerationConfig`."""
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            suppress_tokens=None if tokenizer.pad_token_id is None else [tokenizer.pad_token_id])

def prompts_of_iteration(prompts: list, iteration: int, rank: int, args: Args) -> list:
    """This rank's share of an iteration's prompts. The prompts are shuffled once per pass over the data set, by a
    seed of that pass, so that a resumed run draws the prompts an uninterrupted one would have."""
    batches_per_pass = len(prompts) // args.batch_size
    order = np.random.default_rng([args.seed, iteration // batches_per_pass]).permutation(len(prompts))
    first = (iteration % batches_per_pass) * args.batch_size + rank * args.per_device_rollout_batch_size
    return [prompts[i] for i in order[first : first + args.per_device_rollout_batch_size]]

def sample(model, prompt_ids, prompt_mask, config: GenerationConfig, synced: bool = False) -> torch.Tensor:
    """model.generate(generation_config=config) written out, the same tokens from the same seed (test_ppo): a_t ~
    softmax(z / temperature) with do_sample, else argmax z, z the next-token logits, with the key-value cache. [B, P]
    left-padded prompts -> [B, max_new_tokens], pad after each EOS (one id, a list or none), stopped once all have
    (synced: on all ranks). What config leaves unset comes from the model's generation_config, as in generate; a config
    that sample does not follow (generation_settings), or logits not finite, raise ValueError with one line. Pasted
    alone it needs `import copy`, `import math`, `import torch`, `import torch.distributed as dist`, `from transformers
    import GenerationConfig`, generation_settings, NOT_FOLLOWED, PLAIN_SAMPLING and position_ids_from."""
    config = generation_settings(model, config)
    temperature = 1.0 if config.temperature is None or not config.do_sample else config.temperature
    eos = torch.tensor([config.eos_token_id] if isinstance(config.eos_token_id, int) else config.eos_token_id or [],
                       dtype=torch.long, device=prompt_ids.device)
    cache, attention_mask, position_ids, tokens = None, prompt_mask, position_ids_from(prompt_mask), prompt_ids
    running, responses = torch.ones(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device), []  # no EOS yet
    for _ in range(config.max_new_tokens):
        out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                    use_cache=True, logits_to_keep=1)
        z = out.logits[:, -1].float() / temperature
        if not torch.isfinite(z).all():  # else torch.multinomial fails, with a message that names no cause
            raise ValueError("the policy's next-token logits are not finite (inf or nan) while sampling: check the "
                             "model and --temperature, or lower the learning rates")
        z[:, config.suppress_tokens or []] = -math.inf
        drawn = torch.multinomial(torch.softmax(z, dim=-1), 1) if config.do_sample else z.argmax(dim=-1, keepdim=True)
        tokens = torch.where(running.unsqueeze(1), drawn, config.pad_token_id)
        responses.append(tokens)
        running &= ~torch.isin(tokens.squeeze(1), eos)
        still_running = running.sum()
        if synced:  # ZeRO-3 gathers each layer for every token: a rank that stopped alone would leave others waiting
            dist.all_reduce(still_running)
        if still_running == 0:
            break
        cache = getattr(out, "cache", None)
        if cache is None:  # a model that ignores transformers' `cache` would go on from the last token alone
            raise ValueError(f"{type(model).__name__} returns no key-value cache for transformers 5.24's `cache` "
                             "argument, which sample uses: upgrade transformers, or use one of its own models")
        attention_mask, position_ids = torch.cat([attention_mask, torch.ones_like(tokens)], 1), position_ids[:, -1:] + 1
    responses = torch.cat(responses, dim=1)
    return torch.nn.functional.pad(responses, (0, config.max_new_tokens - responses.shape[1]),
                                   value=config.pad_token_id)

# The settings with which generate would draw other tokens than `sample`, each with its value that does nothing (as
# unset). PLAIN_SAMPLING's act with do_sample only, an unset top_k there meaning generate's top-50.
NOT_FOLLOWED = {"num_beams": 1, "num_return_sequences": 1, "min_length": 0, "min_new_tokens": 0,
                "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "guidance_scale": 1.0, "bad_words_ids": None,
                "sequence_bias": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
                "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "stop_strings": None,
                "max_time": None, "penalty_alpha": None, "dola_layers": None, "watermarking_config": None}
PLAIN_SAMPLING = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                  "top_h": None}

def generation_settings(model, config: GenerationConfig) -> GenerationConfig:
    """CONFIG as generate reads it, the model's generation_config filling what it leaves unset; one-line ValueError if
    it sets no max_new_tokens or pad_token_id, or a setting of NOT_FOLLOWED (with do_sample, PLAIN_SAMPLING) that acts.
    Pasted alone it needs `import copy`, `from transformers import GenerationConfig`, NOT_FOLLOWED, PLAIN_SAMPLING."""
    config = copy.deepcopy(config)
    if getattr(model, "generation_config", None) is not None:
        config.update(**model.generation_config.to_dict(), defaults_only=True)
    for needed in ("max_new_tokens", "pad_token_id"):  # else generate would stop at max_length, or pad with EOS
        if getattr(config, needed) is None:
            raise ValueError(f"neither the generation config nor the model's sets {needed}, which sample needs")
    if config.do_sample and config.top_k is None:
        config.top_k = 50  # transformers' default, which generate samples with
    acting = [f"{name}={getattr(config, name, None)!r}" for name, neutral in
              {**NOT_FOLLOWED, **(PLAIN_SAMPLING if config.do_sample else {})}.items()
              if getattr(config, name, None) not in (None, neutral)]
    if acting:
        raise ValueError(f"generate would use {', '.join(acting)} (from the config, the model's generation_config or "
                         "transformers' defaults), which sample does not follow: it draws from softmax(logits / "
                         "temperature), or takes the argmax without do_sample")
    return config

def in_micro_batches(function, size: int, model, sequences: torch.Tensor, attention_mask: torch.Tensor, *args):
    """function(model, sequences, attention_mask, *args) over micro-batches of `size` rows, joined: one's memory."""
    return torch.cat([function(model, sequences[i : i + size], attention_mask[i : i + size], *args)
                      for i in range(0, len(sequences), size)])

def response_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      temperature: float) -> torch.Tensor:
    """log pi(a_t | s_t) of every response token, at the sampling temperature: [B, P + R] sequences -> [B, R].
    Pasted alone it needs `import torch`, `import rlhf_math`, response_logits and position_ids_from."""
    logits = response_logits(model, sequences, attention_mask, prompt_len)
    return rlhf_math.logprobs_from_logits(logits, sequences[:, prompt_len:], temperature)

def response_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits that predict each response token: [B, P + R] sequences -> [B, R, V]. Those at position P - 1 + t
    predict the token at P + t; only positions P - 1 to P + R - 1 go through the output layer (logits_to_keep).
    Pasted alone it needs `import torch` and position_ids_from."""
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask),
                use_cache=False, logits_to_keep=sequences.shape[1] - prompt_len + 1)
    return out.logits[:, :-1]

def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip the left padding of the prompts: 0 at each prompt's first real token, as generate uses."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)

def critic_values(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, mean: float,
                  std: float) -> torch.Tensor:
    """V(s_t) for every response token: the critic's head at position P - 1 + t, the last token of the state before
    a_t, on the normalized reward scale ((output - mean) / std, as the scores). [B, P + R] -> [B, R]. Pasted alone it
    needs `import torch`, head_at_every_position and position_ids_from."""
    return (head_at_every_position(model, sequences, attention_mask)[:, prompt_len - 1 : -1] - mean) / std

def head_at_every_position(model, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A sequence classifier's scalar head applied at every position instead of only the last: [B, T] -> [B, T].
    Pasted alone it needs `import torch` and position_ids_from."""
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
    (sums of x, x^2 and the count added over the ranks): rlhf_math.mean_var_from_moments."""
    x = torch.where(mask.bool(), x.double(), 0.0)
    moments = torch.stack([mask.sum().double(), x.sum(), (x**2).sum()])
    if across_ranks:
        dist.all_reduce(moments)
    return rlhf_math.mean_var_from_moments(*moments)

def tokens_per_mini_batch(mask: torch.Tensor, mini_batches: list[torch.Tensor]) -> torch.Tensor:
    """The in-mask tokens (mask [B, R]) of each mini-batch (row indices), all ranks together: [num_mini_batches]."""
    counts = torch.stack([mask[mini_batch].sum() for mini_batch in mini_batches]).float()
    dist.all_reduce(counts)
    return counts

def loss_weight(mask: torch.Tensor, mini_batch_tokens: torch.Tensor, args: Args):
    """The factor on a micro-batch's loss, the mean over its n in-mask tokens (detail 38). token-mean: n / N, N the
    in-mask tokens of the whole mini-batch (all micro-batches, all ranks), times the accumulation steps and the ranks,
    which DeepSpeed averages over; micro-batch-mean: 1, DeepSpeed's average of the micro-batches' means."""
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


# --- The four DeepSpeed engines, as DeepSpeed-Chat's RLHF engine builds them: one config and one ZeRO stage each. ---
def zero_stages(args: Args) -> dict[str, int]:
    """Each model's ZeRO stage (DeepSpeed-Chat's rule): the reference follows the actor's, the reward model the
    critic's, as ZeRO-3 (all that shards a frozen model) or plain; their own offload to CPU memory needs ZeRO-3."""
    return {"actor": args.actor_zero_stage, "critic": args.critic_zero_stage,
            "reference": 3 if args.actor_zero_stage == 3 or args.offload_reference_model else 0,
            "reward": 3 if args.critic_zero_stage == 3 or args.offload_reward_model else 0}

def critic_start(args: Args, reward_tokenizer) -> tuple[str, str]:
    """Where the critic starts (detail 23), and its flag: --critic-model-name-or-path, else the reward model, or the
    actor with a fresh head when the reward model reads other tokens (reward_tokenizer) than the critic will."""
    model = "critic" if args.critic_model_name_or_path else "actor" if reward_tokenizer else "reward"
    return getattr(args, f"{model}_model_name_or_path"), f"--{model}-model-name-or-path"

def build_engines(args: Args, reward_tokenizer):
    """Actor, reference, critic and reward model (and with --enable-ema the actor's EMA, else None), each checked:
    critic and reward model have a 1-label score head, and no weight is inf or NaN."""
    actor = init_engine(AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
                        deepspeed_config(args.actor_zero_stage, True, args.offload, args), args,
                        args.actor_learning_rate, args.actor_gradient_checkpointing, args.actor_lora_dim,
                        args.actor_lora_learning_rate)
    # With only the actor's adapters trained, the actor with its adapters off is the SFT model: it is the reference
    # (plumbing.adapters_disabled), and a whole model copy is never loaded.
    reference = actor if args.only_optimize_lora else init_engine(
        AutoModelForCausalLM, args.actor_model_name_or_path, "--actor-model-name-or-path",
        deepspeed_config(zero_stages(args)["reference"], False, args.offload_reference_model, args), args)
    critic_path, critic_flag = critic_start(args, reward_tokenizer)
    critic = init_engine(AutoModelForSequenceClassification, critic_path, critic_flag,
                         deepspeed_config(args.critic_zero_stage, True, args.offload, args), args,
                         args.critic_learning_rate, args.critic_gradient_checkpointing, args.critic_lora_dim,
                         args.critic_lora_learning_rate)
    reward = init_engine(AutoModelForSequenceClassification, args.reward_model_name_or_path,
                         "--reward-model-name-or-path",
                         deepspeed_config(zero_stages(args)["reward"], False, args.offload_reward_model, args), args)
    check_score_head(reward.module, args.reward_model_name_or_path, "--reward-model-name-or-path")
    check_score_head(critic.module, critic_path, critic_flag)
    # Each weights file is checked once: the reference (and the EMA) load the actor's, and the critic, unless
    # --critic-model-name-or-path is set, the reward model's.
    plumbing.check_finite_weights(actor.module, f"model {args.actor_model_name_or_path!r} (--actor-model-name-or-path)")
    plumbing.check_finite_weights(reward.module,
                                  f"model {args.reward_model_name_or_path!r} (--reward-model-name-or-path)")
    if critic_path != args.reward_model_name_or_path:
        plumbing.check_finite_weights(critic.module, f"model {critic_path!r} ({critic_flag})")
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
    # A critic from a causal LM (the actor, when the reward model reads other tokens) gets a fresh 1-label head (a
    # reward model must bring its trained one: check_models).
    new_head = model_class is AutoModelForSequenceClassification and \
        any(name.endswith("ForCausalLM") for name in config.architectures or [])
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
    optimizer = plumbing.adamw(model, learning_rate, args.weight_decay, lora_learning_rate)  # LoRA's at its own rate
    num_steps = args.num_iterations * args.num_ppo_epochs * args.num_mini_batches
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=num_steps)
    return plumbing.initialize_engine(model, ds_config, optimizer, scheduler)

def check_score_head(model, path: str, flag: str) -> None:
    """Critic and reward model are sequence classifiers of one score, whose head we apply at every position."""
    if not isinstance(getattr(model, "score", None), torch.nn.Linear) or model.config.num_labels != 1:
        plumbing.fail(f"{path!r} must be a 1-label AutoModelForSequenceClassification with a linear `score` head, as "
                      f"reward_model.py saves it (it has {model.config.num_labels} labels); check {flag}")


# ===============================================================================================================
# A learner may stop here. The rest keeps a run safe and visible: the flags that are not the algorithm's, the checks
# that stop it with one line, its output folder and --resume, its logging and trace, and DeepSpeed-Chat's extras.
# ===============================================================================================================


@dataclass
class Args(Algorithm):  # the flags that can wait, after the algorithm's (at the top); --help lists them in this order
    # Models and data
    actor_model_name_or_path: str = "checkpoints/sft"
    """the SFT model (stage 1): the actor and the reference start from it"""
    reward_model_name_or_path: str = "checkpoints/reward_model"
    """the reward model (stage 2), frozen; its score normalized by its config's: (score - reward_mean) / reward_std"""
    critic_model_name_or_path: str | None = None
    """where the critic starts; by default the reward model (the actor with a fresh head if it has other tokens)"""
    dataset: str = os.path.join(plumbing.TOY_TASK, "data")
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

    # Experiment, logging and checkpoints
    exp_name: str = "ppo"
    """the name of this experiment, the first part of the run name"""
    seed: Seed = 1
    """seed of the experiment (prompt order, sampling)"""
    output_dir: str = "checkpoints/ppo"
    """where the actor and critic are saved (actor/, critic/), and the checkpoints for --resume (resume/)"""
    track: bool = False
    """log to Weights & Biases (tensorboard logs and metrics.jsonl are always written to runs/RUN_NAME/)"""
    wandb_project_name: str = "ppo-rlhf"
    """the wandb project, with --track"""
    sample_every: CountInt = 10
    """print a table of a few prompts, responses and scores every this many iterations (0: never)"""
    save_every: CountInt = 0
    """write a checkpoint of actor, critic and their optimizers every this many iterations, for --resume (0: never)"""
    trace_every: CountInt = 0
    """every this many iterations, print one response position by position with each quantity the loop computed for
    it (docs/algorithm.md) and append it to runs/RUN_NAME/trace.jsonl (0: never)"""
    trace_response: Literal["stopped", "cut"] = "stopped"
    """the response --trace-every shows: the first that stopped with EOS (its last token, maybe), or the first cut"""
    snapshot_every: CountInt = 0
    """save the actor in OUTPUT_DIR/snapshots/iteration_N every this many iterations and the last (0: never), for
    evaluate.py's picture of reward-model and gold scores along training"""
    resume: bool = False
    """continue the unfinished run in OUTPUT_DIR from its latest checkpoint with its settings: only how it is saved,
    logged, sampled or laid out in memory may change (RESUME_MAY_CHANGE)"""
    overwrite: bool = False
    """write into a non-empty --output-dir that ppo.py did not write, or over an unfinished run's checkpoints there"""

    # Scale and memory: DeepSpeed, precision, the sampler
    per_device_train_batch_size: PositiveInt = 16
    """sequences per rank per forward pass, in the rollout's scoring and the update (accumulated to a mini-batch)"""
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
    gather_weights_for_rollout: bool = True
    """under ZeRO-3, gather each model's weights whole once per rollout, not layer by layer at every token and forward
    pass (--no-gather-weights-for-rollout for models too large for one device)"""
    sampler: Literal["eager", "static"] = "eager"
    """eager: `sample`; static: fast_sampling.py's, a GPU speed option that keeps a whole copy of the actor and a
    static key-value cache on every device for the whole run (docs/scaling.md)"""
    local_rank: int = -1
    """this process's rank on its node, passed by the deepspeed launcher"""

    # DeepSpeed-Chat's extras, each off by default: an EMA of the actor, LoRA, the pretraining mix, overflow alignment
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
    """plain text for InstructGPT's pretraining mix (PPO-ptx): a hub data set or a local file (toy_task/pretrain.txt)"""
    unsup_dataset_config: str | None = None
    """the hub data set's configuration name, if it has several (e.g. wikitext-2-raw-v1)"""
    unsup_text_column: str = "text"
    """the column that holds the text"""
    unsup_coef: NonNegativeFloat = 27.8
    """gamma, the weight of the language-modelling loss on the plain text (InstructGPT's 27.8)"""
    align_overflow: bool = False
    """fp16 only: when the actor's or the critic's loss scaler overflows, both skip the step"""

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


# --- Checks of the arguments, models and numbers: a mistake stops the run with one line that says what to fix. ---
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
    if args.sampler == "static":  # the GPU speed option, imported only when chosen
        import fast_sampling
        fast_sampling.check_args(args)

def check_models(args: Args, is_main: bool):
    """The model folders, configs and tokenizers, checked before the output folder is claimed and any model loads.
    Returns the actor's tokenizer (left padding), the reward model's if it is another (else None), and its config."""
    critics = {"--critic-model-name-or-path": args.critic_model_name_or_path} if args.critic_model_name_or_path else {}
    plumbing.check_model_folder(args.actor_model_name_or_path, "run sft.py first or check --actor-model-name-or-path")
    for flag, path in {**critics, "--reward-model-name-or-path": args.reward_model_name_or_path}.items():
        plumbing.check_model_folder(path, f"run reward_model.py first or check {flag}")
    check_not_saved_by_ppo(args.reward_model_name_or_path, "--reward-model-name-or-path")
    # The reference and the critic (and the reward model, in the actor's tokens) read the ids the actor samples.
    tokenizer, reward_tokenizer = plumbing.check_tokens(args.actor_model_name_or_path, "--actor-model-name-or-path",
                                                        args.reward_model_name_or_path, "--reward-model-name-or-path",
                                                        critics, args.trust_remote_code)
    actor_config = AutoConfig.from_pretrained(args.actor_model_name_or_path, trust_remote_code=args.trust_remote_code)
    plumbing.check_positions(actor_config, args.max_prompt_len + args.max_new_tokens,
                             f"--max-prompt-len {args.max_prompt_len} + --max-new-tokens {args.max_new_tokens}")
    reward_config = plumbing.check_classifier_config(args.reward_model_name_or_path, "--reward-model-name-or-path",
                                                     args.trust_remote_code)
    return tokenizer, reward_tokenizer, reward_config

def check_not_saved_by_ppo(path: str, flag: str) -> None:
    """A folder that ppo.py saved (its record says so) is no reward model, though a critic loads as one."""
    if (plumbing.read_record(path) or {}).get("script") == "ppo.py":
        plumbing.fail(f"{flag} {path!r} was saved by ppo.py (a trained actor or critic, says its {plumbing.RECORD}), "
                      "not by reward_model.py: a critic's values are no reward; give reward_model.py's output folder")

def check_normalization(config, actor_identity: str, args: Args) -> None:
    """Rank 0 says when the reward model's config has no reward_mean and reward_std, or when reward_model.py measured
    them on another policy's responses (by content: ACTOR_IDENTITY), temperature or length than this run's."""
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
    """A forward pass that gives inf or NaN (a model broken by its weights or its precision) stops the run here."""
    in_mask = response_mask.bool()
    for name, x in [("actor's log-probs", logprobs[in_mask]), ("reference's log-probs", ref_logprobs[in_mask]),
                    ("critic's values", values[in_mask]), ("reward model's scores", scores)]:
        if not torch.isfinite(x).all():
            plumbing.fail(f"iteration {iteration}: the {name} are not finite (inf or nan); check that model, or use "
                          "--dtype fp32" + ("" if iteration == start else ", or lower the learning rates"))

def check_last_valid(last_valid, iteration: int, rank: int, args: Args) -> None:
    """No response of this rank's rollout is valid: a warning that the last valid one is reused, or a stop if none."""
    if last_valid is None:
        plumbing.fail(f"iteration {iteration}: no response has --min-response-tokens {args.min_response_tokens} "
                      "real tokens, and there is no earlier batch to reuse; check the SFT model and max_new_tokens")
    print(f"warning: rank {rank}, iteration {iteration}: every response is invalid; reusing the last valid batch")

def check_update(new_logprobs, mb: dict, pg_loss, vf_loss, first_step: bool, iteration: int, args: Args) -> None:
    """A NaN loss stops the run. Before the first optimizer step (first_step) the policy is the one that sampled: in
    fp32 its log-probs equal the rollout's bit for bit (detail 17), unless dropout or a kernel makes them differ."""
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


# --- The output folder and --resume: what ppo.py's runs keep, for plumbing's start_run and checkpoints. ---
# What --resume lets change: how the run is saved, logged, sampled or laid out in memory, not what it computes; where
# its inputs are now (models, data sets: known by content, plumbing.folder_identity); the fields filled at runtime.
RESUME_MAY_CHANGE = ["resume", "overwrite", "local_rank", "save_every", "sample_every", "snapshot_every", "trace_every",
                     "trace_response", "track", "wandb_project_name", "actor_zero_stage", "critic_zero_stage",
                     "offload", "offload_reference_model", "offload_reward_model", "gather_weights_for_rollout",
                     "actor_gradient_checkpointing", "critic_gradient_checkpointing", "sampler", "output_dir",
                     "actor_model_name_or_path", "reward_model_name_or_path", "critic_model_name_or_path", "dataset",
                     "unsup_dataset", "world_size", "batch_size", "per_device_mini_batch_size",
                     "gradient_accumulation_steps", "num_iterations"]
OUTPUT_SUBFOLDERS = ["actor", "critic", "actor_ema", "snapshots", "resume"]  # what a run writes in --output-dir
ROLLOUT = ["sequences", "attention_mask", "logprobs", "values", "advantages", "returns", "mask"]  # a last_valid

def new_or_resumed_run(args: Args) -> dict:
    """Rank 0's checks of the output folder before anything loads, and the run: a new one, or the unfinished one that
    --resume continues with its settings and inputs (plumbing.start_run); the output folder is none of its inputs."""
    inputs = {f"--{name.replace('_', '-')}": path for name, path in vars(args).items()  # models and data sets
              if name.endswith(("model_name_or_path", "dataset"))}
    return plumbing.start_run(args, inputs, OUTPUT_SUBFOLDERS, RESUME_MAY_CHANGE)

# --- Logging: TRL's metric names (README, "Metrics"), to tensorboard, metrics.jsonl and, with --track, wandb. ---
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

def iteration_metrics(update_sums, rollout: dict, lr: float, iteration: int, times: dict,
                      args: Args) -> dict[str, float]:
    """One iteration's metrics, each a mean over all ranks' responses or tokens (sums and counts added over the ranks):
    objective/ over the valid responses, whose scores and KL enter the rewards; token statistics over the update's."""
    valid, scores, clip, kl_coef = rollout["valid"], rollout["scores"], args.clip_score, rollout["kl_coef"]
    with torch.no_grad():
        valid_scores = torch.where(valid, scores, 0.0)
        sums = plumbing.sum_over_ranks({
            **update_sums, "responses": torch.tensor(float(len(valid)), device=scores.device), "valid": valid.sum(),
            "kl": rollout["kl"].sum(dim=1).sum(), "scores": valid_scores.sum(),
            "scores_squared": (valid_scores**2).sum(), "clipped_scores": valid_scores.clamp(-clip, clip).sum(),
            "scores_clipped": (valid & (scores.abs() >= clip)).sum(),
            "sequence_entropy": torch.where(rollout["mask"].bool(), -rollout["logprobs"], 0.0).sum(),
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
        plumbing.print_table(f"iteration {iteration + 1}", ["prompt", "response", "score"], [
            [*tokenizer.batch_decode([prompt_ids[i], responses[i]], skip_special_tokens=True),
             f"{scores[i].item():+.2f}"] for i in range(min(4, len(prompt_ids)))])

def trace_response(iteration: int, tokenizer, first_logprobs, rollout: dict, run: dict, args: Args) -> None:
    """--trace-every: one response of the ROLLOUT (all the loop computed) position by position, printed and appended
    to trace.jsonl: the update's first mini-batch's (FIRST_LOGPROBS) first that --trace-response asks for."""
    responses, scores, mask = rollout["sequences"][:, rollout["P"]:], rollout["scores"], rollout["mask"]
    columns = {"logprob": "logprobs", "ref_logprob": "ref_logprobs", "kl": "kl", "reward": "rewards", "value": "values",
               "advantage": "gae_advantages", "whitened": "advantages", "return": "returns"}
    seen = first_logprobs.isfinite().any(dim=1)  # none when the update reused the last valid batch
    pool = seen if seen.any() else torch.ones_like(seen)
    stopped = rollout["contains_eos"]  # (its EOS may be the last token a response has room for)
    wanted = pool & mask.bool().any(dim=1) & (stopped if args.trace_response == "stopped" else ~stopped)
    if not wanted.any():
        kind = "stopped with EOS within" if args.trace_response == "stopped" else "was cut at"
        print(f"iteration {iteration + 1}: no response of rank 0 in the update {kind} the length limit "
              f"(--trace-response {args.trace_response}): the trace shows the first")
    row = int((wanted if wanted.any() else pool).int().argmax())
    last = int(mask[row].nonzero().max()) if mask[row].any() else None  # where the score lands
    lines = []
    for t, token in enumerate(responses[row].tolist()):
        line = {"iteration": iteration + 1, "row": row, "t": t, "token": tokenizer.decode([token]),
                "mask": int(mask[row, t]), **{name: float(rollout[key][row, t]) for name, key in columns.items()},
                "score": float(scores[row]) if t == last else None,
                "new_logprob": float(first_logprobs[row, t]) if seen[row] else None}
        line["ratio"] = math.exp(line["new_logprob"] - line["logprob"]) if seen[row] else None
        lines.append(line)
    print(f"iteration {iteration + 1}: response {row} of rank 0, position by position (--trace-every)")
    plumbing.log_rows(os.path.join(os.path.dirname(run["metrics_file"]), "trace.jsonl"), lines, list(lines[0])[2:])


# --- DeepSpeed-Chat's extras, each off by default and called from one place (docs/extras.md): the EMA, the pretraining
# --- mix (LoRA: plumbing.add_lora; overflow alignment: plumbing.aligned_overflow; the GPU sampler: fast_sampling.py).
def init_ema(actor, args: Args):
    """An exponential moving average of the actor's weights (DeepSpeed-Chat's --enable_ema), for evaluation: frozen,
    ZeRO-3 when the actor is, LoRA merged in, fp32 whatever --dtype (detail 34); it starts as the actor."""
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
    blocks = unsup_blocks[torch.randint(len(unsup_blocks), (args.per_device_train_batch_size,))].to(actor.device)
    unsup_loss = actor.module(input_ids=blocks, labels=blocks, use_cache=False).loss
    if not torch.isfinite(unsup_loss):
        plumbing.fail(f"iteration {iteration}: loss/unsup_avg is {unsup_loss.item()}; lower the learning rates")
    update_sums["unsup_loss"] += unsup_loss.detach()
    return args.unsup_coef * unsup_loss

def update_ema(ema, actor, decay: float) -> None:
    """ema = decay * ema + (1 - decay) * actor for every weight (rlhf_math.ema_update), from the actor's fp32 masters,
    LoRA merged in (plumbing.merged_master_weight), into every rank's partition under ZeRO-3; nothing without an EMA."""
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
