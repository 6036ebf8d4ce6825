"""Generate the bundled offline task: a toy preference data set, a tokenizer and a tiny pretrained base model.

The task is the "positive continuation" task of Ziegler et al. (2019, "Fine-Tuning Language Models from Human
Preferences"), shrunk so that it runs offline on a CPU: a prompt opens a movie review, two continuations follow, and the
preferred ("chosen") one is the more positive. Sentiment comes from a small compositional rule (see `clause_score` and
`response_score`), built so that counting words is not enough: in about half of the pairs chosen and rejected hold the
same words, and only their order or the place of a negation decides.

Run `python toy_task/make_toy_task.py`; it writes
    toy_task/data/{train,test}.jsonl   columns prompt, chosen, rejected, kind (DeepSpeed-Chat "rm-static" shape)
    toy_task/base_model/               LlamaForCausalLM + tokenizer, loadable with from_pretrained like a hub model
    toy_task/pretrain.txt              2,000 of the pretraining corpus's reviews, one per line (ppo.py --unsup-dataset)
The same seed gives the same data and tokenizer; the model is also identical when rerun on the same machine.
"""

import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import tyro
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


@dataclass
class Args:
    seed: int = 1
    """seed of the data, the model initialisation and the pretraining batches"""
    output_dir: str = os.path.dirname(os.path.abspath(__file__))
    """folder that receives data/ and base_model/"""
    num_train: int = 6000
    """preference pairs in the train split"""
    num_test: int = 600
    """preference pairs in the test split"""
    num_extra_reviews: int = 8000
    """unpaired review texts added to the pretraining corpus"""
    num_pretrain_lines: int = 2000
    """unpaired reviews also written to pretrain.txt, the plain text of ppo.py's pretraining mix"""
    vocab_size: int = 1500
    """upper bound on the BPE vocabulary (training stops earlier once every word is one token)"""
    hidden_size: int = 128
    """width of the base model"""
    num_layers: int = 4
    """transformer blocks of the base model"""
    pretrain_steps: int = 400
    """optimizer steps of language-model pretraining"""
    batch_size: int = 64
    """sequences per pretraining step"""
    learning_rate: float = 2e-3
    """peak AdamW learning rate (linear warm-up, then cosine decay)"""


# ---------------------------------------------------------------------------------------------------------------------
# THE SENTIMENT RULE. A clause is (aspect, verb, modifier, word), e.g. ("the story", "was not", "", "boring").
# Its score is the signed strength of its polarity word, times the modifier; a negated verb flips the sign and halves it.
# ---------------------------------------------------------------------------------------------------------------------
WORD_VALUES = {
    # positive adjectives, strength 1 / 2 / 3
    "good": 1, "nice": 1, "decent": 1, "pleasant": 1, "solid": 1, "likable": 1, "watchable": 1, "charming": 1,
    "enjoyable": 1, "sweet": 1, "fun": 1, "neat": 1,
    "clever": 2, "moving": 2, "gripping": 2, "engaging": 2, "funny": 2, "beautiful": 2, "touching": 2, "exciting": 2,
    "impressive": 2, "witty": 2, "compelling": 2, "memorable": 2, "heartfelt": 2, "stylish": 2, "thrilling": 2,
    "superb": 3, "brilliant": 3, "wonderful": 3, "excellent": 3, "outstanding": 3, "stunning": 3, "masterful": 3,
    "perfect": 3, "amazing": 3, "magnificent": 3, "breathtaking": 3, "extraordinary": 3,
    # negative adjectives, strength 1 / 2 / 3
    "bland": -1, "flat": -1, "forgettable": -1, "uneven": -1, "clumsy": -1, "predictable": -1, "slow": -1,
    "messy": -1, "shallow": -1, "stiff": -1, "thin": -1, "sloppy": -1,
    "boring": -2, "dull": -2, "weak": -2, "bad": -2, "silly": -2, "tedious": -2, "lifeless": -2, "confusing": -2,
    "annoying": -2, "cliched": -2, "tiresome": -2, "poor": -2, "lazy": -2,
    "awful": -3, "terrible": -3, "dreadful": -3, "painful": -3, "horrible": -3, "unbearable": -3, "atrocious": -3,
    "abysmal": -3, "disastrous": -3, "embarrassing": -3, "pathetic": -3, "unwatchable": -3,
    # noun phrases ("was hardly a masterpiece", "never felt like a chore"); they take no modifier
    "a delight": 2, "a joy": 2, "a treat": 2, "a gem": 3, "a masterpiece": 3, "a triumph": 3,
    "a mess": -2, "a bore": -2, "a letdown": -2, "a chore": -2, "a disaster": -3, "a waste of time": -3,
}
POSITIVE_WORDS = [word for word, value in WORD_VALUES.items() if value > 0]
NEGATIVE_WORDS = [word for word, value in WORD_VALUES.items() if value < 0]
# intensifiers and softeners; used only in clauses that are not negated ("hardly somewhat good" is not English)
MODIFIERS = {"truly": 1.5, "really": 1.5, "very": 1.5, "incredibly": 1.5, "remarkably": 1.5,
             "somewhat": 0.5, "slightly": 0.5, "a bit": 0.5, "fairly": 0.5, "mildly": 0.5}
