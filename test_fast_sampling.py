"""fast_sampling.py, ppo.py's --sampler static, on a CPU: its decode step compiled (the CUDA graph needs a GPU:
gpu_check.sh runs the checks of its logits, tokens and lengths on CUDA, FAST_SAMPLING_TEST_DEVICE=cuda), its logits
those of the eager forward, its tokens drawn from the policy as ppo.sample draws them, every response run to its EOS or
the length limit, the same tokens from a recorded step whose outputs each replay overwrites, its kept copy of the
actor, and its one recording for a whole run under ZeRO-3."""

import functools
import glob
import math
import os
import shutil
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import fast_sampling
import ppo
import rlhf_math
from ppo import response_logits
from test_architectures import ARCHITECTURES
from test_plumbing import BASE_MODEL, check_stops
from test_ppo import FEW_ITERATIONS, read_metrics, tiny_models
from test_sft_and_reward_model import run_in_process

R = 40  # tokens a rollout: past the stop check at 16 and 32 (read every 16 tokens), as ppo.py's defaults (24) are
# Where the sampler's checks run: this CPU, or (gpu_check.sh) CUDA, where the recorded step is a CUDA graph's replay.
DEVICE = torch.device(os.environ.get("FAST_SAMPLING_TEST_DEVICE", "cpu"))


def static_rollouts(model, ids, mask, config, prompt_len, seeds):
    """For each seed, a rollout of sample_static from a sampler of model for prompts of prompt_len tokens: its
    responses [B, R] and the logits z its compiled step drew tokens 2 to R from [B, <= R - 1, V] (none once every
    response has stopped). One recording in all."""
    sampler = fast_sampling.static_sampler(types.SimpleNamespace(module=model), config, False,
                                           ppo.Args(max_prompt_len=prompt_len, per_device_rollout_batch_size=len(ids)),
                                           DEVICE)
    step, logits, rollouts = sampler["step"], [], []

    def recorded(*inputs):  # the compiled step, its logits kept
        z, tokens, running = step(*inputs)
        logits[-1].append(z.clone())
        return z, tokens, running
    sampler["step"] = recorded
    with torch.no_grad():
        for seed in seeds:
            torch.manual_seed(seed)
            logits.append([])
            responses = fast_sampling.sample_static(sampler, model, ids, mask, config)
            rollouts.append((responses, torch.stack(logits[-1], dim=1)))
    assert sampler["recordings"] == 1
    return rollouts


def scaled_logits(model, ids, mask, responses, config):
    """The eager forward's logits of every response token in fp32, as sampling_config samples from them: z / tau, the
    suppressed tokens at -inf. [B, R, V]."""
    with torch.no_grad():
        z = response_logits(model, torch.cat([ids, responses], 1), torch.cat([mask, torch.ones_like(responses)], 1),
                            ids.shape[1]).float() / config.temperature
    z[..., config.suppress_tokens] = -math.inf
    return z


@pytest.fixture(scope="module")
def static_draws():
    """sample_static on the bundled model in bf16: 4 prompts x 16 rows, 6 rollouts of R tokens at temperature 0.7,
    and 6 of ppo.sample. For each static rollout: its responses [64, R], the logits z that its compiled step drew
    tokens 2 to R from, and the eager forward's logits of every response token on the same sequences, in bf16 and in
    fp32 ([64, R, V] each), scaled and suppressed alike. Sampled on DEVICE, returned on the CPU."""
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL, dtype=torch.bfloat16).to(DEVICE).eval()
    exact = AutoModelForCausalLM.from_pretrained(BASE_MODEL).to(DEVICE).eval()
    config = ppo.sampling_config(tokenizer, R, 0.7)
    prompts = tokenizer(["The story", "I watched this film last night and", "We", "The acting was"] * 16,
                        padding=True, return_tensors="pt").to(DEVICE)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    draws = []
    for responses, z in static_rollouts(model, ids, mask, config, 16, range(6)):  # prompts padded from 9 to 16
        eager = [scaled_logits(m, ids, mask, responses, config) for m in (model, exact)]
        draws.append(tuple(t.cpu() for t in (responses, z, *eager)))
    eager_responses = []
    with torch.no_grad():
        for seed in range(6):
            torch.manual_seed(seed)
            eager_responses.append(ppo.sample(model, ids, mask, config, False).cpu())
    return draws, torch.cat(eager_responses), tokenizer


