"""ppo.py's loop, every call site checked against an independent recomputation.

A run of one or two iterations is recorded: at every optimizer step of actor and critic, the weights before the step,
the gradient it applies, its learning rate and its mini-batch's rows, and once per iteration the rollout's tensors. The
recorder takes them from the values the loop passes to helpers it calls anyway (install_recorder), as ppo.main runs,
and saves them, one file per rank, when the run ends. The tests recompute each of them from the models' weights and the run's flags, calling
rlhf_math (checked by hand in test_rlhf_math.py) and ppo.py's forward passes (checked row by row in test_ppo.py) with
every argument named: the log-probs of actor and reference, the values, the scores, the rewards and KL, the advantages
and returns, each step's gradient from the definition of the loss (every in-mask token of a mini-batch, all ranks
together, weighs the same, or every micro-batch does), each AdamW step, and every logged metric. A slip at a call site
(swapped arguments, a lost factor, an ignored flag, a flipped sign) changes one of them.
"""

import glob
import json
import shutil
import sys

import deepspeed
import numpy as np
import pytest
import torch
import torch.distributed as dist
import tyro
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import plumbing
import ppo
import rlhf_math
from test_ppo import read_metrics
from test_sft_and_reward_model import run, run_in_process

ROLLOUT = ["sequences", "attention_mask", "logprobs", "values", "advantages", "returns", "mask"]  # ppo.py's rollout


def install_recorder(set_attribute, path):
    """Record what the loop computes (module docstring) into PATH.rankN when the run ends (plumbing.end_run), from
    the values the loop passes to helpers it calls anyway, each replaced by one that records and calls the original:
    ppo.sample (the sampling config and seed where they are used: an iteration starts), ppo.iteration_metrics (all
    that the rollout computed), ppo.build_engines (which engine is the actor) and ppo.tokens_per_mini_batch (each epoch's mini-batches
    and the mask of the batch the update trains on: the k-th optimizer step of an engine in an epoch trains on its
    k-th). At every optimizer step of actor and critic (DeepSpeedEngine.step at an accumulation boundary) the weights
    before the step, the gradient it applies and its learning rates.
    set_attribute: monkeypatch.setattr in this process, setattr in a rank of its own. The pretraining mix's blocks
    are the input_ids of the trained models' forward passes that are given labels (pretraining_loss's), each
    optimizer step's in the order of its micro-batches."""
    steps, rollouts, blocks, loop, masks = [], {}, [], {"iteration": -1}, {}

    def recording(name, record):
        original = getattr(ppo, name)

        def recorded(*args, **kwargs):
            result = original(*args, **kwargs)
            record(result, *args, **kwargs)
            return result
        set_attribute(ppo, name, recorded)

    def engines(result, *_):
        loop["actor"] = result[0]

    def sampled(result, model, prompt_ids, prompt_mask, config, synced):
        loop.update(iteration=loop["iteration"] + 1, sampling=config.to_dict(), seed=torch.initial_seed())

    def logged(result, update_sums, rollout, lr, iteration, times, args):
        assert iteration == loop["iteration"]
        masks[iteration] = rollout["mask"]  # the object itself: the batch of an update is known by it
        rollouts[iteration] = {**{name: value.clone() for name, value in rollout.items() if torch.is_tensor(value)},
                               "P": rollout["P"], "kl_coef": rollout["kl_coef"], "sampling": loop.pop("sampling"),
                               "seed": loop.pop("seed")}

    def epoch(result, mask, mini_batches):
        loop.update(mask=mask, mini_batches=[rows.clone() for rows in mini_batches],
                    steps_in_epoch={"actor": 0, "critic": 0})

    for name, record in [("build_engines", engines), ("sample", sampled), ("iteration_metrics", logged),
                         ("tokens_per_mini_batch", epoch)]:
        recording(name, record)
    engine_step = deepspeed.runtime.engine.DeepSpeedEngine.step
    initialize_engine = plumbing.initialize_engine

    def recorded_engine(model, ds_config, optimizer=None, scheduler=None):
        engine = initialize_engine(model, ds_config, optimizer, scheduler)
        if optimizer is not None:
            engine.module.register_forward_pre_hook(
                lambda module, args, kwargs: blocks.append(kwargs["input_ids"].clone()) if "labels" in kwargs else None,
                with_kwargs=True)
        return engine

    def step(engine, *args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            model = "actor" if engine is loop["actor"] else "critic"
            k = loop["steps_in_epoch"][model]
            loop["steps_in_epoch"][model] += 1
            module = engine.module
            steps.append({"model": model, "iteration": loop["iteration"], "batch": loop["mask"],
                          "rows": loop["mini_batches"][k],
                          "lrs": [group["lr"] for group in engine.optimizer.param_groups],
                          "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
                          "grads": {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None},
                          "blocks": list(blocks)})
            blocks.clear()
        return engine_step(engine, *args, **kwargs)

    end_run = plumbing.end_run

    def save_then_end_run():
        for step in steps:  # the iteration whose rollout the update trained on: this one's, or the last valid one's
            step["batch"] = next(iteration for iteration, mask in masks.items() if mask is step["batch"])
        torch.save({"steps": steps, "rollouts": rollouts}, f"{path}.rank{dist.get_rank()}")
        end_run()

    set_attribute(deepspeed.runtime.engine.DeepSpeedEngine, "step", step)
    set_attribute(plumbing, "initialize_engine", recorded_engine)
    set_attribute(plumbing, "end_run", save_then_end_run)


def recorded_run(stages, out, flags, monkeypatch, ranks=None):
    """ppo.py with stages and flags, recorded: in this process, or on `ranks` ranks (this file as each rank's script).
    Returns each rank's record, the metrics lines and the run's arguments (and the trace's lines in args["trace"])."""
    argv = [*stages, *flags, "--output-dir", str(out), "--exp-name", f"test_{out.name}", "--sample-every", "0"]
    for old in glob.glob(f"runs/test_{out.name}__*"):  # left by a run that failed: its trace would be read too
        shutil.rmtree(old)
    if ranks:
        run(__file__, *argv, ranks=ranks)
    else:
        install_recorder(monkeypatch.setattr, str(out))
        error = run_in_process("ppo.py", argv, must_stop=False)
        assert error is None, error
    records = [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(ranks or 1)]
    trace = [json.loads(line) for path in glob.glob(f"runs/test_{out.name}__*/trace.jsonl") for line in open(path)]
    return records, read_metrics(f"test_{out.name}"), {**plumbing.read_record(str(out))["args"], "trace": trace}


# ---------------------------------------------------------------------------------------------------------------
# The recomputation
# ---------------------------------------------------------------------------------------------------------------
def close(actual, expected, what, tolerance=2e-5):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tolerance, atol=tolerance,
                               msg=lambda message: f"{what}: {message}")


