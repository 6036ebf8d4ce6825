"""Data files: one split, checked for its columns and its cells; prompts and responses as token ids."""

import contextlib
import json
import os

import datasets
import torch

from .models import is_hub_name
from .processes import fail


DATA_FORMATS = {".json": "JSON", ".jsonl": "JSON", ".parquet": "Parquet", ".csv": "CSV", ".txt": "text",
                ".arrow": "Arrow"}  # the data files `datasets` reads from a folder, by their loader

def check_data_folder(folder: str, flag: str, split: str) -> None:
    """A local data folder holds its data files in one format, each once (`datasets` would leave the other formats out
    unsaid, and read both train.json and train.jsonl); a SPLIT read from several files is said, file by file."""
    files = []
    for root, folders, names in os.walk(folder):
        folders[:] = sorted(name for name in folders if not name.startswith((".", "_")))  # as `datasets` skips them
        files += [os.path.relpath(os.path.join(root, name), folder) for name in sorted(names)
                  if os.path.splitext(name)[1] in DATA_FORMATS and not name.startswith((".", "_"))]
    formats = {}
    for file in files:
        formats.setdefault(DATA_FORMATS[os.path.splitext(file)[1]], file)
    if len(formats) > 1:
        fail(f"{flag} {folder!r} holds data files of {len(formats)} formats ({', '.join(formats.values())}): only "
             "one format would be read, the other files left out; keep the files of one format in the folder")
    stems = [os.path.splitext(file)[0] for file in files]
    twice = [file for file in files if stems.count(os.path.splitext(file)[0]) > 1]
    if twice:
        fail(f"{flag} {folder!r} holds {' and '.join(twice[:2])}: the same data twice, and both would be read; keep "
             "one of them")
    with contextlib.suppress(FileNotFoundError):  # no data file at all: load_dataset says so
        split_files = datasets.data_files.DataFilesDict.from_patterns(
            datasets.data_files.get_data_patterns(folder), base_path=folder).get(split.split("[")[0], [])
        if len(split_files) > 1 and os.environ.get("RANK", "0") == "0":  # the global rank: once per run
            print(f"split {split!r} of {flag} {folder!r} is read from {len(split_files)} files: "
                  f"{', '.join(os.path.relpath(file, folder) for file in split_files)}")

