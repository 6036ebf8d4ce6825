"""Check the bundled toy task: data statistics, a bag-of-words baseline, and (optionally) a trained reward model.

    python toy_task/check_task.py                                  # statistics + bag-of-words baseline
    python toy_task/check_task.py --reward-model checkpoints/rm    # + accuracy of a trained reward model, per kind

The bag-of-words baseline is the bar a reward model must clear: it sees which words differ between chosen and rejected
but not their order, so it is at chance on the "negation" and "contrast" pairs (same words, different order).
"""

import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
import tyro
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

TOY_TASK_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args:
    data_dir: str = os.path.join(TOY_TASK_DIR, "data")
    """folder with train.jsonl and test.jsonl"""
    base_model: str = os.path.join(TOY_TASK_DIR, "base_model")
    """base model and tokenizer"""
    reward_model: Optional[str] = None
    """if set, a trained reward model (AutoModelForSequenceClassification) to score per kind"""
    bow_steps: int = 500
    """full-batch Adam steps of the bag-of-words logistic regression"""
    batch_size: int = 64
    """pairs per forward pass when scoring with a model"""


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def per_kind_accuracy(correct: torch.Tensor, kinds: list[str]) -> str:
    """'overall 0.750 | plain 0.980 | ...' from a [num_pairs] tensor of 1 (right), 0 (wrong) or 0.5 (tie)."""
    parts = [f"overall {correct.mean():.3f}"]
    for kind in sorted(set(kinds)):
        mask = torch.tensor([k == kind for k in kinds])
        parts.append(f"{kind} {correct[mask].mean():.3f}")
    return " | ".join(parts)


def pair_batches(tokenizer, rows, column: str, batch_size: int):
    """Yield (input_ids, attention_mask, response_mask) for prompt + rows[column] + EOS, right-padded with the pad id.

    Prompt and response are tokenized separately and concatenated, as the RLHF scripts do, so that the response
    tokens are exactly those a policy would generate. Shapes: [batch, seq_len].
    """
    for start in range(0, len(rows), batch_size):
        sequences, response_masks = [], []
        for row in rows[start:start + batch_size]:
            prompt_ids = tokenizer(row["prompt"])["input_ids"]
            response_ids = tokenizer(row[column])["input_ids"] + [tokenizer.eos_token_id]
            sequences.append(prompt_ids + response_ids)
            response_masks.append([0] * len(prompt_ids) + [1] * len(response_ids))
        width = max(len(ids) for ids in sequences)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in sequences])
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences])
        response_mask = torch.tensor([mask + [0] * (width - len(mask)) for mask in response_masks])
        yield input_ids, attention_mask, response_mask


@torch.no_grad()
def response_logprobs(model, tokenizer, rows, column: str, batch_size: int) -> torch.Tensor:
    """Sum of log p(response token | previous tokens) under a causal LM, EOS included. Returns [num_pairs]."""
    totals = []
    for input_ids, attention_mask, response_mask in pair_batches(tokenizer, rows, column, batch_size):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        # logits at position t predict token t + 1, hence the shift by one
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        totals.append((logprobs * response_mask[:, 1:]).sum(dim=1))
    return torch.cat(totals)


@torch.no_grad()
def reward_scores(model, tokenizer, rows, column: str, batch_size: int) -> torch.Tensor:
    """Reward model score of prompt + response, read at the last non-pad token (the EOS). Returns [num_pairs]."""
    scores = []
    for input_ids, attention_mask, _ in pair_batches(tokenizer, rows, column, batch_size):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = model.score(hidden).squeeze(-1)  # [batch, seq_len]: a score at every position
        last_index = attention_mask.sum(dim=1) - 1  # right padding: the EOS is the last real token
        scores.append(logits[torch.arange(len(logits)), last_index])
    return torch.cat(scores)