def test_static_sampling_step_gives_the_eager_logits(static_draws):
    """The compiled decode step's logits, wherever they draw a token (after the first, which the prompt's eager pass
    draws; up to the EOS: after it the step reads pad tokens, and its tokens are pad whatever they say), are the eager
    forward's within bf16's precision: no further from the fp32 forward's than the eager bf16 forward's are (the mean
    and the largest error at most 1.5 and 2 times the eager one's; they are near 0.01 and 0.2 for logits up to 22)."""
    for responses, z, eager, exact in static_draws[0]:
        steps = z.shape[1]  # the step stops with the stop check once every response has stopped
        eager, exact = eager[:, 1 : 1 + steps], exact[:, 1 : 1 + steps]
        assert torch.equal(torch.isfinite(z), torch.isfinite(exact))
        eos = static_draws[2].eos_token_id
        drawing = rlhf_math.response_mask_from_stop(responses, eos)[:, 1 : 1 + steps].bool().unsqueeze(-1)
        finite = torch.isfinite(exact) & drawing
        ours, bf16 = ((logits - exact)[finite].abs() for logits in (z, eager))
        assert ours.mean() <= 1.5 * bf16.mean() and ours.max() <= 2 * bf16.max(), (ours.mean(), bf16.mean(),
                                                                                    ours.max(), bf16.max())


def test_static_sampling_draws_from_the_policy(static_draws):
    """The tokens of sample_static follow the eager policy softmax(z / tau), at every position up to the EOS: with
    a drawn from p, the randomized probability integral transform u = P(a' < a) + v p(a), v ~ U(0, 1), is uniform,
    and independent from one position to the next (Rosenblatt 1952). The Kolmogorov-Smirnov distance of all u from
    uniform stays below its 0.1% critical value 1.95 / sqrt(n) (a statistical test: no seed has to match)."""
    draws, _, tokenizer = static_draws
    generator, transformed = torch.Generator().manual_seed(0), []
    for responses, _, eager, _ in draws:
        p = torch.softmax(eager, dim=-1)  # [B, R, V]
        drawn = responses.unsqueeze(-1)
        p_drawn = p.gather(-1, drawn)
        u = p.cumsum(dim=-1).gather(-1, drawn) - p_drawn + torch.rand(p_drawn.shape, generator=generator) * p_drawn
        transformed.append(u.squeeze(-1)[rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id).bool()])
    u = torch.cat(transformed).sort().values.double()
    n = len(u)
    distance = max((torch.arange(1, n + 1) / n - u).max(), (u - torch.arange(n) / n).max())
    assert n > 3000 and distance < 1.95 / n**0.5, (n, distance)


def test_static_sampling_runs_every_response_to_its_end(static_draws):
    """Every response of sample_static runs to its EOS or to the length limit, R = 40 tokens, past the stop check at
    16 and 32: no pad before an EOS, nothing after it but pad, as ppo.sample's. And its lengths are ppo.sample's on
    the same prompts and weights: at every position, the share of the 384 responses still open differs by less than
    5 standard errors of a difference of two shares (a statistical test: no seed has to match)."""
    draws, eager, tokenizer = static_draws
    static = torch.cat([responses for responses, *_ in draws])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    open_shares = []
    for responses in (static, eager):
        mask = rlhf_math.response_mask_from_stop(responses, eos).bool()
        assert not (responses[mask] == pad).any() and (responses[~mask] == pad).all()
        open_shares.append(mask.float().mean(dim=0))  # [R]: the share of responses with no EOS before t
    static_open, eager_open = open_shares
    assert eager_open[16] > 0.1 and eager_open[32] > 0, eager_open  # the premise: open past both stop checks
    share = (static_open + eager_open) / 2
    standard_error = (2 * share * (1 - share) / len(static)).sqrt()
    assert ((static_open - eager_open).abs() <= 5 * standard_error + 1e-9).all(), (static_open, eager_open)