# each plain verb with a negated form of it; "{like}" becomes " like" before a noun phrase ("felt like a mess")
VERB_PAIRS = [("was", "was not"), ("was", "was never"), ("was", "was hardly"), ("was", "was not exactly"),
              ("was", "was far from"), ("felt{like}", "did not feel{like}"), ("felt{like}", "never felt{like}"),
              ("seemed{like}", "did not seem{like}")]
PLAIN_VERBS = ["was", "felt{like}", "seemed{like}"]
NEGATED_VERBS = [negated for _, negated in VERB_PAIRS]
NEGATION_SCALE = -0.5  # "not bad" = -0.5 * (-2) = +1: flipped, and milder than "good"
CONCESSION_WEIGHT = 0.25  # in "A, but B" and "although A, B" the conceded clause A counts a quarter, B fully
NEGATION_PROBABILITY = 0.25  # share of randomly drawn clauses that are negated ("not bad", "hardly a masterpiece")

ASPECTS = ["the story", "the plot", "the script", "the dialogue", "the cast", "the acting", "the lead actor",
           "the lead actress", "the villain", "the ending", "the final act", "the opening scene", "the soundtrack",
           "the music", "the pacing", "the direction", "the cinematography", "the camera work", "the editing",
           "the humor", "the premise", "the twist", "the romance", "the action", "the setting", "the first half",
           "the second half", "the whole thing"]
PROMPT_OPENERS = ["I watched this film last night", "I saw the new thriller from the director of Heat",
                  "My friends dragged me to this comedy on Friday", "We rented this drama on a rainy Sunday",
                  "I finally caught the sequel at the local cinema", "This animated film was on my list for months",
                  "I went to the late show of this horror movie", "The new western from the famous director opened",
                  "I streamed this documentary with my family", "After all the hype I bought a ticket",
                  "My sister recommended this romantic comedy", "I had low hopes for this remake",
                  "The festival opened with this war drama", "I watched the director's cut of this space opera",
                  "We saw this crime thriller on opening night", "I gave this small indie film a chance",
                  "I rewatched this old classic over the weekend", "Everyone at work was talking about this spy movie",
                  "I took my kids to this family adventure", "The trailer for this mystery looked promising",
                  "I read the book before seeing this adaptation", "We picked this musical for our movie night"]
PROMPT_ENDINGS = [" and", ", and", ", and I have to say", ", and in short", ", and I think"]
# neutral fillers: they vary the length of a continuation without changing its score
PREFIXES = ["to be fair,", "in my view,", "all in all,", "frankly,", "overall,"]
SUFFIXES = ["from start to finish", "for most of its running time", "if you ask me", "at least for me",
            "on the whole", "by the end", "in my opinion", "throughout"]


def clause_score(clause: tuple) -> float:
    """Score of one clause: signed word strength x modifier, flipped and halved when the verb is negated."""
    _, verb, modifier, word = clause
    value = WORD_VALUES[word] * MODIFIERS.get(modifier, 1.0)
    return NEGATION_SCALE * value if verb in NEGATED_VERBS else value