if __name__ == "__main__":
    args = tyro.cli(Args)
    dataset = load_dataset(args.data_dir)  # splits inferred from the file names train.jsonl / test.jsonl
    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    print(dataset)
    print(f"tokenizer: {len(tokenizer)} tokens | eos {tokenizer.eos_token!r} id {tokenizer.eos_token_id} | "
          f"pad {tokenizer.pad_token!r} id {tokenizer.pad_token_id} | bos id {tokenizer.bos_token_id}")
    example = " the story was moving."
    print(f"round trip {example!r} -> {tokenizer(example)['input_ids']} -> "
          f"{tokenizer.decode(tokenizer(example)['input_ids'])!r}")

    # 1. data statistics
    for split in ("train", "test"):
        rows = list(dataset[split])
        kinds = Counter(row["kind"] for row in rows)
        print(f"\n[{split}] {len(rows)} pairs | " + " | ".join(f"{k} {n / len(rows):.3f}" for k, n in sorted(kinds.items())))
        for unit, length in (("words", lambda text: len(words(text))),
                             ("tokens", lambda text: len(tokenizer(text)["input_ids"]))):
            longer = sum(length(row["chosen"]) > length(row["rejected"]) for row in rows)
            shorter = sum(length(row["chosen"]) < length(row["rejected"]) for row in rows)
            equal = len(rows) - longer - shorter
            print(f"  chosen longer in {unit}: {longer / len(rows):.3f}, shorter {shorter / len(rows):.3f}, "
                  f"equal {equal / len(rows):.3f} -> P(chosen longer), ties counted half: "
                  f"{(longer + 0.5 * equal) / len(rows):.3f}")
        prompt_tokens = [len(tokenizer(row["prompt"])["input_ids"]) for row in rows]
        total_tokens = [p + len(tokenizer(row[c])["input_ids"]) + 1 for p, row in zip(prompt_tokens, rows)
                        for c in ("chosen", "rejected")]
        print(f"  tokens: prompt max {max(prompt_tokens)} (mean {sum(prompt_tokens) / len(rows):.1f}), "
              f"prompt + response + EOS max {max(total_tokens)} (mean {sum(total_tokens) / len(total_tokens):.1f})")
        # a word that carried a consistent sign (always in chosen, say) would be a shortcut
        for word in ("not", "never", "hardly", "but", "although", "and"):
            diffs = [words(row["chosen"]).count(word) - words(row["rejected"]).count(word) for row in rows]
            print(f"  {word!r:10} more often in chosen {sum(d > 0 for d in diffs):4d} pairs, "
                  f"in rejected {sum(d < 0 for d in diffs):4d} pairs")

    # 2. bag-of-words logistic regression: features counts(chosen) - counts(rejected), no bias (swapping the pair
    # must flip the prediction); predicts "chosen" when w . features > 0, and counts a tie (features = 0) as half right
    train_rows, test_rows = list(dataset["train"]), list(dataset["test"])
    vocab = sorted({word for row in train_rows for column in ("chosen", "rejected") for word in words(row[column])})
    index = {word: i for i, word in enumerate(vocab)}

    def features(rows):
        x = torch.zeros(len(rows), len(vocab))
        for i, row in enumerate(rows):
            for sign, column in ((1.0, "chosen"), (-1.0, "rejected")):
                for word in words(row[column]):
                    if word in index:
                        x[i, index[word]] += sign
        return x

    x_train, x_test = features(train_rows), features(test_rows)
    weights = torch.zeros(len(vocab), requires_grad=True)
    optimizer = torch.optim.Adam([weights], lr=0.05)
    for _ in range(args.bow_steps):
        # -log sigmoid(w . x): the Bradley-Terry loss with a linear reward; small L2 keeps unused weights at 0
        loss = torch.nn.functional.softplus(-(x_train @ weights)).mean() + 1e-4 * (weights ** 2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        for name, x, rows in (("train", x_train, train_rows), ("test", x_test, test_rows)):
            margin = x @ weights
            correct = (margin > 0).float() + 0.5 * (margin == 0).float()
            print(f"\nbag-of-words accuracy [{name}]: {per_kind_accuracy(correct, [row['kind'] for row in rows])}")
        print("  weights: " + ", ".join(f"{w} {weights[index[w]]:+.2f}" for w in
                                         ("not", "never", "hardly", "but", "although", "good", "superb", "boring", "awful")))

    # 3. the base model should have no preference: log p(chosen) > log p(rejected) about half the time
    base_model = AutoModelForCausalLM.from_pretrained(args.base_model).eval()
    print(f"\nbase model: {sum(p.numel() for p in base_model.parameters()):,} parameters")
    prefers_chosen = (response_logprobs(base_model, tokenizer, test_rows, "chosen", args.batch_size)
                      > response_logprobs(base_model, tokenizer, test_rows, "rejected", args.batch_size)).float()
    print(f"base model log p(chosen) > log p(rejected) [test]: {per_kind_accuracy(prefers_chosen, [row['kind'] for row in test_rows])}")

    # 4. a trained reward model: accuracy = how often score(chosen) > score(rejected)
    if args.reward_model is not None:
        reward_tokenizer = AutoTokenizer.from_pretrained(args.reward_model)
        reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model).eval()
        chosen = reward_scores(reward_model, reward_tokenizer, test_rows, "chosen", args.batch_size)
        rejected = reward_scores(reward_model, reward_tokenizer, test_rows, "rejected", args.batch_size)
        correct = (chosen > rejected).float()
        print(f"\nreward model accuracy [test]: {per_kind_accuracy(correct, [row['kind'] for row in test_rows])}")
        print(f"  mean score chosen {chosen.mean():+.3f}, rejected {rejected.mean():+.3f}")