def test_a_recorded_step_that_overwrites_its_outputs_gives_the_eager_tokens(monkeypatch):
    """On CUDA the recorded decode step returns the same output tensors at every replay, and the next replay
    overwrites them (fast_sampling.cuda_graph): sample_static must take each step's tokens out before the next step, or
    every response would end up repeating its last token. Here the step is replayed by replay_into_kept_outputs, a
    stand-in for the graph on any device: from the same seed, the tokens of the eager step, which returns new tensors.
    (Uncompiled: the contract, not the compiler.)"""
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL).to(DEVICE).eval()
    config = ppo.sampling_config(tokenizer, 24, 1.0)
    prompts = tokenizer(["The story", "I watched this film last night and", "We", "The acting was"] * 2,
                        padding=True, return_tensors="pt").to(DEVICE)
    sampler = fast_sampling.static_sampler(types.SimpleNamespace(module=model), config, False,
                                           ppo.Args(max_prompt_len=16, per_device_rollout_batch_size=8), DEVICE)
    responses = []
    for step in [fast_sampling.decode_step, replay_into_kept_outputs(fast_sampling.decode_step)]:
        sampler["step"] = step
        torch.manual_seed(0)
        with torch.no_grad():
            responses.append(fast_sampling.sample_static(sampler, model, prompts["input_ids"],
                                                         prompts["attention_mask"], config))
    eager, replayed = responses
    assert (eager[:, 1:] != eager[:, -1:]).any(), "the premise: responses that do not repeat their last token"
    assert torch.equal(replayed, eager)


def replay_into_kept_outputs(step):
    """step as a replay of fast_sampling.cuda_graph returns it: each call copies its tensor inputs into tensors it
    keeps, runs step on them, and writes the outputs into the tensors it returned the first time, which it returns
    again; what one call returned, the next overwrites."""
    kept_inputs, kept_outputs = [], []

    def replay(*inputs):
        if not kept_inputs:
            kept_inputs.extend(x.clone() if torch.is_tensor(x) else x for x in inputs)
        for kept, new in zip(kept_inputs, inputs):
            if torch.is_tensor(new):
                kept.copy_(new)
        outputs = step(*kept_inputs)
        if not kept_outputs:
            kept_outputs.extend(torch.empty_like(output) for output in outputs)
        for kept, output in zip(kept_outputs, outputs):
            kept.copy_(output)
        return tuple(kept_outputs)
    return replay


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_static_sampling_step_compiles_in_every_family(model_type):
    """The decode step compiles in every family, and its logits are the eager forward's wherever they draw a token
    (fp32; test_static_sampling_step_gives_the_eager_logits: bf16)."""
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL, padding_side="left")
    model, _ = tiny_models(model_type, tokenizer)
    prompts = tokenizer(["I watched this film last night and", "We saw it"], padding=True, return_tensors="pt")
    config = ppo.sampling_config(tokenizer, max_new_tokens=8, temperature=0.7)
    P = prompts["input_ids"].shape[1]
    [(responses, z)] = static_rollouts(model, prompts["input_ids"], prompts["attention_mask"], config, P + 2, [0])
    steps = z.shape[1]
    drawing = rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)[:, 1 : 1 + steps].bool()
    eager = scaled_logits(model, prompts["input_ids"], prompts["attention_mask"], responses, config)[:, 1 : 1 + steps]
    torch.testing.assert_close(z[drawing], eager[drawing], atol=1e-5, rtol=1e-5)


