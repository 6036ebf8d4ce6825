"""The math of PPO-RLHF, as small pure torch functions.

Everything here is a formula from one of the seed papers, named as the paper names it:
  - PPO: Schulman et al. (2017), "Proximal Policy Optimization Algorithms" (clipped objective, GAE).
  - Ziegler et al. (2019), "Fine-Tuning Language Models from Human Preferences" (KL penalty, adaptive KL).
  - InstructGPT: Ouyang et al. (2022) (pairwise reward-model loss, per-token KL reward).
  - Huang et al. (2024), "The N+ Implementation Details of RLHF with PPO" (masking, whitening, EOS handling).
No model, tokenizer, DeepSpeed or I/O code lives here. Any function can be copied into another project: it needs
`import torch` and, where its docstring says "Pasted alone it needs", what that sentence names (the helpers it calls:
first_true_index, kl_per_token, masked_mean, masked_var). test_docs.py pastes each so into a fresh process.

Conventions (shared by sft.py, reward_model.py and ppo.py)
------------------------------------------------------------
One sequence is a prompt followed by a response that the policy sampled, then padding:

    full sequence    p0   p1   p2 | a0   a1   a2=EOS  pad  pad
    position          0    1    2 |  3    4    5       6    7
    response index t              |  0    1    2       3    4
    response_mask                 |  1    1    1       0    0
    score lands at                |            ^ t = 2, the last in-mask position

- All per-token tensors are over the response only, shape [B, R], and index t is the t-th generated token a_t.
  Its log-prob log pi(a_t | s_t) comes from the logits one position EARLIER in the full sequence (the logits at
  position P - 1 + t predict the token at position P + t, where P is the prompt length), and its value V(s_t) comes
  from the critic's output at that same earlier position: the state before the action.
- Each function takes one mask over the response, `response_mask` [B, R] (ppo.py passes its update_mask: the
  response_mask of the valid responses). The stop token (EOS) is a real action, so it is inside the mask; everything
  after it is outside. The mask is 1 on a prefix of each row. No sentinel values, no second, shifted mask.
- The reward model's score lands on the last in-mask position: the EOS when the policy generated one, the last
  token when the response was cut at the length limit. That is the action that ended the episode. DeepSpeed-Chat
  uses pad == EOS, so its attention mask hides the real EOS and the score lands on a position that the loss masks
  out; TRL puts it one position past the EOS. Both then need a second, shifted mask; we need none.
- Masked positions never influence any result: whatever they hold (padding, garbage, NaN), outputs are the same.
- Defaults follow the seeds: kl_coef 0.1, clip_score 5, cliprange 0.2, cliprange_value 0.2, gamma 1.0, lam 0.95.
"""

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------------------------
# Log-probabilities and entropy of the policy
# ---------------------------------------------------------------------------------------------------------------
def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(token) at each position: log_softmax(logits / temperature) gathered at `tokens`.

    logits [B, T, V], tokens [B, T] -> [B, T], always float32 (bf16/fp16 log-softmax loses the small differences
    that the PPO ratio exp(logp - old_logp) is made of). Use the same temperature as the sampling did, so that
    these are the log-probs of the distribution the tokens were actually drawn from.
    log pi(a) = z_a - log sum_v exp(z_v), with z = logits / temperature.
    """
    # One sequence at a time: the float32 z of a whole batch is [B, T, V], 5 GB at a 152k vocabulary and 64 x 128
    # tokens; one sequence's is 78 MB. Under autograd each sequence's z is kept for the backward pass (logsumexp's
    # gradient reads it), one float32 copy of the batch in all; what shrinks there is the transient copies.
    logprobs = []
    for sequence_logits, sequence_tokens in zip(logits.split(1), tokens.split(1)):  # [1, T, V], [1, T]
        z = sequence_logits.float() / temperature
        logprobs.append(z.gather(-1, sequence_tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1))
    return torch.cat(logprobs)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the softmax at each position, H = logsumexp(z) - sum_v softmax(z)_v z_v, z = logits / temperature.

    logits [B, T, V] -> [B, T], float32; one sequence at a time, as logprobs_from_logits.
    """
    entropies = []
    for sequence_logits in logits.split(1):  # [1, T, V]
        z = sequence_logits.float() / temperature
        entropies.append(torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1))
    return torch.cat(entropies)


# ---------------------------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1, over all positions (dim=None) or along `dim`.

    x and mask have the same shape, e.g. [B, R]. A row with no position in the mask has mean 0, not NaN.
    """
    mask = mask.bool()
    total = torch.where(mask, x, 0.0).sum(dim=dim)
    count = mask.sum(dim=dim).clamp(min=1)
    return total / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over the positions where mask is 1 (a scalar), with Bessel's correction n / (n - 1) by default.

    Where the unbiased variance is undefined (fewer than two positions in the mask) it is 1, the rule of
    mean_var_from_moments. Pasted alone it needs `import torch` and masked_mean.
    """
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.bool().sum()
        if n < 2:
            return torch.ones_like(variance)
        variance = variance * n / (n - 1)
    return variance


