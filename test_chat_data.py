"""Data as people bring it: prompts that are lists of chat messages (through the tokenizer's chat template, in every
stage), and the hh-rlhf layout, where `chosen` and `rejected` each hold the whole conversation (split into prompt and
responses by --split-conversations, refused without it). All of it on small data written here, in this process.
"""

import json
import shutil

import pytest
from transformers import AutoTokenizer

import evaluate
import ppo
import reward_model
import sft
from test_sft_and_reward_model import check_stops, run_in_process, write_jsonl

# A template of plain words, so that the toy model can train on its output: each message on its own line, then the
# opening of the assistant's turn.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "You review films."}, {"role": "user", "content": "The story"}]
HH_ROW = {"chosen": "\n\nHuman: Was it good?\n\nAssistant: Yes.\n\nHuman: And the cast?\n\nAssistant: the cast was superb.",
          "rejected": "\n\nHuman: Was it good?\n\nAssistant: Yes.\n\nHuman: And the cast?\n\nAssistant: the cast was bad."}
HH_PROMPT = "\n\nHuman: Was it good?\n\nAssistant: Yes.\n\nHuman: And the cast?\n\nAssistant:"


@pytest.fixture
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained("toy_task/base_model", padding_side="left")
    tokenizer.chat_template = PLAIN_TEMPLATE
    return tokenizer


def ids(tokenizer, text, special=True):
    return tokenizer(text, add_special_tokens=special, split_special_tokens=True)["input_ids"]


def test_chat_prompts_go_through_the_chat_template_in_every_stage(tokenizer, tmp_path):
    """A list of messages becomes the template's text, up to the opening of the assistant's turn, tokenized without
    a second BOS; the response follows as text, then EOS. sft.py, reward_model.py, ppo.py and evaluate.py agree."""
    templated = ids(tokenizer, "system: You review films.\nuser: The story\nassistant:", special=False)
    eos = tokenizer.eos_token_id
    rows = [{"prompt": MESSAGES, "chosen": " was good.", "rejected": " was dull."}]
    (example,) = sft.tokenize_demonstrations(rows, tokenizer, sft.Args(max_seq_len=128), "train")
    assert example["input_ids"] == templated + ids(tokenizer, " was good.", special=False) + [eos]
    assert example["labels"][: len(templated)] == [-100] * len(templated)
    (pair,) = reward_model.tokenize_pairs(rows, tokenizer, reward_model.Args(max_seq_len=128), "train")
    assert pair["prompt"] == templated and pair["rejected"] == templated + ids(tokenizer, " was dull.", False) + [eos]
    write_jsonl(tmp_path / "chat.jsonl", rows + [{"prompt": "A text prompt", "chosen": "", "rejected": ""}])
    for stage in (ppo, evaluate):
        prompts = stage.load_prompts(tokenizer, str(tmp_path / "chat.jsonl"), "train", "prompt", 64, False)
        assert prompts == [templated, ids(tokenizer, "A text prompt")]  # a text prompt keeps its own path


def test_chat_markers_are_real_tokens_and_messages_cannot_spell_them(tokenizer):
    """A template's markers (added tokens) become their own ids; a message whose content spells one is refused, as
    it would fake a turn. A tokenizer without a template, and a cell that is not a list of messages, are refused."""
    marked = AutoTokenizer.from_pretrained("toy_task/base_model")
    marked.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    marked.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    start, end = marked.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt = sft.prompt_ids(marked, {"prompt": MESSAGES}, 0, "prompt", "train")
    assert prompt.count(start) == 3 and prompt.count(end) == 2 and prompt[0] == start
    no_template = AutoTokenizer.from_pretrained("toy_task/base_model")
    check_stops([
        (lambda: sft.prompt_ids(marked, {"prompt": [{"role": "user", "content": "it was<|im_end|>"}]}, 4, "prompt",
                                "train"), "row 4 of split 'train', column 'prompt': a message spells the token "
                                          "'<|im_end|>'"),
        (lambda: ppo.prompt_ids(no_template, {"prompt": MESSAGES}, 2, "prompt", "test"),
         "row 2 of split 'test', column 'prompt' holds chat messages, but the tokenizer has no chat template"),
        (lambda: reward_model.prompt_ids(tokenizer, {"prompt": [{"role": "user"}]}, 1, "prompt", "train"),
         "row 1 of split 'train', column 'prompt': not a list of {'role': ..., 'content': ...} messages"),
        (lambda: sft.prompt_ids(tokenizer, {"prompt": []}, 0, "prompt", "train"), "not a list of {'role'"),
        (lambda: evaluate.prompt_ids(tokenizer, {"prompt": ["The story"]}, 0, "prompt", "train"), "not a list of"),
    ])


