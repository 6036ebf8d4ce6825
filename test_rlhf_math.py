"""Every function of rlhf_math.py checked against numbers worked out by hand.

Each test writes its arithmetic in comments so that a reader can redo it on paper. Tensors are small: 2 rows (a
third where an edge case needs it), 3 to 5 positions. Run with `pytest test_rlhf_math.py`.
"""

import math

import pytest
import torch
from torch.testing import assert_close

import rlhf_math as M


def t(*rows):
    """A float32 tensor from nested lists (short, so that the numbers stay readable)."""
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


def log_probs_as_logits(probabilities):
    """Logits whose softmax is `probabilities` (normalized here): z = log p, so softmax(z) = p."""
    p = torch.tensor(probabilities, dtype=torch.float64)
    return (p / p.sum(-1, keepdim=True)).log().float()


# ---------------------------------------------------------------------------------------------------------------
# logprobs_from_logits, entropy_from_logits
# ---------------------------------------------------------------------------------------------------------------
def test_logprobs_from_logits_by_hand():
    # Row 0: softmax [1,2,1]/4 = [.25,.5,.25], token 1 -> log .5
    #        softmax [1,1,2]/4,               token 0 -> log .25
    #        softmax [1,1,1]/3,               token 2 -> log 1/3
    # Row 1: softmax [2,1,1]/4 shifted by +5 (a constant shift changes nothing), token 0 -> log .5
    #        softmax [1,3,4]/8,               token 1 -> log 3/8
    #        softmax [6,1,1]/8,               token 1 -> log 1/8
    logits = torch.stack(
        [
            log_probs_as_logits([[1, 2, 1], [1, 1, 2], [1, 1, 1]]),
            log_probs_as_logits([[2, 1, 1], [1, 3, 4], [6, 1, 1]]) + torch.tensor([[5.0], [0.0], [0.0]]),
        ]
    )
    tokens = torch.tensor([[1, 0, 2], [0, 1, 1]])
    expected = torch.tensor([[0.5, 0.25, 1 / 3], [0.5, 3 / 8, 1 / 8]]).log()
    assert_close(M.logprobs_from_logits(logits, tokens), expected)