def check_gradient(recorded, params, what):
    """The run's gradient is the recomputed one, to 1e-4 of its norm (float32 sums in another order)."""
    assert set(recorded) == {name for name, p in params.items() if p.grad is not None}, what
    run, expected = (torch.cat([tensor.flatten().double() for tensor in tensors])
                     for tensors in [recorded.values(), [params[name].grad for name in recorded]])
    error = (run - expected).norm() / expected.norm()
    assert error < 1e-4, f"{what}: the gradient differs from the recomputed one by {error:.2e} of its norm"


def with_weights(model, weights):
    """The model with these weights (the engine's parameter names; a tied output head follows its embedding)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.zero_grad(set_to_none=True)
    return model


def whiten_stats(x, masks, rank, args):
    """Mean and unbiased variance of x's in-mask values, over every rank's batch or this rank's alone."""
    ranks = range(len(x)) if args["whiten_across_ranks"] else [rank]
    values = torch.cat([x[r][masks[r].bool()].double() for r in ranks])
    return values.mean(), values.var()


def check_rollouts(records, metrics, models, args):
    """Each iteration's rollout tensors and its objective/ metrics, from the weights the actor and critic had when it
    was sampled (those before the iteration's first optimizer step) and the frozen reference and reward model."""
    policy, reference, critic, reward_model, tokenizer = models
    critic_config, reward_config = critic.config, reward_model.config
    eos, pad, kl_coef = tokenizer.eos_token_id, tokenizer.pad_token_id, args["kl_coef"]
    for iteration, m in enumerate(metrics):
        steps = [s for s in records[0]["steps"] if s["iteration"] == iteration]
        actor_weights = next(s for s in steps if s["model"] == "actor")["weights"]
        critic_weights = next(s for s in steps if s["model"] == "critic")["weights"]
        rollouts = [record["rollouts"][iteration] for record in records]
        if iteration > 0 and args["target_kl"] is not None and metrics[iteration - 1]["val/num_invalid"] < \
                args["batch_size"]:  # Ziegler's controller, from the last iteration's KL (unchanged without any)
            kl_coef = rlhf_math.adaptive_kl_coef(kl_coef=kl_coef, observed_kl=metrics[iteration - 1]["objective/kl"],
                                                 target_kl=args["target_kl"], horizon=args["kl_horizon"],
                                                 n_steps=args["batch_size"])
        if not any(r["valid"].any() for r in rollouts):  # made all invalid (test_one_rank_every_call_site)
            assert m["val/num_invalid"] == args["batch_size"] and m["objective/kl_coef"] == pytest.approx(kl_coef)
            continue
        rewards, kl, scores, valid, masks = [], [], [], [], []
        for r in rollouts:
            S, A, P, T = r["sequences"], r["attention_mask"], r["P"], args["temperature"]
            responses = S[:, P:]
            response_mask = rlhf_math.response_mask_from_stop(responses, eos)
            assert torch.equal(A, torch.cat([(S[:, :P] != pad).long(), response_mask], dim=1)), "attention mask"
            assert torch.equal(responses, torch.where(response_mask.bool(), responses, pad)), "pad after EOS"
            contains_eos = (responses == eos).any(dim=1)
            is_valid = response_mask.sum(dim=1) - contains_eos.long() >= args["min_response_tokens"]
            mask = response_mask * is_valid.unsqueeze(1)
            assert torch.equal(r["mask"], mask) and torch.equal(r["valid"], is_valid), "update mask"
            sampling = ppo.sampling_config(tokenizer, max_new_tokens=args["max_new_tokens"], temperature=T)
            assert r["sampling"] == sampling.to_dict(), "the actor samples as ppo.sampling_config says"
            in_mask = response_mask.bool()
            with torch.no_grad():
                logprobs = ppo.response_logprobs(with_weights(policy, actor_weights), S, A, P, temperature=T)
                ref_logprobs = ppo.response_logprobs(reference, S, A, P, temperature=T)
                values = ppo.critic_values(with_weights(critic, critic_weights), S, A, P,
                                           mean=critic_config.reward_mean, std=critic_config.reward_std)
                score = ppo.reward_scores(reward_model, S, A, P, mean=reward_config.reward_mean,
                                          std=reward_config.reward_std)
            if args["missing_eos_penalty"] is not None:
                score = torch.where(contains_eos, score, -args["missing_eos_penalty"])
            close(r["logprobs"][in_mask], logprobs[in_mask], "log pi_theta")
            close(r["ref_logprobs"][in_mask], ref_logprobs[in_mask], "log pi_ref")
            close(r["values"][in_mask], values[in_mask], "V(s_t)")
            close(r["scores"], score, "scores")
            # From here on the run's own (checked) inputs, so that the rest is compared to float precision.
            reward, token_kl = rlhf_math.per_token_rewards(
                scores=r["scores"], logprobs=r["logprobs"], ref_logprobs=r["ref_logprobs"], response_mask=mask,
                kl_coef=kl_coef, clip_score=args["clip_score"], kl_estimator=args["kl_estimator"])
            close(r["kl"], token_kl, "KL per token")
            assert r["kl_coef"] == pytest.approx(kl_coef), "kl_coef"
            rewards.append(reward), kl.append(token_kl), scores.append(r["scores"]), valid.append(is_valid)
            masks.append(mask)
        for rank, r in enumerate(rollouts):
            reward = rewards[rank]
            if args["whiten_rewards"]:
                reward = rlhf_math.masked_whiten(reward, masks[rank], shift_mean=False,
                                                 stats=whiten_stats(rewards, masks, rank, args))
            close(r["rewards"], reward, "per-token rewards")
        advantages = []
        for rank, r in enumerate(rollouts):
            advantage, returns = rlhf_math.gae_advantages_and_returns(
                rewards=r["rewards"], values=r["values"], response_mask=masks[rank], gamma=args["gamma"],
                lam=args["lam"])
            in_mask = masks[rank].bool()
            close(r["returns"][in_mask], returns[in_mask], "returns")
            advantages.append(advantage)
        for rank, r in enumerate(rollouts):
            advantage = advantages[rank]
            if args["whiten_advantages"]:
                advantage = rlhf_math.masked_whiten(advantage, masks[rank],
                                                    stats=whiten_stats(advantages, masks, rank, args))
            in_mask = masks[rank].bool()
            close(r["advantages"][in_mask], advantage[in_mask], "advantages", 1e-4)
        # objective/: over the valid responses of all ranks
        kl, scores, valid = torch.cat(kl), torch.cat(scores), torch.cat(valid)
        responses = torch.cat([r["response_mask"] for r in rollouts])
        kl_per_response = kl.sum() / valid.sum()
        expected = {
            "objective/kl": kl_per_response, "objective/scores": scores[valid].mean(),
            "objective/scores_std": scores[valid].std(unbiased=False), "objective/kl_coef": kl_coef,
            "objective/rlhf_reward": scores[valid].clamp(-args["clip_score"], args["clip_score"]).mean()
            - kl_coef * kl_per_response,
            "objective/non_score_reward": -kl_coef * kl_per_response,
            "objective/scores_clipfrac": (scores[valid].abs() >= args["clip_score"]).float().mean(),
            "objective/entropy": -torch.cat([torch.where(r["mask"].bool(), r["logprobs"], 0.0)
                                             for r in rollouts]).sum() / valid.sum(),
            "val/num_invalid": (~valid).sum(), "val/response_length": responses.sum() / len(responses),
            "val/num_eos_tokens": torch.cat([r["contains_eos"] for r in rollouts]).sum(),
            "episode": (iteration + 1) * args["batch_size"],
            "lr": next(s for s in steps if s["model"] == "actor")["lrs"][0]}
        for name, value in expected.items():
            assert m[name] == pytest.approx(float(value), rel=1e-5, abs=1e-6), (iteration, name)
    # Each rank samples from a seed of its own, and each iteration from another: ranks that drew alike would answer
    # alike what they were asked alike.
    seeds = [record["rollouts"][iteration]["seed"] for record in records for iteration in range(len(metrics))]
    assert len(set(seeds)) == len(seeds), seeds
    # Each rank answers its own share of the iteration's prompts, drawn in an order shuffled once per pass.
    prompts = plumbing.load_prompts(tokenizer, args["dataset"], args["train_split"], args["prompt_column"],
                                    args["max_prompt_len"], False)
    per_rank, per_pass = args["per_device_rollout_batch_size"], len(prompts) // args["batch_size"]
    for iteration in range(len(metrics)):
        order = np.random.default_rng([args["seed"], iteration // per_pass]).permutation(len(prompts))
        first = iteration % per_pass * args["batch_size"]
        for rank, record in enumerate(records):
            r = record["rollouts"][iteration]
            answered = [row[mask.bool()].tolist() for row, mask in zip(r["sequences"][:, : r["P"]],
                                                                        r["attention_mask"][:, : r["P"]])]
            assert answered == [prompts[i] for i in order[first + rank * per_rank : first + (rank + 1) * per_rank]]


def check_updates(records, metrics, models, args):
    """Each optimizer step's gradient, recomputed at the weights the run had before that step, from the loss's
    definition over the step's mini-batch (every rank's rows): PPO's clipped losses averaged over every in-mask token
    (token-mean) or over the micro-batches' token means (micro-batch-mean), plus gamma times the pretraining mix's
    language-modelling loss, averaged over the step's micro-batches of blocks (all ranks'). And the update's metrics,
    summed over every micro-batch of every step."""
    policy, _, critic, _, _ = models
    T, micro = args["temperature"], args["per_device_train_batch_size"]
    sums = {}
    for k, step in enumerate(records[0]["steps"]):
        i, actor = step["iteration"], step["model"] == "actor"
        model = with_weights(policy if actor else critic, step["weights"])
        parts = [(record["rollouts"][record["steps"][k]["batch"]], record["steps"][k]["rows"]) for record in records]
        num_tokens = sum(r["mask"][rows].sum() for r, rows in parts)
        num_micro_batches = sum(len(rows.split(micro)) for _, rows in parts)
        sums.setdefault(i, {"ratios": [], **{name: 0.0 for name in ["tokens", "pg_loss", "vf_loss", "entropy",
                                                                      "approxkl", "clipfrac", "ratio", "vf_clipfrac",
                                                                      "unsup", "unsup_micro_batches"]}})
        total = sums[i]
        for r, rows in parts:
            for micro_rows in rows.split(micro):
                mb = {name: r[name][micro_rows] for name in ROLLOUT}
                S, A, P, mask = mb["sequences"], mb["attention_mask"], r["P"], mb["mask"]
                n = mask.sum()
                weight = n / num_tokens if args["loss_aggregation"] == "token-mean" else 1 / num_micro_batches
                if actor:
                    logits = ppo.response_logits(model, S, A, P)
                    loss, stats = rlhf_math.policy_loss(
                        logprobs=rlhf_math.logprobs_from_logits(logits, S[:, P:], temperature=T),
                        old_logprobs=mb["logprobs"], advantages=mb["advantages"], response_mask=mask,
                        cliprange=args["cliprange"])
                    entropy = rlhf_math.masked_mean(rlhf_math.entropy_from_logits(logits.detach(), T), mask)
                    for name, value in [("pg_loss", loss), ("entropy", entropy), *stats.items()]:
                        total[name] += float(value.detach() if torch.is_tensor(value) else value) * n
                    total["tokens"] += n
                    if n:
                        total["ratios"].append(float(stats["ratio"]))
                else:
                    loss, clipfrac = rlhf_math.value_loss(
                        values=ppo.critic_values(model, S, A, P, mean=critic.config.reward_mean,
                                                 std=critic.config.reward_std),
                        old_values=mb["values"], returns=mb["returns"], response_mask=mask,
                        cliprange_value=args["cliprange_value"])
                    total["vf_loss"] += float(loss.detach()) * n
                    total["vf_clipfrac"] += float(clipfrac) * n
                (weight * loss).backward()
        if actor and args["unsup_dataset"]:  # gamma * the mean language-modelling loss of the step's blocks
            blocks = [block for record in records for block in record["steps"][k]["blocks"]]
            assert len(blocks) == num_micro_batches, (k, len(blocks))  # one micro-batch of blocks per PPO micro-batch
            for block in blocks:
                unsup_loss = model(input_ids=block, labels=block).loss
                (args["unsup_coef"] * unsup_loss / len(blocks)).backward()
                total["unsup"] += float(unsup_loss.detach())
                total["unsup_micro_batches"] += 1
        check_gradient(step["grads"], dict(model.named_parameters()), f"iteration {i}, step {k} ({step['model']})")
    for i, total in sums.items():
        ratios = torch.tensor(total["ratios"], dtype=torch.float64)
        expected = {"loss/policy_avg": total["pg_loss"] / total["tokens"],
                    "loss/value_avg": total["vf_loss"] / total["tokens"],
                    "policy/entropy_avg": total["entropy"] / total["tokens"],
                    "policy/approxkl_avg": total["approxkl"] / total["tokens"],
                    "policy/clipfrac_avg": total["clipfrac"] / total["tokens"],
                    "val/ratio": total["ratio"] / total["tokens"], "val/ratio_var": ratios.var(),
                    "val/clipfrac_avg": total["vf_clipfrac"] / total["tokens"]}
        if args["unsup_dataset"]:
            expected["loss/unsup_avg"] = total["unsup"] / total["unsup_micro_batches"]
        for name, value in expected.items():
            assert metrics[i][name] == pytest.approx(float(value), rel=1e-4, abs=1e-6), (i, name)


def check_optimizer(records, out, models, args):
    """AdamW, replayed from the models the run starts from with each step's (checked) gradient, clipped to
    --gradient-clipping, at the scheduled learning rate, gives the weights the run had before its next step, and
    at the end the actor and critic it saved; with --enable-ema, the saved EMA is the decayed average of the actor's
    weights after every step."""
    policy, _, critic, _, _ = models
    num_steps = args["num_iterations"] * args["num_ppo_epochs"] * args["num_mini_batches"]
    for name, model, start, learning_rate in [
            ("actor", policy, args["actor_model_name_or_path"], args["actor_learning_rate"]),
            ("critic", critic, args["critic_model_name_or_path"] or args["reward_model_name_or_path"],
             args["critic_learning_rate"])]:
        steps = [step for step in records[0]["steps"] if step["model"] == name]
        assert len(steps) == num_steps
        saved = type(model).from_pretrained(out / name)
        params = {n: p.detach().clone().requires_grad_()
                  for n, p in type(model).from_pretrained(start).named_parameters()}
        adamw = torch.optim.AdamW(params.values(), lr=learning_rate, weight_decay=args["weight_decay"])
        ema = {n: p.detach().clone() for n, p in params.items()}  # ema = decay ema + (1 - decay) actor, per step
        for k, step in enumerate([*steps, {"weights": dict(saved.named_parameters())}]):
            for n, p in params.items():
                close(p.detach(), step["weights"][n], f"{name} before step {k}: {n}", 1e-6)
            if k == len(steps):
                break
            for n, p in params.items():
                p.grad = step["grads"][n].clone()
            if args["gradient_clipping"] > 0:
                torch.nn.utils.clip_grad_norm_(params.values(), args["gradient_clipping"])
            lr = learning_rate * (1 - k / num_steps if args["lr_scheduler_type"] == "linear" else 1)
            assert step["lrs"] == [pytest.approx(lr)], (name, k)
            adamw.param_groups[0]["lr"] = lr
            adamw.step()
            for n, p in params.items():
                ema[n] = args["ema_decay"] * ema[n] + (1 - args["ema_decay"]) * p.detach()
        if name == "actor" and args["enable_ema"]:
            for n, p in type(model).from_pretrained(out / "actor_ema").named_parameters():
                close(p.detach(), ema[n], f"the EMA's {n}", 1e-6)


def reference_models(stages, critic_path):
    """Plain Hugging Face models of the run's four (actor and critic take each step's weights in turn)."""
    sft, reward_model = stages[1], stages[3]
    return (AutoModelForCausalLM.from_pretrained(sft).eval(), AutoModelForCausalLM.from_pretrained(sft).eval(),
            AutoModelForSequenceClassification.from_pretrained(critic_path or reward_model).eval(),
            AutoModelForSequenceClassification.from_pretrained(reward_model).eval(),
            AutoTokenizer.from_pretrained(sft))


@pytest.fixture(scope="module")
def critic_start(stages, tmp_path_factory):
    """A copy of the reward model with another normalization in its config, to start the critic from: the critic's
    values and the reward model's scores are then mapped by different (mean, std)."""
    folder = tmp_path_factory.mktemp("critic") / "critic_start"
    shutil.copytree(stages[3], folder)
    config = AutoConfig.from_pretrained(folder)
    config.reward_mean, config.reward_std = config.reward_mean + 0.25, config.reward_std * 1.5
    config.save_pretrained(folder)
    return str(folder)


def pretraining_text_file(path, length):
    """Plain text of 40 documents, each a block of LENGTH tokens with its EOS, of five kinds (" good" and " bad" in
    other proportions): the micro-batches' language-modelling losses differ, so that a factor on one of them shows."""
    path.write_text("".join(" good" * (length - 1 - k % 5) + " bad" * (k % 5) + "\n" for k in range(40)))
    return str(path)


# 2 iterations of 8 prompts per rank; each epoch splits a rank's 8 into 2 mini-batches of 2 micro-batches of 2.
LAYOUT = ["--total-episodes", "16", "--per-device-rollout-batch-size", "8", "--num-mini-batches", "2",
          "--per-device-train-batch-size", "2", "--num-ppo-epochs", "2", "--max-new-tokens", "10",
          "--max-prompt-len", "32"]
# Every coefficient off its default and apart from the others, so that a swap or an ignored flag shows.
OFF_DEFAULTS = ["--temperature", "0.7", "--gamma", "0.9", "--lam", "0.8", "--cliprange", "0.1",
                "--cliprange-value", "0.3", "--kl-coef", "0.3", "--target-kl", "0.02", "--kl-horizon", "100",
                "--clip-score", "1.5", "--gradient-clipping", "0.5", "--actor-learning-rate", "2e-3",
                "--critic-learning-rate", "3e-3", "--weight-decay", "0.1", "--min-response-tokens", "10"]


def check_run(records, metrics, out, stages, critic_path, args):
    models = reference_models(stages, critic_path)
    assert len(metrics) == args["num_iterations"]
    check_rollouts(records, metrics, models, args)
    check_updates(records, metrics, models, args)
    check_optimizer(records, out, models, args)


# The one-rank runs, both in token-mean (micro-batch-mean: test_two_ranks_every_call_site). "adaptive": three
# iterations, responses long enough to stop anywhere, and a target KL 10% under the second iteration's, so that the
# controller's second step is not clipped (test_one_rank_every_call_site measures that KL first: where training lands
# differs from one CPU to another). "reuse": 4 micro-batches, the second iteration's responses all made invalid (its
# update trains on the first batch again, with that batch's token counts), and --min-response-tokens at the length
# limit (OFF_DEFAULTS), so that responses cut there are valid with exactly the minimum and those that stopped are not.
# In both, shape_responses makes a response invalid by one token and one cut at the limit.
def check_trace(records, args, tokenizer):
    """--trace-every 1: each iteration's trace is one response of the batch, position by position, with the values
    the loop computed (the recorded rollout's): the score on its last in-mask position only, rewards 0 after it,
    returns = GAE advantages + values in the mask, and the new log-probs of the update's first mini-batch (ratio 1: no
    step yet), none when the update reused the last valid batch. The response is the first valid one of that
    mini-batch that stopped with EOS within the length limit (or was cut at it, with --trace-response cut)."""
    for iteration, rollout in records[0]["rollouts"].items():
        lines = [line for line in args["trace"] if line["iteration"] == iteration + 1]
        row, responses = lines[0]["row"], rollout["sequences"][:, rollout["P"]:]
        assert [line["t"] for line in lines] == list(range(responses.shape[1])) and {l["row"] for l in lines} == {row}
        mask = rollout["mask"][row]
        last = int(mask.nonzero().max()) if mask.any() else None
        for t, line in enumerate(lines):
            assert line["token"] == tokenizer.decode([int(responses[row, t])]) and line["mask"] == mask[t]
            for name, tensor in [("logprob", rollout["logprobs"]), ("ref_logprob", rollout["ref_logprobs"]),
                                 ("kl", rollout["kl"]), ("reward", rollout["rewards"]), ("value", rollout["values"]),
                                 ("advantage", rollout["gae_advantages"]), ("whitened", rollout["advantages"]),
                                 ("return", rollout["returns"])]:
                assert line[name] == float(tensor[row, t]), (iteration, t, name)
            assert line["score"] == (float(rollout["scores"][row]) if t == last else None), (iteration, t)
            if last is not None and t > last:
                assert line["reward"] == 0.0
            if line["mask"]:  # (GAE leaves 0 where the mask is 0)
                assert line["return"] == pytest.approx(line["advantage"] + line["value"], abs=1e-5)
        first_step = next(s for s in records[0]["steps"] if s["iteration"] == iteration and s["model"] == "actor")
        if first_step["batch"] != iteration:  # the update trained on an earlier batch
            assert all(line["new_logprob"] is None and line["ratio"] is None for line in lines)
            continue
        first_rows = first_step["rows"].tolist()
        stopped = (responses == tokenizer.eos_token_id).any(dim=1)  # (an EOS in the last place, too)
        wanted = [r for r in first_rows if rollout["mask"][r].any() and
                  bool(stopped[r]) == (args["trace_response"] == "stopped")]
        assert wanted and row == min(wanted), (iteration, row, first_rows)  # a response whose trace shows something
        assert all(line["ratio"] == pytest.approx(1.0, abs=1e-5) for line in lines if line["mask"])


def shape_responses(monkeypatch, tokenizer, minimum: int, all_invalid_at: int | None = None):
    """While ppo.py runs (until the function returned is called), in every rollout: response 0 stops with EOS one
    real token short of MINIMUM (--min-response-tokens: invalid, and valid if the EOS counted as a token), response 1
    never stops (cut at the length limit: valid, without the EOS the trick's penalty replaces its score); with
    all_invalid_at=N, no response of the N-th rollout has a real token (its update reuses the last valid batch). Made
    so by rewriting the sampled tokens where the loop first reads them (rlhf_math.response_mask_from_stop): what the
    model samples decides nothing, unless every response stops before MINIMUM tokens (sampling ends there)."""
    mask_from_stop, calls, shaping = rlhf_math.response_mask_from_stop, [], [True]
    word = tokenizer(" good").input_ids[0]

    def response_mask(responses, stop_token_id):
        if not shaping[0]:
            return mask_from_stop(responses, stop_token_id)
        calls.append(None)
        if responses.shape[1] >= minimum:
            for row, end in [(0, minimum - 1), (1, responses.shape[1])]:  # no stop or padding before END
                head = responses[row, :end]
                head[(head == stop_token_id) | (head == tokenizer.pad_token_id)] = word
            responses[0, minimum - 1] = stop_token_id
        return mask_from_stop(responses, stop_token_id) * (len(calls) != all_invalid_at)

    monkeypatch.setattr(rlhf_math, "response_mask_from_stop", response_mask)
    return lambda: shaping.__setitem__(0, False)


ONE_RANK = {"adaptive": ["--loss-aggregation", "token-mean", "--per-device-train-batch-size", "2", "--total-episodes",
                         "24", "--max-new-tokens", "16", "--min-response-tokens", "12", "--actor-learning-rate",
                         "5e-4"],
            "reuse": ["--loss-aggregation", "token-mean", "--per-device-train-batch-size", "1",
                      "--total-episodes", "16"]}


@pytest.mark.parametrize("variant", list(ONE_RANK))
def test_one_rank_every_call_site(stages, critic_start, tmp_path, monkeypatch, capsys, variant):
    """One rank, the flags off their defaults, k3, reward whitening, the EOS trick, the pretraining mix and the EMA
    (ONE_RANK's two variants); in "reuse" the second iteration trains on the first iteration's batch again, with that
    batch's prompt length. The reward model's normalization was measured at another temperature and length: ppo.py
    says so."""
    flags = [*LAYOUT, *OFF_DEFAULTS, *ONE_RANK[variant]]
    minimum = int(flags[len(flags) - flags[::-1].index("--min-response-tokens")])  # the last one given
    stop_shaping = shape_responses(monkeypatch, AutoTokenizer.from_pretrained(stages[1]), minimum,
                                   all_invalid_at=2 if variant == "reuse" else None)
    length = 32 + int(flags[len(flags) - flags[::-1].index("--max-new-tokens")])  # prompt + the last one given
    flags += ["--critic-model-name-or-path", critic_start, "--kl-estimator", "k3", "--whiten-rewards",
              "--missing-eos-penalty", "1.0", "--unsup-dataset", pretraining_text_file(tmp_path / "text.txt", length),
              "--unsup-coef", "0.5", "--enable-ema", "--ema-decay", "0.8"]
    if variant == "adaptive":  # --target-kl 10% under the second iteration's KL, which no target changes (beta adapts
        # to the KL of a rollout after it): measured with the same flags and OFF_DEFAULTS' --target-kl. The controller's
        # second step is then neither clipped (at 20%) nor nil.
        run("ppo.py", *stages, *flags, "--output-dir", str(tmp_path / "measured"), "--exp-name", "test_measured",
            "--sample-every", "0", here=True)
        flags += ["--target-kl", repr(read_metrics("test_measured")[1]["objective/kl"] / 1.1)]
    # (In "reuse" a valid response has --max-new-tokens real tokens: none stopped before the limit.)
    flags += ["--trace-every", "1", "--trace-response", "stopped" if variant == "adaptive" else "cut"]
    records, metrics, args = recorded_run(stages, tmp_path / "recorded_one_rank", flags, monkeypatch)
    stop_shaping()
    check_trace(records, args, AutoTokenizer.from_pretrained(stages[1]))
    assert "were measured on other responses: --temperature 0.7 (measured with 1.0); --max-new-tokens " \
        f"{args['max_new_tokens']} (measured with 24)." in capsys.readouterr().out
    real_tokens = torch.cat([r["response_mask"].sum(dim=1) - r["contains_eos"].long()
                             for r in records[0]["rollouts"].values()])
    assert (real_tokens == args["min_response_tokens"] - 1).any(), real_tokens  # invalid by one, with an EOS
    if variant == "adaptive":  # the second adaptation of beta is within the controller's clip, and not nil
        assert metrics[1]["objective/kl"] / args["target_kl"] == pytest.approx(1.1), metrics[1]["objective/kl"]
    else:  # valid responses with exactly the minimum (cut at the limit); prompt lengths that differ between the batches
        assert (real_tokens == args["min_response_tokens"]).any(), real_tokens
        assert [step["batch"] for step in records[0]["steps"]] == [0] * 16
        assert records[0]["rollouts"][0]["P"] != records[0]["rollouts"][1]["P"]
    check_run(records, metrics, tmp_path / "recorded_one_rank", stages, critic_start, args)


@pytest.mark.parametrize("aggregation, across_ranks, flags", [
    ("token-mean", True, ["--total-episodes", "24", "--max-new-tokens", "16", "--min-response-tokens", "12",
                          "--actor-learning-rate", "5e-4", "--kl-estimator", "k3"]),
    ("micro-batch-mean", False, ["--total-episodes", "8"])])
def test_two_ranks_every_call_site(stages, critic_start, tmp_path, monkeypatch, aggregation, across_ranks, flags):
    """Two ranks: the losses, the whitening, the adaptive KL coefficient (three iterations, k3, the target 10% under
    the second iteration's KL, measured first as in test_one_rank_every_call_site, so that the controller's second
    step is neither clipped nor nil, and a rank that adapted beta to its own KL alone would show) and the metrics over
    both ranks' batches (or, for the whitening with --no-whiten-across-ranks, each rank's own); constant learning
    rates, no gradient clipping."""
    flags = [*LAYOUT, *OFF_DEFAULTS, "--per-device-rollout-batch-size", "4", "--num-mini-batches", "2",
             "--per-device-train-batch-size", "1", "--critic-model-name-or-path", critic_start,
             "--loss-aggregation", aggregation,
             "--whiten-across-ranks" if across_ranks else "--no-whiten-across-ranks", "--gradient-clipping", "0",
             "--lr-scheduler-type", "constant", *flags]
    out = tmp_path / f"recorded_two_ranks_{aggregation}"
    if aggregation == "token-mean":  # (two iterations are enough to measure: the learning rates are constant)
        run("ppo.py", *stages, *flags, "--total-episodes", "16", "--output-dir", str(tmp_path / "measured"),
            "--exp-name", "test_measured_two_ranks", "--sample-every", "0", ranks=2)
        flags += ["--target-kl", repr(read_metrics("test_measured_two_ranks")[1]["objective/kl"] / 1.1)]
    records, metrics, args = recorded_run(stages, out, flags, monkeypatch, ranks=2)
    if aggregation == "token-mean":
        assert metrics[1]["objective/kl"] / args["target_kl"] == pytest.approx(1.1), metrics[1]["objective/kl"]
    check_run(records, metrics, out, stages, critic_start, args)


if __name__ == "__main__":  # one rank of a recorded run: ppo.py, as the launcher started it, with the recorder
    install_recorder(setattr, sys.argv[sys.argv.index("--output-dir") + 1])
    ppo.main(tyro.cli(ppo.Args))