def test_the_hh_rlhf_layout_is_split_with_the_flag_and_refused_without(tokenizer, tmp_path):
    """With --split-conversations the prompt is each conversation up to and including its last "\\n\\nAssistant:",
    in every stage; without it, data in that layout stops with a message that names the flag."""
    eos = tokenizer.eos_token_id
    prompt = ids(tokenizer, HH_PROMPT)
    (pair,) = reward_model.tokenize_pairs([HH_ROW], tokenizer, reward_model.Args(split_conversations=True,
                                                                                 max_seq_len=128), "train")
    assert pair["chosen"] == prompt + ids(tokenizer, " the cast was superb.", False) + [eos]
    assert pair["rejected"] == prompt + ids(tokenizer, " the cast was bad.", False) + [eos]
    (example,) = sft.tokenize_demonstrations([HH_ROW], tokenizer, sft.Args(split_conversations=True, max_seq_len=128),
                                             "train")
    assert example["input_ids"] == pair["chosen"] and example["labels"].count(-100) == len(prompt)
    write_jsonl(tmp_path / "hh.jsonl", [HH_ROW])
    for stage in (ppo, evaluate):
        assert stage.load_prompts(tokenizer, str(tmp_path / "hh.jsonl"), "train", "chosen", 64, False,
                                  "\n\nAssistant:") == [prompt]

    # The same data without the flag, or with a prompt column that chosen and rejected repeat; pairs that do not split.
    write_jsonl(tmp_path / "hh_with_prompt.jsonl", [{**HH_ROW, "prompt": HH_PROMPT}])
    no_marker = {"chosen": "Human: hi. Bot: hello.", "rejected": "Human: hi. Bot: go away."}
    other_prompt = {**HH_ROW, "rejected": "\n\nHuman: Was it bad?\n\nAssistant: the cast was bad."}
    hh_flag = reward_model.Args(split_conversations=True)
    check_stops([
        (lambda: ppo.load_split(str(tmp_path / "hh.jsonl"), "train", ["prompt"]),
         "has no column ['prompt']; its columns are ['chosen', 'rejected']; if 'chosen' and 'rejected' each hold the "
         "whole conversation (the hh-rlhf layout), pass --split-conversations (ppo.py and evaluate.py also "
         "--prompt-column chosen)"),
        (lambda: reward_model.tokenize_pairs(reward_model.load_split(str(tmp_path / "hh_with_prompt.jsonl"), "train",
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
        (lambda: sft.split_conversation("\n\nHuman: hi\n\nAssistant: ", "\n\nAssistant:", "row 3"),
         "row 3: nothing after the last '\\n\\nAssistant:'"),
    ])


def test_sft_trains_on_chat_prompts(tmp_path):
    """sft.py end to end, two steps, on a data file whose prompts are lists of messages (a JSON list of objects per
    cell), with a model folder whose tokenizer has a chat template."""
    model = tmp_path / "model"
    shutil.copytree("toy_task/base_model", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = PLAIN_TEMPLATE
    tokenizer.save_pretrained(model)
    rows = [json.loads(line) for line in open("toy_task/data/train.jsonl")][:16]
    write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": row["prompt"]}],
                                           "chosen": row["chosen"]} for row in rows])
    assert run_in_process("sft.py", ["--model-name-or-path", str(model), "--dataset", str(tmp_path / "chat.jsonl"),
                                     "--eval-split", "train[:8]", "--per-device-train-batch-size", "8",
                                     "--output-dir", str(tmp_path / "sft")], must_stop=False) is None
    saved = AutoTokenizer.from_pretrained(tmp_path / "sft")
    assert saved.chat_template == PLAIN_TEMPLATE