def test_logprobs_from_logits_divides_by_temperature():
    # Logits 2 log p at temperature 2 are log p again: p = [1,2,1]/4, token 1 -> log .5; p = [1,3,4]/8, token 1 -> log 3/8
    logits = 2 * torch.stack([log_probs_as_logits([[1, 2, 1]]), log_probs_as_logits([[1, 3, 4]])])
    tokens = torch.tensor([[1], [1]])
    assert_close(M.logprobs_from_logits(logits, tokens, temperature=2.0), t([[0.5], [3 / 8]]).log())
    # At temperature 1 the same logits are sharper: softmax(2 log [1,2,1]) = [1,4,1]/6 -> token 1 has log 4/6,
    # softmax(2 log [1,3,4]) = [1,9,16]/26 -> log 9/26.
    assert_close(M.logprobs_from_logits(logits, tokens), t([[4 / 6], [9 / 26]]).log())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_logprobs_from_logits_is_float32_close_to_float64(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 50) * 3).to(dtype)
    tokens = torch.randint(0, 50, (2, 5))
    out = M.logprobs_from_logits(logits, tokens, temperature=0.7)
    # The float64 reference of the very same (rounded) logits: log_softmax in float64, gathered.
    reference = torch.log_softmax(logits.double() / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32
    assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


def whole_batch_logprobs(logits, tokens, temperature):
    """The formula of logprobs_from_logits on the whole [B, T, V] batch at once, with its float32 copy of it all."""
    z = logits.float() / temperature
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_one_sequence_at_a_time_gives_the_same_bits(temperature):
    # 3 sequences of 4 positions, 50 tokens: three chunks of one sequence each, two boundaries crossed.
    # Bit for bit the whole batch's numbers, its gradient too (the PPO loss backpropagates through it); read
    # from logits[:, :-1], a view that is not contiguous, as ppo.response_logits returns them.
    torch.manual_seed(0)
    full = torch.randn(3, 5, 50) * 3
    tokens = torch.randint(0, 50, (3, 4))
    upstream = torch.randn(3, 4)  # d loss / d logprob, a different weight for each position
    leaf, whole_batch_leaf = full.clone().requires_grad_(), full.clone().requires_grad_()
    logprobs = M.logprobs_from_logits(leaf[:, :-1], tokens, temperature)
    whole_batch = whole_batch_logprobs(whole_batch_leaf[:, :-1], tokens, temperature)
    assert torch.equal(logprobs, whole_batch)
    (logprobs * upstream).sum().backward()
    (whole_batch * upstream).sum().backward()
    assert torch.equal(leaf.grad, whole_batch_leaf.grad)
    # The same as the textbook log_softmax, which rounds (z - max) - log sum instead of z - (log sum + max).
    reference = torch.log_softmax(full[:, :-1] / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert_close(logprobs.detach(), reference)
    # bf16 logits: each sequence upcast on its own gives the bits of the whole batch upcast at once.
    bf16 = full[:, :-1].bfloat16()
    logprobs = M.logprobs_from_logits(bf16, tokens, temperature)
    assert torch.equal(logprobs, whole_batch_logprobs(bf16, tokens, temperature))


def test_entropy_from_logits_one_sequence_at_a_time_gives_the_same_bits():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 50) * 3
    z = logits / 0.7
    whole_batch = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    assert torch.equal(M.entropy_from_logits(logits, 0.7), whole_batch)


def test_entropy_from_logits_by_hand():
    # Uniform over 3 tokens: H = log 3.
    # [1,2,1]/4: H = -(.25 log .25 + .5 log .5 + .25 log .25) = .5 log 4 + .5 log 2 = 1.5 log 2.
    # [1,1,2]/4: the same numbers in another order, 1.5 log 2.
    # [6,1,1]/8: H = -(.75 log .75 + 2 x .125 log .125) = .75 log(4/3) + .25 log 8.
    logits = torch.stack(
        [
            log_probs_as_logits([[1, 1, 1], [1, 2, 1]]),
            log_probs_as_logits([[1, 1, 2], [6, 1, 1]]),
        ]
    )
    expected = t([math.log(3), 1.5 * math.log(2)], [1.5 * math.log(2), 0.75 * math.log(4 / 3) + 0.25 * math.log(8)])
    assert_close(M.entropy_from_logits(logits), expected)
    # Temperature 2 on logits 2 log p gives back the entropy of p.
    assert_close(M.entropy_from_logits(2 * logits, temperature=2.0), expected)


# ---------------------------------------------------------------------------------------------------------------
# masked_mean, masked_var, masked_whiten
# ---------------------------------------------------------------------------------------------------------------
X = t([1, 2, 3, 4], [5, 6, 7, 8])
MASK = t([1, 1, 0, 0], [1, 1, 1, 0])


def test_masked_mean_by_hand():
    # In the mask: 1, 2 | 5, 6, 7 -> (1 + 2 + 5 + 6 + 7) / 5 = 21 / 5 = 4.2
    assert_close(M.masked_mean(X, MASK), torch.tensor(4.2))
    # Per row: (1 + 2) / 2 = 1.5 and (5 + 6 + 7) / 3 = 6
    assert_close(M.masked_mean(X, MASK, dim=1), t([1.5, 6.0]))
    # A row with an empty mask has mean 0, not 0 / 0 = NaN.
    assert_close(M.masked_mean(X, t([1, 1, 0, 0], [0, 0, 0, 0]), dim=1), t([1.5, 0.0]))


def test_masked_var_by_hand():
    # Mean 4.2; deviations -3.2, -2.2, .8, 1.8, 2.8; squares 10.24 + 4.84 + .64 + 3.24 + 7.84 = 26.8
    # biased: 26.8 / 5 = 5.36; unbiased (Bessel): 26.8 / (5 - 1) = 6.7
    assert_close(M.masked_var(X, MASK), torch.tensor(6.7))
    assert_close(M.masked_var(X, MASK, unbiased=False), torch.tensor(5.36))
    # Fewer than two positions: the unbiased variance, 0 / (1 - 1) for one position and 0 / (0 - 1) for none, has no
    # meaning, so it is 1 (mean_var_from_moments' rule).
    assert M.masked_var(X, t([1, 0, 0, 0], [0, 0, 0, 0])).item() == 1.0
    assert M.masked_var(X, t([0, 0, 0, 0], [0, 0, 0, 0])).item() == 1.0


def moments(x, mask):
    """(n, sum, sum of squares) of x over the mask, in float64, as ppo.batch_mean_var adds them over the ranks."""
    x = torch.where(mask.bool(), x.double(), 0.0)
    return torch.stack([mask.sum().double(), x.sum(), (x**2).sum()])


def test_mean_var_from_moments_by_hand():
    # X in MASK: 1, 2 | 5, 6, 7 -> n = 5, sum = 21, sum of squares 1 + 4 + 25 + 36 + 49 = 115.
    assert moments(X, MASK).tolist() == [5.0, 21.0, 115.0]
    # mean = 21 / 5 = 4.2; var = (115 - 5 x 4.2^2) / (5 - 1) = (115 - 88.2) / 4 = 26.8 / 4 = 6.7, masked_var's 6.7.
    mean, var = M.mean_var_from_moments(*moments(X, MASK))
    assert mean.dtype == var.dtype == torch.float32
    assert_close(mean, torch.tensor(4.2))
    assert_close(var, torch.tensor(6.7))
    assert_close(var, M.masked_var(X, MASK))
    # Ranks add their moments: [5, 21, 115] + [2, 2, 2] (numbers 1 and 1) = [7, 23, 117]:
    # mean 23 / 7, var (117 - 23^2 / 7) / 6 = (819 - 529) / 42 = 290 / 42 = 145 / 21
    mean, var = M.mean_var_from_moments(*(moments(X, MASK) + moments(t([1.0, 1.0]), t([1, 1]))))
    assert_close(mean, torch.tensor(23 / 7))
    assert_close(var, torch.tensor(145 / 21))


def test_mean_var_from_moments_rounding_and_fewer_than_two():
    # Three numbers 0.1: variance 0, but in float64 the sum is 0.30000000000000004, the mean 0.10000000000000002, and
    # 0.030000000000000006 - 3 x 0.10000000000000002^2 = -6.9e-18: below 0, so clamped to 0.
    three = torch.full((3,), 0.1, dtype=torch.float64)
    _, var = M.mean_var_from_moments(*moments(three, torch.ones(3)))
    assert var.item() == 0.0
    # One number 3 (n = 1, sum 3, sum of squares 9) or none: (0, 1), which whitens nothing.
    for n, total, total_squares in [(1.0, 3.0, 9.0), (0.0, 0.0, 0.0)]:
        mean, var = M.mean_var_from_moments(*torch.tensor([n, total, total_squares], dtype=torch.float64))
        assert (mean.item(), var.item()) == (0.0, 1.0)
        assert mean.dtype == var.dtype == torch.float32


def test_masked_whiten_by_hand():
    # In the mask: 1, 3 | 5. Mean 3, unbiased variance (4 + 0 + 4) / 2 = 4, standard deviation 2:
    # whitened (1 - 3)/2 = -1, (3 - 3)/2 = 0, (5 - 3)/2 = 1; masked positions are 0.
    x = t([1, 3, 100], [5, -7, 9])
    mask = t([1, 1, 0], [1, 0, 0])
    assert_close(M.masked_whiten(x, mask, eps=0.0), t([-1, 0, 0], [1, 0, 0]))
    # shift_mean=False adds the mean 3 back: -1 + 3 = 2, 0 + 3 = 3, 1 + 3 = 4.
    assert_close(M.masked_whiten(x, mask, shift_mean=False, eps=0.0), t([2, 3, 0], [4, 0, 0]))
    # With the statistics of a larger batch (mean 1, variance 16, standard deviation 4) in place of its own:
    # (1 - 1)/4 = 0, (3 - 1)/4 = .5, (5 - 1)/4 = 1; without the shift, + 1: 1, 1.5, 2.
    stats = (torch.tensor(1.0), torch.tensor(16.0))
    assert_close(M.masked_whiten(x, mask, eps=0.0, stats=stats), t([0, 0.5, 0], [1, 0, 0]))
    assert_close(M.masked_whiten(x, mask, shift_mean=False, eps=0.0, stats=stats), t([1, 1.5, 0], [2, 0, 0]))


def test_masked_whiten_with_fewer_than_two_positions_whitens_nothing():
    # Its own statistics are then (0, 1), the rule of mean_var_from_moments: (3 - 0) / sqrt(1 + 0) = 3, and +0 for
    # shift_mean=False; masked positions 0 as always. No position at all: all 0.
    x = t([1, 3, 100], [5, -7, 9])
    one = t([0, 1, 0], [0, 0, 0])
    none = t([0, 0, 0], [0, 0, 0])
    for shift_mean in [True, False]:
        assert torch.equal(M.masked_whiten(x, one, shift_mean, eps=0.0), t([0, 3, 0], [0, 0, 0]))
        assert torch.equal(M.masked_whiten(x, none, shift_mean, eps=0.0), t([0, 0, 0], [0, 0, 0]))
        # The same as with the statistics that ppo.py computes from the moments, at the default eps too.
        for mask in [one, none]:
            stats = M.mean_var_from_moments(*moments(x, mask))
            assert torch.equal(M.masked_whiten(x, mask, shift_mean), M.masked_whiten(x, mask, shift_mean, stats=stats))


def test_masked_whiten_gives_mean_0_variance_1_or_keeps_the_mean():
    torch.manual_seed(0)
    x = torch.randn(2, 5) * 3 + 7
    mask = t([1, 1, 1, 0, 0], [1, 1, 1, 1, 0])
    whitened = M.masked_whiten(x, mask)
    assert_close(M.masked_mean(whitened, mask), torch.tensor(0.0), atol=1e-6, rtol=0)
    assert_close(M.masked_var(whitened, mask), torch.tensor(1.0))
    kept = M.masked_whiten(x, mask, shift_mean=False)
    assert_close(M.masked_mean(kept, mask), M.masked_mean(x, mask))
    assert_close(M.masked_var(kept, mask), torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------------------------
# first_true_index, response_mask_from_stop
# ---------------------------------------------------------------------------------------------------------------
def test_first_true_index():
    bools = torch.tensor([[False, True, False, True], [False, False, False, False], [True, False, False, False]])
    # First True at 1; none -> the row length 4; first True at 0.
    assert M.first_true_index(bools).tolist() == [1, 4, 0]


def test_response_mask_from_stop():
    EOS = 2
    responses = torch.tensor(
        [
            [2, 5, 6, 7],  # stop token first: only the stop token is an action
            [5, 6, 7, 2],  # stop token last
            [5, 6, 7, 8],  # no stop token: cut at the length limit, all 4 tokens are actions
            [5, 2, 6, 2],  # two stop tokens: the first one ends the response
        ]
    )
    mask = M.response_mask_from_stop(responses, EOS)
    assert mask.dtype == torch.int64
    assert mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]


# ---------------------------------------------------------------------------------------------------------------
# kl_per_token, per_token_rewards, adaptive_kl_coef
# ---------------------------------------------------------------------------------------------------------------
def test_kl_per_token_by_hand():
    # Row 0: log r = log .5 - log .25 = log 2, then 0;   Row 1: log r = log .25 - log .5 = -log 2, then 0.
    logprobs = t([0.5, 0.5], [0.25, 0.5]).log()
    ref = t([0.25, 0.5], [0.5, 0.5]).log()
    log2 = math.log(2)
    # k1 = log r
    assert_close(M.kl_per_token(logprobs, ref, "k1"), t([log2, 0.0], [-log2, 0.0]))
    # k2 = .5 (log r)^2
    assert_close(M.kl_per_token(logprobs, ref, "k2"), t([0.5 * log2**2, 0.0], [0.5 * log2**2, 0.0]))
    # k3 = (exp(-log r) - 1) + log r:  log r = log 2 -> (.5 - 1) + log 2 = log 2 - .5 = 0.1931
    #                                  log r = -log 2 -> (2 - 1) - log 2 = 1 - log 2 = 0.3069;  log r = 0 -> 0
    assert_close(M.kl_per_token(logprobs, ref, "k3"), t([log2 - 0.5, 0.0], [1 - log2, 0.0]))
    with pytest.raises(ValueError, match="k1"):
        M.kl_per_token(logprobs, ref, "k4")


def test_per_token_rewards_by_hand():
    # log pi - log pi_ref per token; row 0 stopped with EOS at t = 2, row 1 was cut at the length limit.
    ref = t([-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0])
    logprobs = ref + t([0.1, -0.2, 0.3, 0.9], [0.2, 0.0, -0.1, 0.4])
    mask = t([1, 1, 1, 0], [1, 1, 1, 1])
    scores = t([2.0, 7.0])
    rewards, kl = M.per_token_rewards(scores, logprobs, ref, mask, kl_coef=0.1, clip_score=5.0)
    # kl (k1) = the differences, 0 after the mask:  [.1, -.2, .3, 0] and [.2, 0, -.1, .4]
    assert_close(kl, t([0.1, -0.2, 0.3, 0.0], [0.2, 0.0, -0.1, 0.4]))
    # -0.1 x kl, plus the score at the last in-mask position:
    # row 0: [-.01, .02, -.03 + 2 = 1.97, 0]          (the score lands on the EOS, t = 2; after it exactly 0)
    # row 1: [-.02, 0, .01, -.04 + clip(7, -5, 5) = 4.96]   (no EOS: the score lands on the last token)
    assert_close(rewards, t([-0.01, 0.02, 1.97, 0.0], [-0.02, 0.0, 0.01, 4.96]))
    assert rewards[0, 3].item() == 0.0


def test_per_token_rewards_clips_negative_scores_and_uses_the_estimator():
    # Equal log-probs: every KL estimator gives 0, so the rewards are the clipped score alone.
    logprobs = torch.full((2, 3), -2.0)
    mask = t([1, 0, 0], [1, 1, 0])
    rewards, _ = M.per_token_rewards(t([-9.0, 0.5]), logprobs, logprobs, mask, kl_coef=0.1, kl_estimator="k3")
    # row 0: stop token first, score clip(-9) = -5 at t = 0;  row 1: score .5 at t = 1
    assert_close(rewards, t([-5.0, 0.0, 0.0], [0.0, 0.5, 0.0]))
    # k3 with log r = log 2 at one token: penalty -.1 x (log 2 - .5) = -0.01931
    logprobs2 = logprobs.clone()
    logprobs2[1, 0] += math.log(2)
    rewards, kl = M.per_token_rewards(t([0.0, 0.0]), logprobs2, logprobs, mask, kl_coef=0.1, kl_estimator="k3")
    assert_close(kl, t([0.0, 0.0, 0.0], [math.log(2) - 0.5, 0.0, 0.0]))
    assert_close(rewards, -0.1 * kl)


def test_adaptive_kl_coef_by_hand():
    # e = clip(KL / target - 1, -.2, .2); beta' = beta (1 + e n / horizon), n / horizon = 100 / 10000 = .01
    # KL 6, target 5: e = .2 -> .1 x 1.002 = .1002
    assert M.adaptive_kl_coef(0.1, 6.0, 5.0, 10000, 100) == pytest.approx(0.1002)
    # KL 20: e = 3, clipped to .2 -> the same .1002
    assert M.adaptive_kl_coef(0.1, 20.0, 5.0, 10000, 100) == pytest.approx(0.1002)
    # KL 4.5: e = -.1 -> .1 x .999 = .0999;  KL 0: e = -1, clipped to -.2 -> .1 x .998 = .0998
    assert M.adaptive_kl_coef(0.1, 4.5, 5.0, 10000, 100) == pytest.approx(0.0999)
    assert M.adaptive_kl_coef(0.1, 0.0, 5.0, 10000, 100) == pytest.approx(0.0998)
    # On target: unchanged.
    assert M.adaptive_kl_coef(0.1, 5.0, 5.0, 10000, 100) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------------------------
# ema_update
# ---------------------------------------------------------------------------------------------------------------
def test_ema_update_by_hand():
    # ema' = d ema + (1 - d) new, d = .9:  .9 x 1 + .1 x 3 = 1.2;  .9 x -2 + .1 x 0 = -1.8
    assert torch.allclose(M.ema_update(t([1.0, -2.0]), t([3.0, 0.0]), 0.9), t([1.2, -1.8]))
    # Two steps from w0 = 1 over w1 = 3, w2 = 5:  1.2, then .9 x 1.2 + .1 x 5 = 1.58;
    # closed form d^2 w0 + (1 - d)(d w1 + w2) = .81 + .1 x (2.7 + 5) = .81 + .77 = 1.58
    ema = M.ema_update(M.ema_update(t([1.0]), t([3.0]), 0.9), t([5.0]), 0.9)
    assert torch.allclose(ema, t([1.58]))
    # decay 0: the EMA is the new weights (how ppo.py starts it as a copy of the actor); decay 1: never moves
    assert torch.equal(M.ema_update(t([1.0]), t([3.0]), 0.0), t([3.0]))
    assert torch.equal(M.ema_update(t([1.0]), t([3.0]), 1.0), t([1.0]))


# ---------------------------------------------------------------------------------------------------------------
# gae_advantages_and_returns
# ---------------------------------------------------------------------------------------------------------------
REWARDS = t([0.0, 0.0, 1.0], [0.1, 2.0, 9.0])  # row 1: 9.0 is past the mask, garbage
VALUES = t([0.5, 0.2, 0.4], [1.0, 0.5, 7.0])  # row 1: 7.0 is past the mask, garbage
GAE_MASK = t([1, 1, 1], [1, 1, 0])


def test_gae_by_hand():
    advantages, returns = M.gae_advantages_and_returns(REWARDS, VALUES, GAE_MASK, gamma=1.0, lam=0.5)
    # Row 0, backwards; V after the last token is 0:
    #   t=2: delta = 1 + 1 x 0 - .4 = .6          A = .6
    #   t=1: delta = 0 + .4 - .2 = .2             A = .2 + .5 x .6 = .5
    #   t=0: delta = 0 + .2 - .5 = -.3            A = -.3 + .5 x .5 = -.05
    #   returns = A + V = [-.05 + .5, .5 + .2, .6 + .4] = [.45, .7, 1.0]
    # Row 1: the episode ends at t=1, so V(s_2) = 0 although values holds 7.0 there:
    #   t=1: delta = 2 + 0 - .5 = 1.5             A = 1.5
    #   t=0: delta = .1 + .5 - 1 = -.4            A = -.4 + .5 x 1.5 = .35
    #   returns = [.35 + 1, 1.5 + .5, 0] = [1.35, 2.0, 0]
    assert_close(advantages, t([-0.05, 0.5, 0.6], [0.35, 1.5, 0.0]))
    assert_close(returns, t([0.45, 0.7, 1.0], [1.35, 2.0, 0.0]))


def test_gae_with_discount_by_hand():
    advantages, returns = M.gae_advantages_and_returns(REWARDS[:1], VALUES[:1], GAE_MASK[:1], gamma=0.5, lam=1.0)
    #   t=2: delta = 1 + .5 x 0 - .4 = .6              A = .6
    #   t=1: delta = 0 + .5 x .4 - .2 = 0              A = 0 + .5 x 1 x .6 = .3
    #   t=0: delta = 0 + .5 x .2 - .5 = -.4            A = -.4 + .5 x .3 = -.25
    # With lam = 1 the returns are the discounted rewards-to-go: [.25 x 1, .5 x 1, 1] = [.25, .5, 1]
    assert_close(advantages, t([[-0.25, 0.3, 0.6]]))
    assert_close(returns, t([[0.25, 0.5, 1.0]]))


def test_gae_lam_1_gamma_1_is_reward_to_go_minus_values():
    advantages, returns = M.gae_advantages_and_returns(REWARDS, VALUES, GAE_MASK, gamma=1.0, lam=1.0)
    # Rewards-to-go: row 0 [1, 1, 1]; row 1 [.1 + 2, 2, -] = [2.1, 2, 0]
    reward_to_go = t([1.0, 1.0, 1.0], [2.1, 2.0, 0.0])
    assert_close(advantages, (reward_to_go - VALUES) * GAE_MASK)
    assert_close(returns, reward_to_go)


def test_gae_lam_0_is_the_one_step_td_error():
    advantages, returns = M.gae_advantages_and_returns(REWARDS, VALUES, GAE_MASK, gamma=1.0, lam=0.0)
    # delta_t = r_t + V(s_{t+1}) - V(s_t), terminal V = 0:
    # row 0: [0 + .2 - .5, 0 + .4 - .2, 1 + 0 - .4] = [-.3, .2, .6]
    # row 1: [.1 + .5 - 1, 2 + 0 - .5, 0] = [-.4, 1.5, 0]
    assert_close(advantages, t([-0.3, 0.2, 0.6], [-0.4, 1.5, 0.0]))
    # returns = delta + V = r_t + V(s_{t+1}): row 0 [.2, .4, 1], row 1 [.6, 2, 0]
    assert_close(returns, t([0.2, 0.4, 1.0], [0.6, 2.0, 0.0]))


def test_gae_terminal_value_is_zero_whatever_values_holds():
    values_garbage = VALUES.clone()
    values_garbage[1, 2] = -1e6
    a1, r1 = M.gae_advantages_and_returns(REWARDS, VALUES, GAE_MASK)
    a2, r2 = M.gae_advantages_and_returns(REWARDS, values_garbage, GAE_MASK)
    assert_close(a1, a2)
    assert_close(r1, r2)
    # Row 1 at its last token, t=1: A = r - V = 2 - .5 = 1.5 for any lam, as if V(s_2) = 0.
    assert a1[1, 1].item() == pytest.approx(1.5)


# ---------------------------------------------------------------------------------------------------------------
# policy_loss, value_loss
# ---------------------------------------------------------------------------------------------------------------
RATIOS = t([1.5, 0.5, 1.0], [1.1, 0.7, 3.0])  # row 1: 3.0 is past the mask
ADVANTAGES = t([1.0, 1.0, -2.0], [-1.0, -1.0, 5.0])
LOSS_MASK = t([1, 1, 1], [1, 1, 0])


def test_policy_loss_by_hand():
    old_logprobs = t([-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0])
    logprobs = (old_logprobs + RATIOS.log()).requires_grad_()
    loss, stats = M.policy_loss(logprobs, old_logprobs, ADVANTAGES, LOSS_MASK, cliprange=0.2)
    # Per token max(-A r, -A clip(r, .8, 1.2)):
    #   r=1.5, A=1:   max(-1.5, -1.2) = -1.2   clipped
    #   r=.5,  A=1:   max(-.5, -.8)   = -.5
    #   r=1,   A=-2:  max(2, 2)       = 2
    #   r=1.1, A=-1:  max(1.1, 1.1)   = 1.1
    #   r=.7,  A=-1:  max(.7, .8)     = .8     clipped
    # loss = (-1.2 - .5 + 2 + 1.1 + .8) / 5 = 2.2 / 5 = .44
    assert_close(loss, torch.tensor(0.44))
    # clipfrac = 2 / 5; ratio = (1.5 + .5 + 1 + 1.1 + .7) / 5 = 4.8 / 5 = .96
    assert_close(stats["clipfrac"], torch.tensor(0.4))
    assert_close(stats["ratio"], torch.tensor(0.96))
    # approxkl = .5 x mean((log r)^2) = .5 x (log(1.5)^2 + log(.5)^2 + 0 + log(1.1)^2 + log(.7)^2) / 5
    #          = .5 x (.164402 + .480453 + 0 + .009084 + .127217) / 5 = .078116
    assert_close(stats["approxkl"], torch.tensor(0.078116), atol=1e-6, rtol=1e-5)
    # Gradient: d(-A r)/d logp = -A r, divided by the 5 tokens of the mean; 0 where the clip was active.
    #   [0 (clipped), -1 x .5 / 5 = -.1, 2 x 1 / 5 = .4]  and  [1 x 1.1 / 5 = .22, 0 (clipped), 0 (masked)]
    loss.backward()
    assert_close(logprobs.grad, t([0.0, -0.1, 0.4], [0.22, 0.0, 0.0]))


def test_policy_loss_with_unchanged_policy():
    # logprobs == old_logprobs: r is exactly 1, nothing is clipped, approxkl is 0, and the loss is -mean(A):
    # -(1 + 1 - 2 - 1 - 1) / 5 = 2 / 5 = .4
    logprobs = t([-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0])
    loss, stats = M.policy_loss(logprobs, logprobs.clone(), ADVANTAGES, LOSS_MASK)
    assert stats["ratio"].item() == 1.0
    assert stats["clipfrac"].item() == 0.0
    assert stats["approxkl"].item() == 0.0
    assert_close(loss, -M.masked_mean(ADVANTAGES, LOSS_MASK))
    assert_close(loss, torch.tensor(0.4))


def test_value_loss_by_hand():
    old_values = t([0.0, 1.0, 2.0], [0.0, 0.0, 5.0])
    values = t([0.5, 1.1, 1.0], [-0.3, 0.1, -5.0]).requires_grad_()
    returns = t([1.0, 0.0, 2.0], [-1.0, 0.5, 9.0])
    loss, clipfrac = M.value_loss(values, old_values, returns, LOSS_MASK, cliprange_value=0.2)
    # Per token: V_clip = V_old + clip(V - V_old, -.2, .2); max((V - R)^2, (V_clip - R)^2)
    #   V=.5,  V_old=0, R=1:   V_clip=.2;  max(.25, .64) = .64    clipped larger
    #   V=1.1, V_old=1, R=0:   V_clip=1.1; max(1.21, 1.21) = 1.21
    #   V=1,   V_old=2, R=2:   V_clip=1.8; max(1, .04) = 1
    #   V=-.3, V_old=0, R=-1:  V_clip=-.2; max(.49, .64) = .64    clipped larger
    #   V=.1,  V_old=0, R=.5:  V_clip=.1;  max(.16, .16) = .16
    # loss = .5 x (.64 + 1.21 + 1 + .64 + .16) / 5 = .5 x 3.65 / 5 = .365;  clipfrac = 2 / 5
    assert_close(loss, torch.tensor(0.365))
    assert_close(clipfrac, torch.tensor(0.4))
    # The clipped term is taken where larger, so its gradient (0 for V outside the clip range) wins there:
    #   token 1: 0; token 2: .5 x 2 (1.1 - 0) / 5 = .22; token 3: .5 x 2 (1 - 2) / 5 = -.2;
    #   token 4: 0; token 5: .5 x 2 (.1 - .5) / 5 = -.08; masked: 0
    loss.backward()
    assert_close(values.grad, t([0.0, 0.22, -0.2], [0.0, -0.08, 0.0]))


def test_value_loss_takes_the_larger_term():
    # Unclipped larger: V moved away from R beyond the clip -> the unclipped error counts.
    #   V=1, V_old=2, R=2: (1 - 2)^2 = 1 > (1.8 - 2)^2 = .04 -> .5 x 1 = .5
    loss, clipfrac = M.value_loss(t([[1.0]]), t([[2.0]]), t([[2.0]]), t([[1.0]]))
    assert_close(loss, torch.tensor(0.5))
    assert clipfrac.item() == 0.0
    # Clipped larger: V moved toward R beyond the clip -> the clipped error counts.
    #   V=1.9, V_old=0, R=2: (1.9 - 2)^2 = .01 < (.2 - 2)^2 = 3.24 -> .5 x 3.24 = 1.62
    loss, clipfrac = M.value_loss(t([[1.9]]), t([[0.0]]), t([[2.0]]), t([[1.0]]))
    assert_close(loss, torch.tensor(1.62))
    assert clipfrac.item() == 1.0


# ---------------------------------------------------------------------------------------------------------------
# pairwise_reward_loss
# ---------------------------------------------------------------------------------------------------------------
def test_pairwise_reward_loss_by_hand():
    chosen, rejected = t([2.0, 0.0]), t([0.0, 1.0])
    # r_c - r_r = [2, -1];  -log sigmoid(x) = log(1 + exp(-x)):
    # (log(1 + e^-2) + log(1 + e^1)) / 2 = (.126928 + 1.313262) / 2 = .720095;  accuracy: 1 of 2 pairs
    loss, accuracy = M.pairwise_reward_loss(chosen, rejected)
    assert_close(loss, torch.tensor(0.720095))
    assert accuracy.item() == 0.5
    # Margin 1: [2 - 1, -1 - 1] = [1, -2] -> (log(1 + e^-1) + log(1 + e^2)) / 2 = (.313262 + 2.126928) / 2 = 1.220095
    loss, accuracy = M.pairwise_reward_loss(chosen, rejected, margin=1.0)
    assert_close(loss, torch.tensor(1.220095))
    assert accuracy.item() == 0.5  # the margin changes the loss, not which score is higher
    # A tie is not a correct pair: log(1 + e^0) = log 2.
    loss, accuracy = M.pairwise_reward_loss(t([1.0, 1.0]), t([1.0, 1.0]))
    assert_close(loss, torch.tensor(math.log(2)))
    assert accuracy.item() == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Masked positions never matter; empty rows never give NaN
# ---------------------------------------------------------------------------------------------------------------
def all_outputs(logprobs, old_logprobs, ref_logprobs, values, old_values, scores, mask):
    """Every masked function of rlhf_math on one batch, with the gradients of the two losses."""
    logprobs = logprobs.clone().requires_grad_()
    values = values.clone().requires_grad_()
    rewards, kl = M.per_token_rewards(scores, logprobs.detach(), ref_logprobs, mask, kl_coef=0.1)
    advantages, returns = M.gae_advantages_and_returns(rewards, old_values, mask)
    whitened = M.masked_whiten(advantages, mask)
    pg_loss, pg_stats = M.policy_loss(logprobs, old_logprobs, whitened, mask)
    vf_loss, vf_clipfrac = M.value_loss(values, old_values, returns, mask)
    (pg_loss + vf_loss).backward()
    return [
        M.masked_mean(logprobs.detach(), mask),
        M.masked_mean(logprobs.detach(), mask, dim=1),
        M.masked_var(old_values, mask),
        M.masked_whiten(old_values, mask, shift_mean=False),
        rewards,
        kl,
        advantages,
        returns,
        whitened,
        pg_loss,
        vf_loss,
        vf_clipfrac,
        *pg_stats.values(),
        logprobs.grad,
        values.grad,
    ]


def random_batch(seed):
    g = torch.Generator().manual_seed(seed)
    mask = M.response_mask_from_stop(torch.tensor([[7, 7, 2, 7, 7], [7, 7, 7, 7, 7]]), stop_token_id=2)
    logprobs = -torch.rand(2, 5, generator=g)
    return dict(
        logprobs=logprobs,
        old_logprobs=logprobs + 0.1 * torch.randn(2, 5, generator=g),
        ref_logprobs=logprobs + 0.1 * torch.randn(2, 5, generator=g),
        values=torch.randn(2, 5, generator=g),
        old_values=torch.randn(2, 5, generator=g),
        scores=torch.randn(2, generator=g),
        mask=mask,
    )


def test_garbage_at_masked_positions_changes_nothing():
    batch = random_batch(0)
    clean = all_outputs(**batch)
    outside = batch["mask"] == 0
    for garbage in [1e4, -1e4, float("nan"), float("inf")]:
        dirty = dict(batch)
        for name in ["logprobs", "old_logprobs", "ref_logprobs", "values", "old_values"]:
            dirty[name] = batch[name].masked_fill(outside, garbage)
        for a, b in zip(clean, all_outputs(**dirty)):
            assert_close(a, b)


def test_a_row_with_an_empty_mask_gives_no_nan():
    batch = random_batch(1)
    batch["mask"] = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    for output in all_outputs(**batch):
        assert torch.isfinite(output).all()
    rewards, _ = M.per_token_rewards(batch["scores"], batch["logprobs"], batch["ref_logprobs"], batch["mask"], 0.1)
    assert rewards[1].tolist() == [0.0] * 5  # no action, so no score and no penalty