def response_score(response: tuple) -> float:
    """Score of a response (form, clauses): "and" adds its clauses; "but"/"although" weight the conceded first one."""
    form, clauses = response
    scores = [clause_score(clause) for clause in clauses]
    if form in ("but", "although"):
        return CONCESSION_WEIGHT * scores[0] + scores[1]
    return sum(scores)


def clause_text(clause: tuple) -> str:
    """("the story", "was not", "", "boring") -> "the story was not boring"."""
    aspect, verb, modifier, word = clause
    verb = verb.format(like=" like" if word.startswith("a ") else "")
    return " ".join(part for part in (aspect, verb, modifier, word) if part)


def response_text(rng: random.Random, response: tuple) -> str:
    """Continuation text: leading space (it follows the prompt), optional neutral fillers, final period."""
    form, clauses = response
    texts = [clause_text(clause) for clause in clauses]
    body = {"single": "{}", "and": "{} and {}", "but": "{}, but {}", "although": "although {}, {}"}[form]
    body = body.format(*texts)
    if rng.random() < 0.3:
        body = rng.choice(PREFIXES) + " " + body
    if rng.random() < 0.5:
        body = body + " " + rng.choice(SUFFIXES)
    return " " + body + "."


# ---------------------------------------------------------------------------------------------------------------------
# PAIRS. Each maker returns two responses; `make_pair` orders them by the rule and keeps them only if the gap is clear.
# ---------------------------------------------------------------------------------------------------------------------
def random_clause(rng: random.Random, sign: int, aspect: str, allow_negation: bool = True) -> tuple:
    """A clause whose score has the given sign; a negative clause may be a negated positive word, and vice versa."""
    negate = allow_negation and rng.random() < NEGATION_PROBABILITY
    word = rng.choice(POSITIVE_WORDS if (sign > 0) != negate else NEGATIVE_WORDS)
    verb = rng.choice(NEGATED_VERBS if negate else PLAIN_VERBS)
    modifier = ""
    if not negate and not word.startswith("a ") and rng.random() < 0.3:
        modifier = rng.choice(list(MODIFIERS))
    return (aspect, verb, modifier, word)


def make_plain(rng: random.Random) -> tuple:
    """A positive and a negative response drawn independently (a bag of words gets most of these right)."""
    def one_response(sign):
        aspect_1, aspect_2 = rng.sample(ASPECTS, 2)
        if rng.random() < 0.5:
            return ("single", [random_clause(rng, sign, aspect_1)])
        return ("and", [random_clause(rng, sign, aspect_1), random_clause(rng, sign, aspect_2)])
    return one_response(+1), one_response(-1)


def make_negation(rng: random.Random) -> tuple:
    """The same words, with the negation in a different place: 'not boring' vs 'boring', or moved between clauses."""
    aspect_1, aspect_2 = rng.sample(ASPECTS, 2)
    plain, negated = rng.choice(VERB_PAIRS)
    if rng.random() < 0.4:
        word = rng.choice(POSITIVE_WORDS + NEGATIVE_WORDS)
        return ("single", [(aspect_1, negated, "", word)]), ("single", [(aspect_1, plain, "", word)])
    good, bad = rng.choice(POSITIVE_WORDS), rng.choice(NEGATIVE_WORDS)
    first = ("and", [(aspect_1, negated, "", bad), (aspect_2, plain, "", good)])  # "not dull and clever"
    second = ("and", [(aspect_1, plain, "", bad), (aspect_2, negated, "", good)])  # "dull and not clever"
    if rng.random() < 0.5:  # the positive word comes first just as often
        first = ("and", first[1][::-1])
        second = ("and", second[1][::-1])
    return first, second


def make_contrast(rng: random.Random) -> tuple:
    """The same two clauses in swapped order around "but" / "although": the main (second) clause dominates."""
    aspect_1, aspect_2 = rng.sample(ASPECTS, 2)
    good, bad = random_clause(rng, +1, aspect_1), random_clause(rng, -1, aspect_2)
    form = rng.choice(["but", "although"])
    return (form, [bad, good]), (form, [good, bad])


