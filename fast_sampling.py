"""ppo.py --sampler static: `ppo.sample` with every shape fixed, for a GPU. Imported only when that flag is given.

`ppo.sample` is the definition; `sample_static` draws from the same distribution (test_fast_sampling), with the
prompts left-padded to --max-prompt-len, a static key-value cache of --max-prompt-len + --max-new-tokens positions, and
one decode step compiled once and, on CUDA, replayed from a recorded CUDA graph (a few launches a token instead of
hundreds), the stop check left on the device and read every 16 tokens. It samples from a plain copy of the actor, kept
with the cache for the whole run (static_sampler): on every GPU that is a whole actor and the cache more than
--sampler eager holds (docs/scaling.md). Its logits only pick tokens; every log-prob comes from ppo.py's eager forward.
"""

import math

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, StaticCache

import plumbing


def check_args(args) -> None:
    """What --sampler static cannot do stops ppo.py before anything loads, with one line."""
    if args.actor_lora_dim:
        plumbing.fail("--sampler static samples from a plain copy of the actor, without its LoRA adapters "
                      "(--actor-lora-dim): use --sampler eager")
    if args.actor_zero_stage == 3 and not args.gather_weights_for_rollout:
        plumbing.fail("--sampler static keeps a whole copy of the actor on each device, more than "
                      "--no-gather-weights-for-rollout allows: use --sampler eager")


def sampler(actor, config: GenerationConfig, is_main: bool, args, device):
    """ppo.py's rollout sampler for --sampler static: sample_static called as ppo.sample is, from a static_sampler
    built now, before the first rollout, and kept for the whole run; never synced (check_args)."""
    kept = static_sampler(actor, config, is_main, args, device)
    return lambda model, prompt_ids, prompt_mask, config, synced: sample_static(kept, model, prompt_ids, prompt_mask,
                                                                                 config)


def static_sampler(actor, config: GenerationConfig, is_main: bool, args, device) -> dict:
    """What sample_static keeps from one rollout to the next, so that its recorded step reads the same memory every
    time: a copy of the actor (the weights copied in at each rollout; under ZeRO-3 the gathered ones are in new storage
    every time), a static key-value cache of --max-prompt-len + max_new_tokens positions, and the step. They stay
    through the update: freed, they would come back elsewhere, and the step would be recorded again."""
    if is_main:
        print("compiling the decode step of --sampler static (up to a minute) ...", flush=True)
    model = inference_copy(actor.module, device, args.trust_remote_code)
    cache = StaticCache(config=model.config, max_cache_len=args.max_prompt_len + config.max_new_tokens)
    sampler = {"model": model, "cache": cache, "prompt_len": args.max_prompt_len, "recordings": 0}
    record_decode_step(sampler, args.per_device_rollout_batch_size, config)
    return sampler


def sample_static(sampler: dict, actor, prompt_ids, prompt_mask, config: GenerationConfig) -> torch.Tensor:
    """ppo.sample with every shape fixed: [B, P] -> [B, max_new_tokens], pad after each EOS, from a copy of ACTOR
    (static_sampler's). Read it beside ppo.sample: the same steps, the shapes fixed."""
    model, cache, R = sampler["model"], sampler["cache"], config.max_new_tokens
    copy_weights(actor, model)  # pi_theta of this rollout, into the storage that the step reads
    if step_reads(model, cache) != sampler["reads"]:  # never for a kept copy: a graph would read freed memory
        record_decode_step(sampler, len(prompt_ids), config)
    pad = sampler["prompt_len"] - prompt_ids.shape[1]
    prompt_ids = torch.nn.functional.pad(prompt_ids, (pad, 0), value=config.pad_token_id)
    prompt_mask = torch.nn.functional.pad(prompt_mask, (pad, 0))
    cache.reset()
    # [B, P + R] from the start: the positions not yet written are hidden by causality, not by the mask.
    attention_mask = torch.nn.functional.pad(prompt_mask, (0, R), value=1)
    position_ids = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)  # as ppo.position_ids_from
    tokens, running, responses = prompt_ids, torch.ones(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device), []
    for t in range(R):
        step = sampler["step"] if t else decode_step  # the prompt's pass, in the prompt's shape, runs eager
        _, tokens, running = step(model, cache, tokens, attention_mask, position_ids, running, config)
        # A copy: the next replay overwrites a recorded graph's outputs (running and tokens are read before it).
        responses.append(tokens.clone())
        if t % 16 == 15 and not running.any():  # a host sync every 16 tokens, not every token
            break
        position_ids = position_ids[:, -1:] + 1
    responses = torch.cat(responses, dim=1)
    return torch.nn.functional.pad(responses, (0, R - responses.shape[1]), value=config.pad_token_id)