def mean_var_from_moments(
    n: torch.Tensor, total: torch.Tensor, total_squares: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of numbers given by their count n, sum and sum of squares (float64 scalars, which
    can be added up over ranks first): mean = total / n, var = (total_squares - n mean^2) / (n - 1), clamped at 0
    against rounding; both float32.

    The one rule for fewer than two numbers (n < 2), where the unbiased variance is undefined: (0, 1), with which
    masked_whiten changes nothing. masked_var and masked_whiten's own statistics follow it too.
    """
    if n < 2:
        return torch.zeros((), device=n.device), torch.ones((), device=n.device)
    mean = total / n
    return mean.float(), ((total_squares - n * mean**2).clamp(min=0) / (n - 1)).float()


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Whitening over the masked positions: (x - mean) / sqrt(var + eps); masked-out positions become 0.

    With shift_mean=False the mean is added back, so only the scale changes (used for rewards, whose sign matters).
    mean and var are the masked mean and unbiased variance of x, (0, 1), which whitens nothing, with fewer than two
    positions in the mask (mean_var_from_moments' rule), or `stats` = (mean, var) when given (those of a larger
    batch that x is part of, e.g. all ranks' together). x, mask [B, R] -> [B, R]. Pasted alone it needs `import
    torch`, masked_mean and masked_var.
    """
    if stats is None:
        enough = mask.bool().sum() >= 2
        stats = (masked_mean(x, mask), masked_var(x, mask)) if enough else (x.new_zeros(()), x.new_ones(()))
    mean, var = stats
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Where a response stops
# ---------------------------------------------------------------------------------------------------------------
def first_true_index(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row; the row length T where a row has none. [B, T] -> [B] (int64)."""
    T = bools.shape[-1]
    positions = torch.arange(T, device=bools.device)
    return torch.where(bools, positions, T).min(dim=-1).values


def response_mask_from_stop(responses: torch.Tensor, stop_token_id: int) -> torch.Tensor:
    """The response mask: 1 up to AND including the first stop token, 0 after it; all 1 where no stop token.

    responses [B, R] (token ids) -> [B, R] int64, like a Hugging Face attention mask. The stop token is the action
    that ends the episode, so it is kept: its log-prob is trained and the score lands on it. Pasted alone it needs
    `import torch` and first_true_index.
    """
    stop_index = first_true_index(responses == stop_token_id)  # R where the response never stopped
    positions = torch.arange(responses.shape[-1], device=responses.device)
    return (positions.unsqueeze(0) <= stop_index.unsqueeze(1)).long()


# ---------------------------------------------------------------------------------------------------------------
# Rewards: KL penalty and the reward model's score (Ziegler et al. 2019; InstructGPT eq. 2)
# ---------------------------------------------------------------------------------------------------------------
def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman, "Approximating KL", 2020).

    With log r = log pi(a) - log pi_ref(a):
      k1 = log r                              (unbiased, can be negative per token; the classic RLHF penalty)
      k2 = 0.5 (log r)^2                      (biased, always >= 0)
      k3 = (exp(-log r) - 1) + log r          (unbiased, always >= 0, lower variance; TRL's "k3")
    logprobs, ref_logprobs [B, R] -> [B, R].
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return (torch.exp(-log_ratio) - 1) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}: use 'k1', 'k2' or 'k3'")


def per_token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    clip_score: float = 5.0,
    kl_estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward of each action: r_t = -beta * KL_t, plus clip(score, -c, c) on the last action of the response.

    InstructGPT's objective r_theta(x, y) - beta log(pi(y|x) / pi_ref(y|x)), spread over the tokens: the KL penalty
    is paid at every response token, the reward model's score once, at the last in-mask position (see the module
    docstring for why there). beta = kl_coef, c = clip_score (DeepSpeed-Chat's clip_reward_value). One response that
    stopped at t = 2, the score s of the whole prompt + response landing on its EOS:

        response index t     0           1           2 = EOS                 3 (pad)
        response_mask        1           1           1                       0
        kl (k1)              lp0 - ref0  lp1 - ref1  lp2 - ref2              0
        rewards              -beta kl0   -beta kl1   -beta kl2 + clip(s)     0

    scores [B]; logprobs, ref_logprobs, response_mask [B, R] -> (rewards [B, R], kl [B, R]); both exactly 0 where
    the mask is 0. A row whose mask is all 0 gets no score and all-zero rewards. Pasted alone it needs `import torch`
    and kl_per_token.
    """
    mask = response_mask.bool()
    kl = torch.where(mask, kl_per_token(logprobs, ref_logprobs, kl_estimator), 0.0)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last_position = torch.where(mask, positions, -1).max(dim=-1).values  # -1 where the mask is empty
    is_last = positions.unsqueeze(0) == last_position.unsqueeze(1)
    clipped_scores = scores.float().clamp(-clip_score, clip_score)
    rewards = -kl_coef * kl + torch.where(is_last, clipped_scores.unsqueeze(1), 0.0)
    return rewards, kl


def adaptive_kl_coef(kl_coef: float, observed_kl: float, target_kl: float, horizon: float, n_steps: int) -> float:
    """Ziegler et al. (2019) proportional controller for beta, updated once per batch of n_steps episodes:

        e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),    beta_{t+1} = beta_t (1 + K_beta e_t),   K_beta = n_steps / horizon
    """
    proportional_error = min(max(observed_kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + proportional_error * n_steps / horizon)


# ---------------------------------------------------------------------------------------------------------------
# Generalized Advantage Estimation (Schulman et al. 2016; PPO eq. 11-12)
# ---------------------------------------------------------------------------------------------------------------
def gae_advantages_and_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages A_t and returns R_t = A_t + V(s_t), computed backwards over the response:

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t),     A_t = delta_t + gamma lam A_{t+1}

    The episode ends at the last in-mask position, so V after it is taken as 0 (a terminal state) whatever
    `values` holds there. rewards, values, response_mask [B, R] (mask 1 on a prefix of each row)
    -> (advantages [B, R], returns [B, R]), both 0 where the mask is 0. Call it under torch.no_grad().
    """
    mask = response_mask.bool()
    rewards = torch.where(mask, rewards, 0.0)
    values = torch.where(mask, values, 0.0)  # V = 0 from the terminal state on
    R = rewards.shape[-1]
    next_value = torch.zeros_like(values[:, 0])  # V(s_R) = 0: no state after the last generated token
    next_advantage = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(R)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages_reversed.append(next_advantage)
        next_value = values[:, t]
    advantages = torch.where(mask, torch.stack(advantages_reversed[::-1], dim=1), 0.0)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


# ---------------------------------------------------------------------------------------------------------------
# PPO losses (Schulman et al. 2017, eq. 7 and the clipped value loss of its reference implementation)
# ---------------------------------------------------------------------------------------------------------------
def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate objective, as a loss: the masked token-mean of

        max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps)),    r_t = pi(a_t|s_t) / pi_old(a_t|s_t) = exp(logp - old_logp)

    logprobs (with gradient), old_logprobs, advantages, response_mask [B, R] -> (loss scalar, stats), where stats
    holds, over the masked positions: `clipfrac` (share of tokens where the clipped term was the larger, so their
    gradient is 0), `approxkl` (0.5 mean (logp - old_logp)^2, the k2 estimate of KL(pi_old || pi)) and `ratio`
    (mean r_t; 1 before the first optimizer step of an iteration when logp is computed exactly as old_logp was: ppo.py
    checks it bit for bit in fp32, and not when an update reuses the last valid batch). Pasted alone it needs `import
    torch` and masked_mean.
    """
    mask = response_mask.bool()
    # Padding may hold anything; zero it before it meets exp(), so that not even its gradient can become NaN.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    advantages = torch.where(mask, advantages, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped value loss: the masked token-mean of

        0.5 max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)

    values (with gradient), old_values, returns, response_mask [B, R] -> (loss scalar, clipfrac), clipfrac being the
    share of masked tokens where the clipped term was the larger. Pasted alone it needs `import torch` and
    masked_mean.
    """
    mask = response_mask.bool()
    values = torch.where(mask, values, 0.0)
    old_values = torch.where(mask, old_values, 0.0)
    returns = torch.where(mask, returns, 0.0)
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clipfrac


# ---------------------------------------------------------------------------------------------------------------
# An exponential moving average of the actor's weights (DeepSpeed-Chat's --enable_ema)
# ---------------------------------------------------------------------------------------------------------------
def ema_update(ema: torch.Tensor, new: torch.Tensor, decay: float) -> torch.Tensor:
    """One step of an exponential moving average: ema' = decay * ema + (1 - decay) * new.

    Any shape, ema and new alike. After k steps from ema_0 = w_0 over weights w_1..w_k,
    ema_k = decay^k w_0 + (1 - decay) sum_j decay^(k - j) w_j: the recent weights count most.
    Computed as torch.lerp(ema, new, 1 - decay), the same formula rounded so that a weight that does not change
    stays exactly as it is (decay ema + (1 - decay) ema can be off by a last bit) and decay 0 copies new exactly.
    """
    return torch.lerp(ema, new, 1.0 - decay)


# ---------------------------------------------------------------------------------------------------------------
# The reward model's loss (InstructGPT eq. 1; the Bradley-Terry model of pairwise preferences)
# ---------------------------------------------------------------------------------------------------------------
def pairwise_reward_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """loss = mean of -log sigmoid(r(x, y_c) - r(x, y_r) - m), accuracy = share of pairs with r(x, y_c) > r(x, y_r).

    chosen_scores, rejected_scores [B]; margin m: None (0), a float, or [B] (Llama 2's margin loss)
    -> (loss scalar, accuracy scalar). Pasted alone it needs `import torch` and `import torch.nn.functional as F`.
    """
    difference = chosen_scores.float() - rejected_scores.float()
    if margin is not None:
        difference = difference - margin
    loss = -F.logsigmoid(difference).mean()
    accuracy = (chosen_scores > rejected_scores).float().mean()
    return loss, accuracy