def make_near_tie(rng: random.Random) -> tuple:
    """Same polarity, one clearly stronger: 'was good' vs 'was superb', 'was a bit slow' vs 'was truly awful'."""
    aspect_1, aspect_2 = rng.sample(ASPECTS, 2)
    sign = rng.choice([+1, -1])
    verb = rng.choice(PLAIN_VERBS)  # the same verb on both sides: only the word and the modifier differ
    first = (aspect_1, verb) + random_clause(rng, sign, aspect_1, allow_negation=False)[2:]
    second = (aspect_1, verb) + random_clause(rng, sign, aspect_1, allow_negation=False)[2:]
    if rng.random() < 0.5:
        return ("single", [first]), ("single", [second])
    shared = random_clause(rng, sign, aspect_2, allow_negation=False)
    return ("and", [first, shared]), ("and", [second, shared])


def random_response(rng: random.Random, sign: int) -> tuple:
    """Any form the task writes, its main clause of the given sign: "and" joins two clauses of that sign, and the
    conceded clause of "but"/"although" has either sign."""
    aspect_1, aspect_2 = rng.sample(ASPECTS, 2)
    form = rng.choice(["single", "and", "but", "although"])
    if form == "single":
        return form, [random_clause(rng, sign, aspect_1)]
    first_sign = sign if form == "and" else rng.choice([+1, -1])
    return form, [random_clause(rng, first_sign, aspect_1), random_clause(rng, sign, aspect_2)]


def make_cross_form(rng: random.Random) -> tuple:
    """Two responses of different forms, most often both positive: "A, but B" against "A and B", one clause against
    two, graded by the rule ("a bit dull, but superb" 2.75 < "fun and superb" 4 < "truly brilliant and superb" 7.5).
    The other kinds compare like with like; these teach the reward model how the forms compare."""
    sign = +1 if rng.random() < CROSS_FORM_POSITIVE else -1
    while True:
        first, second = random_response(rng, sign), random_response(rng, sign)
        if (first[0], len(first[1])) != (second[0], len(second[1])):
            return first, second


MAKERS = {"plain": make_plain, "negation": make_negation, "contrast": make_contrast, "near_tie": make_near_tie,
          "cross_form": make_cross_form}
KIND_SHARES = {"plain": 0.15, "negation": 0.15, "contrast": 0.15, "near_tie": 0.10, "cross_form": 0.45}
MIN_NEAR_TIE_GAP = 1.5  # near ties: same sign, scores at least this far apart ("good" 1 vs "clever" 2 is too close)
MIN_CROSS_FORM_GAP = 1.0  # cross-form pairs: scores at least this far apart, whatever their signs
CROSS_FORM_POSITIVE = 0.8  # share of cross-form pairs whose main clauses are positive (the policies' side of the scale)
MIN_ABS_SCORE = 0.5  # other kinds: chosen >= +0.5 and rejected <= -0.5


def make_pair(rng: random.Random, kind: str) -> dict:
    """Draw responses until the rule separates them clearly, then render them with independent fillers."""
    while True:
        first, second = MAKERS[kind](rng)
        if response_score(first) < response_score(second):
            first, second = second, first
        high, low = response_score(first), response_score(second)
        if kind == "near_tie":
            clear = high - low >= MIN_NEAR_TIE_GAP and (high > 0) == (low > 0)
        elif kind == "cross_form":
            clear = high - low >= MIN_CROSS_FORM_GAP
        else:
            clear = high >= MIN_ABS_SCORE and low <= -MIN_ABS_SCORE
        chosen, rejected = response_text(rng, first), response_text(rng, second)
        if clear and all(6 <= len(text.split()) <= 25 for text in (chosen, rejected)):
            prompt = rng.choice(PROMPT_OPENERS) + rng.choice(PROMPT_ENDINGS)
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "kind": kind}


def random_review(rng: random.Random) -> str:
    """Unpaired review text for pretraining: any form, any polarity, so the base model learns no preference."""
    prompt = rng.choice(PROMPT_OPENERS) + rng.choice(PROMPT_ENDINGS)
    return prompt + response_text(rng, random_response(rng, rng.choice([+1, -1])))


