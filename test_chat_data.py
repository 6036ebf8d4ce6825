"""Data as people bring it: prompts that are lists of chat messages (through the tokenizer's chat template, in every
stage), and the hh-rlhf layout, where `chosen` and `rejected` each hold the whole conversation (split into prompt and
responses by --split-conversations, refused without it). All of it on small data written here, in this process.
plumbing.py's readers of such data (prompt_ids, load_prompts, split_conversation, and the messages that name the
flag), with which ppo.py and evaluate.py read their prompts, are tested in test_plumbing.py; here, sft.py's and
reward_model.py's use of them.
"""

import json
import shutil

from transformers import AutoTokenizer

import plumbing
import reward_model
import sft
# tokenizer is a pytest fixture, used by name
from test_plumbing import (HH_PROMPT, HH_ROW, MESSAGES, PLAIN_TEMPLATE, check_stops, ids, tokenizer,  # noqa: F401
                           write_jsonl)
from test_sft_and_reward_model import run_in_process


def test_chat_prompts_go_through_the_chat_template_in_every_stage(tokenizer):
    """A list of messages becomes the template's text, up to the opening of the assistant's turn, tokenized without
    a second BOS; the response follows as text, then EOS. sft.py and reward_model.py agree, and with
    plumbing.load_prompts, ppo.py's and evaluate.py's (test_plumbing.test_chat_prompts_go_through_the_chat_template)."""
    templated = ids(tokenizer, "system: You review films.\nuser: The story\nassistant:", special=False)
    eos = tokenizer.eos_token_id
    rows = [{"prompt": MESSAGES, "chosen": " was good.", "rejected": " was dull."}]
    (example,) = sft.tokenize_demonstrations(rows, tokenizer, sft.Args(max_seq_len=128), "train")
    assert example["input_ids"] == templated + ids(tokenizer, " was good.", special=False) + [eos]
    assert example["labels"][: len(templated)] == [-100] * len(templated)
    (pair,) = reward_model.tokenize_pairs(rows, tokenizer, reward_model.Args(max_seq_len=128), "train")
    assert pair["prompt"] == templated and pair["rejected"] == templated + ids(tokenizer, " was dull.", False) + [eos]


def test_the_hh_rlhf_layout_is_split_with_the_flag_and_refused_without(tokenizer, tmp_path):
    """With --split-conversations the prompt is each conversation up to and including its last "\\n\\nAssistant:",
    in sft.py and reward_model.py as in plumbing.load_prompts (ppo.py's and evaluate.py's: test_plumbing); without
    it, data in that layout stops with a message that names the flag."""
    eos = tokenizer.eos_token_id
    prompt = ids(tokenizer, HH_PROMPT)
    (pair,) = reward_model.tokenize_pairs([HH_ROW], tokenizer, reward_model.Args(split_conversations=True,
                                                                                 max_seq_len=128), "train")
    assert pair["chosen"] == prompt + ids(tokenizer, " the cast was superb.", False) + [eos]
    assert pair["rejected"] == prompt + ids(tokenizer, " the cast was bad.", False) + [eos]
    (example,) = sft.tokenize_demonstrations([HH_ROW], tokenizer, sft.Args(split_conversations=True, max_seq_len=128),
                                             "train")
    assert example["input_ids"] == pair["chosen"] and example["labels"].count(-100) == len(prompt)

    # Data with a prompt column that chosen and rejected repeat, without the flag; pairs that do not split.
    write_jsonl(tmp_path / "hh_with_prompt.jsonl", [{**HH_ROW, "prompt": HH_PROMPT}])
    no_marker = {"chosen": "Human: hi. Bot: hello.", "rejected": "Human: hi. Bot: go away."}
    other_prompt = {**HH_ROW, "rejected": "\n\nHuman: Was it bad?\n\nAssistant: the cast was bad."}
    hh_flag = reward_model.Args(split_conversations=True)
    check_stops([
        (lambda: reward_model.tokenize_pairs(plumbing.load_split(str(tmp_path / "hh_with_prompt.jsonl"), "train",
                                                                 ["prompt", "chosen", "rejected"]),
                                             tokenizer, reward_model.Args(max_seq_len=128), "train"),
         "row 0 of split 'train': 'chosen' and 'rejected' begin with the prompt (the hh-rlhf layout); pass "
         "--split-conversations"),
        (lambda: sft.tokenize_demonstrations([{**HH_ROW, "prompt": HH_PROMPT}], tokenizer, sft.Args(), "train"),
         "'chosen' begin with the prompt"),
        (lambda: reward_model.tokenize_pairs([no_marker], tokenizer, hh_flag, "train"),
         "row 0 of split 'train', column 'chosen': no '\\n\\nAssistant:' to split the conversation at; check "
         "--assistant-marker"),
        (lambda: reward_model.tokenize_pairs([other_prompt], tokenizer, hh_flag, "train"),
         "row 0 of split 'train': 'rejected' does not begin with the conversation of 'chosen'"),
    ])


def test_sft_trains_on_chat_prompts(tmp_path):
    """sft.py end to end, two steps, on a data file whose prompts are lists of messages (a JSON list of objects per
    cell), with a model folder whose tokenizer has a chat template."""
    model = tmp_path / "model"
    shutil.copytree(f"{plumbing.TOY_TASK}/base_model", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = PLAIN_TEMPLATE
    tokenizer.save_pretrained(model)
    rows = [json.loads(line) for line in open(f"{plumbing.TOY_TASK}/data/train.jsonl")][:16]
    write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": row["prompt"]}],
                                           "chosen": row["chosen"]} for row in rows])
    assert run_in_process("sft.py", ["--model-name-or-path", str(model), "--dataset", str(tmp_path / "chat.jsonl"),
                                     "--eval-split", "train[:8]", "--per-device-train-batch-size", "8",
                                     "--output-dir", str(tmp_path / "sft")], must_stop=False) is None
    saved = AutoTokenizer.from_pretrained(tmp_path / "sft")
    assert saved.chat_template == PLAIN_TEMPLATE