def test_a_decode_step_that_does_not_compile_or_differs_stops_with_one_line(monkeypatch):
    """A model whose decode step torch.compile cannot trace whole (or, on CUDA, a graph that cannot be recorded)
    stops the run with one line that names the model and the way out, not a compiler's stack trace; so does a recorded
    step whose logits are not the eager step's (one that read the wrong memory would sample from another policy)."""
    def failing(function, **options):
        def compiled(*args):
            raise RuntimeError("Unsupported: data-dependent branching\n  from user code: ...")
        return compiled

    def off(function, **options):  # logits 1/8 of the largest off: a wrong step, not rounding
        def compiled(*args):
            z, tokens, running = function(*args)
            return z + torch.where(z.isfinite(), z, 0).abs().max() / 4, tokens, running
        return compiled
    tokenizer = AutoTokenizer.from_pretrained(BASE_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL).eval()
    sampler = functools.partial(fast_sampling.static_sampler, types.SimpleNamespace(module=model),
                                ppo.sampling_config(tokenizer, 4, 1.0), False,
                                ppo.Args(max_prompt_len=8, per_device_rollout_batch_size=2), torch.device("cpu"))
    for compile_as, message in [
            (failing, "--sampler static: the decode step of LlamaForCausalLM could not be compiled and recorded "
                      "(RuntimeError: Unsupported: data-dependent branching from user code: ...); use --sampler eager"),
            (off, "--sampler static: the recorded decode step of LlamaForCausalLM gives other logits than the eager "
                  "step; use --sampler eager")]:
        monkeypatch.setattr(torch, "compile", compile_as)
        check_stops([(sampler, message)])


def test_an_inference_copy_takes_weights_in_place():
    """inference_copy is the model's architecture in its dtype with no gradients, and copy_weights sets its weights
    to another model's without moving them (a recorded CUDA graph reads them where they were); a model whose weights
    are named otherwise (LoRA adapters) stops with one line."""
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL, dtype=torch.bfloat16)
    copy = fast_sampling.inference_copy(model, torch.device("cpu"), trust_remote_code=False)
    assert type(copy) is type(model) and not copy.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    addresses = [p.data_ptr() for p in copy.parameters()]
    fast_sampling.copy_weights(model, copy)
    assert [p.data_ptr() for p in copy.parameters()] == addresses
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), copy.parameters()))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(copy(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(SystemExit, match="are not those of a plain copy of it"):
        fast_sampling.copy_weights(torch.nn.Linear(2, 2), copy)


def test_static_sampling_under_zero3_records_its_step_once(stages, tmp_path, monkeypatch):
    """--sampler static on a CPU with the actor under ZeRO-3, for 4 rollouts: the actor's gathered weights are in new
    storage at every rollout (on one rank, DeepSpeed gathers into the same storage each time: here they are moved, as
    the all-gathers of several ranks move them, and each rollout's kept alive, so that none comes back at an old
    address), the copy that sample_static samples from holds that rollout's weights, and the decode step was recorded
    once for the whole run."""
    seen, sample_static = [], fast_sampling.sample_static

    def recorded(sampler, actor, *inputs):
        for p in actor.parameters():
            p.data = p.data.clone()
        weights = [p.data for p in actor.parameters()]
        responses = sample_static(sampler, actor, *inputs)
        seen.append((weights, sampler["recordings"],
                     all(torch.equal(p, q) for p, q in zip(actor.parameters(), sampler["model"].parameters()))))
        return responses
    monkeypatch.setattr(fast_sampling, "sample_static", recorded)
    for old in glob.glob("runs/test_static_zero3__*"):
        shutil.rmtree(old)
    run_in_process("ppo.py", [*stages, *FEW_ITERATIONS, "--total-episodes", "32", "--actor-zero-stage", "3",
                              "--sampler", "static", "--output-dir", str(tmp_path / "out"), "--exp-name",
                              "test_static_zero3"], must_stop=False)
    assert len({weights[0].data_ptr() for weights, _, _ in seen}) == len(seen) == 4, "the premise: new storage"
    assert [(recordings, same) for _, recordings, same in seen] == [(1, True)] * 4
    assert len(read_metrics("test_static_zero3")) == 4