if __name__ == "__main__":
    args = tyro.cli(Args)
    start_time = time.time()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    data_dir = os.path.join(args.output_dir, "data")
    model_dir = os.path.join(args.output_dir, "base_model")
    os.makedirs(data_dir, exist_ok=True)

    # 1. preference pairs; the file names train.jsonl / test.jsonl let `load_dataset("toy_task/data")` infer the splits
    splits = {}
    for split, size in (("train", args.num_train), ("test", args.num_test)):
        kinds = [kind for kind, share in KIND_SHARES.items() for _ in range(round(share * size))]
        rng.shuffle(kinds)
        splits[split] = [make_pair(rng, kind) for kind in kinds]
        with open(os.path.join(data_dir, f"{split}.jsonl"), "w") as f:
            for row in splits[split]:
                f.write(json.dumps(row) + "\n")
        print(f"{split}: {len(splits[split])} pairs")
    assert all(5 <= len((opener + ending).split()) <= 15 for opener in PROMPT_OPENERS for ending in PROMPT_ENDINGS)

    # 2. pretraining corpus: both continuations of every train pair (so neither is favoured) plus unpaired reviews;
    # the test split stays out so that its sentences are new to every model
    corpus = [row["prompt"] + row[column] for row in splits["train"] for column in ("chosen", "rejected")]
    corpus += [random_review(rng) for _ in range(args.num_extra_reviews)]
    # a slice of it, as plain text, for ppo.py's pretraining mix (--unsup-dataset toy_task/pretrain.txt)
    with open(os.path.join(args.output_dir, "pretrain.txt"), "w") as f:
        f.write("\n".join(corpus[-args.num_extra_reviews :][: args.num_pretrain_lines]) + "\n")

    # 3. byte-level BPE tokenizer with its own pad token: a pad equal to EOS would mask out the real EOS
    # (the reward model reads its score at the EOS, and PPO truncates after it)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                        pad_token="<|pad|>", model_max_length=128)
    print(f"tokenizer: {len(tokenizer)} tokens, eos id {tokenizer.eos_token_id}, pad id {tokenizer.pad_token_id}")

    # 4. a tiny Llama; dropout is 0, as PPO needs (the probability ratio must be exactly 1 before the first update)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                         num_hidden_layers=args.num_layers, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=args.hidden_size // 4, max_position_embeddings=128, tie_word_embeddings=True,
                         attention_dropout=0.0, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    print(f"base model: {sum(p.numel() for p in model.parameters()):,} parameters")

    # 5. pretrain as a plain language model; every text ends with EOS so that generations learn to stop
    sequences = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in corpus]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.01)
    warmup_steps = args.pretrain_steps // 20

    def lr_factor(step: int) -> float:
        """Linear warm-up over the first 5% of steps, then cosine decay to 0."""
        return min(1.0, (step + 1) / warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / args.pretrain_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    running_loss = 0.0
    for step in range(args.pretrain_steps):
        batch = [sequences[i] for i in torch.randint(len(sequences), (args.batch_size,)).tolist()]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in batch])
        attention_mask = (input_ids != tokenizer.pad_token_id).long()
        labels = input_ids.masked_fill(attention_mask == 0, -100)  # no loss on padding
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        running_loss += loss.item()
        if (step + 1) % 50 == 0:
            print(f"pretrain step {step + 1:4d}  lm loss {running_loss / 50:.3f}  ({time.time() - start_time:.0f}s)")
            running_loss = 0.0

    # 6. save in the layout of a hub model, then show that it continues test prompts sensibly
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    model.eval()
    for row in splits["test"][:5]:
        prompt_ids = tokenizer(row["prompt"], return_tensors="pt")["input_ids"]
        output = model.generate(prompt_ids, do_sample=True, top_k=0, max_new_tokens=40,
                                pad_token_id=tokenizer.pad_token_id)
        continuation = output[0, prompt_ids.shape[1]:].tolist()
        stopped = tokenizer.eos_token_id in continuation
        print(f"sample: {row['prompt']!r} -> {tokenizer.decode(continuation, skip_special_tokens=True)!r}"
              f"{' <EOS>' if stopped else ' (no EOS)'}")
    print(f"done in {time.time() - start_time:.0f}s")