def decode_step(model, cache, tokens, attention_mask, position_ids, running, config: GenerationConfig):
    """One token of `sample` for every sequence: tokens [B, t] (the prompt, or the last token) in; out the scaled
    logits z [B, V], the next tokens [B, 1] and which sequences have no EOS yet [B]. a_t ~ softmax(z) is drawn as
    argmax_i p_i / q_i with q_i ~ Exp(1) > 0 (the race gives i with probability p_i): torch.multinomial syncs with the
    host."""
    out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=True, logits_to_keep=1)
    z = out.logits[:, -1].float() / config.temperature
    z[:, config.suppress_tokens or []] = -math.inf
    draw = (torch.softmax(z, dim=-1) / torch.empty_like(z).exponential_()).argmax(dim=-1, keepdim=True)
    tokens = torch.where(running.unsqueeze(1), draw, config.pad_token_id)
    return z, tokens, running & (tokens.squeeze(1) != config.eos_token_id)


@torch.no_grad()  # as in the rollout: a change of grad mode would compile the step again
def record_decode_step(sampler: dict, batch_size: int, config: GenerationConfig) -> None:
    """sampler["step"]: decode_step for [batch_size, 1] tokens, compiled, and on CUDA recorded as a CUDA graph, after a
    made-up prompt has laid out the static cache; the addresses it reads kept, its recordings counted."""
    model, cache, P = sampler["model"], sampler["cache"], sampler["prompt_len"]
    vocabulary = model.get_input_embeddings().num_embeddings
    ids = torch.arange(batch_size * P, device=model.device).view(batch_size, P) % vocabulary
    running = torch.ones(batch_size, dtype=torch.bool, device=model.device)
    attention_mask = torch.ones(batch_size, P + config.max_new_tokens, dtype=torch.long, device=model.device)
    prompt = (model, cache, ids, attention_mask, torch.arange(P, device=model.device).expand(batch_size, P), running,
              config)
    decode_step(*prompt)  # lays out the cache's tensors
    step = torch.compile(decode_step, fullgraph=True, dynamic=False)
    position_ids = torch.full((batch_size, 1), P, device=model.device)
    inputs = (model, cache, ids[:, -1:].contiguous(), attention_mask, position_ids, running, config)
    try:
        step(*inputs)  # compiled here, not in the first rollout
        sampler["step"] = cuda_graph(step, inputs) if model.device.type == "cuda" else step
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


def inference_copy(model, device: torch.device, trust_remote_code: bool):
    """A plain copy of a model's architecture, for inference: in its dtype, on `device`, no gradients, no DeepSpeed
    hooks; its weights come from copy_weights. Built from the config (a ZeRO-3 model's own weights are shards)."""
    with torch.device(device):
        copy = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype,
                                                trust_remote_code=trust_remote_code)
    return copy.eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(source, target) -> None:
    """target's weights set to source's, in place: each stays in its storage (a recorded CUDA graph reads it there)."""
    sources, targets = dict(source.named_parameters()), dict(target.named_parameters())
    if sources.keys() != targets.keys():
        plumbing.fail(f"{type(source).__name__}'s weights are not those of a plain copy of it (LoRA adapters?)")
    torch._foreach_copy_([targets[name] for name in sources], list(sources.values()))


def cuda_graph(function, args: tuple):
    """function(*args) recorded once as a CUDA graph, after three runs on a side stream (which compile it), and a
    replay(*new_args) that copies each tensor of new_args into the recorded one, replays the graph (one launch for
    all its kernels) and returns the recorded outputs, overwritten by the next replay. Every other tensor the graph
    reads, weights or a cache, must stay in its storage: the graph reads those addresses."""
    recorded = [arg.clone() if torch.is_tensor(arg) else arg for arg in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            function(*recorded)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = function(*recorded)

    def replay(*new_args):
        for arg, new in zip(recorded, new_args):
            if torch.is_tensor(arg):
                arg.copy_(new)
        graph.replay()
        return outputs
    return replay