def load_split(dataset: str, split: str, columns: list[str], flag: str = "--dataset", config: str | None = None,
               extensions: tuple = (".json", ".jsonl", ".parquet"), hint: str | None = None) -> datasets.Dataset:
    """One split of a hub data set (config: its configuration name, if it has several) or of a local file or folder,
    checked for the columns we need; a one-line error that names the flag to fix otherwise (and HINT, if given, for a
    missing column)."""
    kinds = f"{', '.join(extensions[:-1])} or {extensions[-1]}"
    if not os.path.exists(dataset) and not is_hub_name(dataset):
        fail(f"no data set at {dataset!r}; check {flag}")
    if os.path.isdir(dataset):
        check_data_folder(dataset, flag, split)
    if os.path.isfile(dataset) and not dataset.endswith(extensions):
        fail(f"{flag} {dataset!r} is not a {kinds} file")
    if os.path.isfile(dataset) and os.path.getsize(dataset) == 0:
        fail(f"{flag} {dataset!r} is an empty file")
    try:
        if os.path.isfile(dataset):  # one file is every split; a slice such as train[:64] still applies
            kind = {".txt": "text", ".parquet": "parquet"}.get(os.path.splitext(dataset)[1], "json")
            data = datasets.load_dataset(kind, data_files={split.split("[")[0]: dataset}, split=split)
        else:
            data = datasets.load_dataset(dataset, config, split=split)
    except RuntimeError as error:  # a data set (here or on the hub) that comes as a loading script
        if "Dataset scripts are no longer supported" not in str(error):
            raise
        fail(f"{flag} {dataset!r} comes with a loading script ({str(error).split('found ')[-1]}): code, which is never "
             f"run here; give the data as {kinds} files")
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as error:
        error = error.__cause__ or error  # the generation error's cause says which row is malformed
        if os.path.isfile(dataset) and dataset.endswith(".jsonl"):  # name the line, which datasets does not
            with open(dataset, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    try:
                        json.loads(line) if line.strip() else None
                    except ValueError as bad:
                        fail(f"line {number} of {dataset!r} is not valid JSON ({bad}); fix or remove it")
        fail(f"cannot load split {split!r} of data set {dataset!r} ({' '.join(str(error).split())[:300]}); check "
             f"{flag} (a UTF-8 {kinds} file) and the split flags")
    missing = [c for c in columns if c not in data.column_names]
    if missing:
        hh_rlhf = {"chosen", "rejected"} <= set(data.column_names) and hint is None
        fail(f"data set {dataset!r} split {split!r} has no column {missing}; its columns are {data.column_names}"
             + ("; if 'chosen' and 'rejected' each hold the whole conversation (the hh-rlhf layout), pass "
                "--split-conversations (ppo.py and evaluate.py also --prompt-column chosen)" if hh_rlhf else "")
             + (f"; {hint}" if hint else ""))
    try:  # pyarrow loads bytes that are not UTF-8 into a text column: reading that row would fail with a traceback
        data.select_columns(columns).data.validate(full=True)
    except ValueError as error:
        fail(f"data set {dataset!r} split {split!r} is not UTF-8 text ({error}); save it as UTF-8")
    return data

def text_of(row: dict, i: int, column: str, split: str) -> str:
    """The text in one cell of the data, or an error that names the row, the column and what is wrong with it."""
    value = row[column]
    problem = ("empty (null)" if value is None else f"a value of type {type(value).__name__}, not text"
               if not isinstance(value, str) else "empty text" if not value.strip() else None)
    if problem:
        fail(f"row {i} of split {split!r}, column {column!r}: {problem}; fix or remove the row")
    return value

def split_conversation(text: str, assistant_marker: str, where: str) -> tuple[str, str]:
    """A whole conversation (hh-rlhf) -> (prompt up to and including its last assistant marker, response)."""
    cut = text.rfind(assistant_marker)
    if cut < 0:
        fail(f"{where}: no {assistant_marker!r} to split the conversation at; check --assistant-marker")
    prompt, response = text[: cut + len(assistant_marker)], text[cut + len(assistant_marker) :]
    if not response.strip():
        fail(f"{where}: nothing after the last {assistant_marker!r}; fix or remove the row")
    return prompt, response

def prompt_ids(tokenizer, row: dict, i: int, column: str, split: str, assistant_marker: str | None = None) -> list:
    """The token ids of one row's prompt: text as it is (a spelled "<|endoftext|>" stays text, never a real EOS), with
    assistant_marker a conversation cut at its last one, or {"role", "content"} messages through the chat template."""
    value, where = row[column], f"row {i} of split {split!r}, column {column!r}"
    if not isinstance(value, list):
        text = text_of(row, i, column, split)
        if assistant_marker is not None:
            text = split_conversation(text, assistant_marker, where)[0]
        ids = tokenizer(text, split_special_tokens=True)["input_ids"]
        if not ids:  # a forward pass over no token at all fails deep inside the model
            fail(f"{where}: the prompt {text[:40]!r} is no token at all in this tokenizer (its normalizer drops the "
                 "text); fix or remove the row, or use a tokenizer that reads it")
        return ids
    if not value or not all(isinstance(message, dict) and isinstance(message.get("role"), str)
                            and isinstance(message.get("content"), str) for message in value):
        kinds = sorted({type(item).__name__ for item in value}) or ["nothing"]
        fail(f"{where}: a list of {' and '.join(kinds)}, neither text nor chat messages ({{'role': ..., 'content': "
             "...} with text content); fix or remove the row")
    if tokenizer.chat_template is None:
        fail(f"{where} holds chat messages, but the tokenizer has no chat template; use a tokenizer that has one (an "
             "instruct or chat model's) or give the prompts as text")
    # The template's text is tokenized with its markers as real tokens: a message that spells one would fake a turn.
    spelled = [token for token in tokenizer.get_added_vocab() if any(token in m["content"] for m in value)]
    if spelled:
        fail(f"{where}: a message spells the token {spelled[0]!r}, which the chat template would read as the real "
             "one; fix or remove the row")
    text = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

def response_ids(tokenizer, text: str, where: str) -> list:
    """The token ids of a response, then EOS (a spelled "<|endoftext|>" stays text); one line naming WHERE for one that
    is no token at all, which would teach, or be scored as, an empty answer."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if not ids:
        fail(f"{where}: the response {text[:40]!r} is no token at all in this tokenizer (its normalizer drops the "
             "text); fix or remove the row, or use a tokenizer that reads it")
    return ids + [tokenizer.eos_token_id]

def load_text_blocks(tokenizer, dataset: str, config: str | None, column: str, block_len: int, min_blocks: int,
                     flag: str = "--unsup-dataset", column_flag: str = "--unsup-text-column") -> torch.Tensor:
    """Plain text (a .txt file, a column of a data file, or a hub data set), tokenized, joined with EOS between
    documents and cut into blocks of BLOCK_LEN tokens, at least MIN_BLOCKS of them: [blocks, block_len]."""
    data = load_split(dataset, "train", [column], flag, config, (".txt", ".json", ".jsonl", ".parquet"),
                      hint=f"{flag} is plain text to learn from: a .txt file, or a data set whose column of text "
                           f"{column_flag} names")
    texts = [text for text in data[column] if isinstance(text, str) and text.strip()]
    if not texts:
        fail(f"{flag} {dataset!r} holds no text, only blank lines or empty cells")
    stream = [t for ids in tokenizer(texts, split_special_tokens=True)["input_ids"]
              for t in ids + [tokenizer.eos_token_id]]
    num_blocks = len(stream) // block_len
    if num_blocks < min_blocks:
        fail(f"{flag} {dataset!r} holds {len(stream)} tokens, fewer than one micro-batch of {min_blocks} blocks of "
             f"{block_len}; give it more text")
    return torch.tensor(stream[: num_blocks * block_len]).view(num_blocks, block_len)

def refuse_repeated_prompt(prompt, responses: dict[str, str], i: int, split: str) -> None:
    """Stop on the hh-rlhf layout read as if it were not: every response (column -> text) begins with the prompt."""
    if isinstance(prompt, str) and all(response.startswith(prompt) for response in responses.values()):
        fail(f"row {i} of split {split!r}: {' and '.join(map(repr, responses))} begin with the prompt (the hh-rlhf "
             "layout); pass --split-conversations to cut the prompt from each whole conversation")

def load_prompts(tokenizer, dataset: str, split: str, column: str, max_prompt_len: int, is_main: bool,
                 assistant_marker: str | None = None) -> list:
    """The token ids of every prompt of a split that fits max_prompt_len; longer ones are dropped and counted."""
    data = load_split(dataset, split, [column])
    hh_rlhf = {"chosen", "rejected"} <= set(data.column_names)
    if assistant_marker is None and column in ("chosen", "rejected") and hh_rlhf:
        fail(f"column {column!r} of {dataset!r} holds whole conversations, answers included (the hh-rlhf layout); pass "
             "--split-conversations to take each prompt up to its last assistant marker")
    prompts, too_long = [], 0
    for i, row in enumerate(data):
        ids = prompt_ids(tokenizer, row, i, column, split, assistant_marker)
        if len(ids) > max_prompt_len:
            too_long += 1
        else:
            prompts.append(ids)
    if too_long and is_main:
        print(f"dropped {too_long} of {len(data)} prompts longer than --max-prompt-len {max_prompt_len}")
    if not prompts:
        fail(f"no prompt of split {split!r} fits --max-prompt-len {max_prompt_len}; raise it")
    return prompts
