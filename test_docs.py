"""The docs name only what exists. README.md and docs/*.md are read as text; what the repository's .py files define
is read from their modules, imported by name as the tests import them (no script's main runs): a few seconds.

What is collected, from inline code spans (`...`) and fenced code blocks, and what each must be:
- a file: a token ending in .py .md .txt .json .jsonl .sh .png, or starting with toy_task/ docs/ .ci/, must exist,
  relative to the repository root (`./x` is `x`; a token with `*` must match something). A markdown link's target,
  relative to the page, must exist too, and its #anchor must be a heading of the page it names.
  Skipped, by these explicit rules only: a bare extension such as `.json`; paths that a run creates, starting with
  one of RUN_CREATED_PREFIXES; and the file names in RUN_CREATED_FILES, which the scripts write inside the folders
  they make.
- a function: `module.name` (module one of the repository's .py files, by its stem) must be a function, class or
  value that module defines at its top level (not one it imports); a bare `name()` in an inline span must be a
  function of a module of the repository or a method of one of its classes.
- a flag: `--some-flag` must be a field of a script's `Args` dataclass (field foo_bar is --foo-bar, and a bool field
  also gives --no-foo-bar), or one of LAUNCHER_FLAGS. In a command, a code-block line (continuations joined) or one
  inline span, a flag that follows a script's name must be a field of that script's Args; any other flag may be a
  field of any script's Args.
- detail numbers: docs/implementation_details.md numbers its details 1, 2, ... as headings; the README lists some of
  them, each at most two lines, linking to the heading of the same number; every "detail N" in the docs and every
  "README detail N" / "detail N" in a .py file names one of them. One with "N+" in the 60 characters before it cites
  the N+ implementation details, another numbering, and is skipped.
- the README's Quick start runs the demo and then the test command that .ci/run runs (that every metric a stage logs is in the README's guide is
  test_sft_and_reward_model.py's, from what short runs of the stages log).
- README.md is at most 22,000 bytes.
- the functions the README offers to copy (every function of rlhf_math.py, the `ppo.NAME`s of its "Functions to
  copy") each run pasted alone: in a file of their own with what their docstring says a paste needs, in a fresh
  process, giving what the function itself gives. That test is the one that reads source, the reader's paste.

And the tests and benchmark.py reach the code through its functions and module attributes, never by parsing its
source or reading stack frames (STYLE.md): no line of theirs uses one of READING_SOURCE_OR_FRAMES.
"""

import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent
README = ROOT / "README.md"
DETAILS = ROOT / "docs" / "implementation_details.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FILE_SUFFIXES = (".py", ".md", ".txt", ".json", ".jsonl", ".sh", ".png")
FILE_PREFIXES = ("toy_task/", "docs/", ".ci/")
# Paths that a run creates (the stages' output folders and logs, evaluate.py's figures; placeholders in capitals).
RUN_CREATED_PREFIXES = ("checkpoints/", "runs/", "OUTPUT_DIR/", "PPO_MODEL/")
# Files the scripts write inside the folders they make (a saved model, a run's logs, a resume checkpoint).
RUN_CREATED_FILES = {"training_run.json", "metrics.jsonl", "state.json", "config.json", "generation_config.json",
                     "evaluation.json", "benchmark.json", "ppo_training.png", "overoptimization.png"}
# Flags of the deepspeed launcher (written with underscores, as it spells them), of torchrun and SLURM's sbatch in
# the multi-node recipes, and of every tyro script.
LAUNCHER_FLAGS = {"--num_gpus", "--num_nodes", "--master_port", "--master_addr", "--hostfile", "--include",
                  "--exclude", "--local_rank", "--no_ssh", "--node_rank", "--launcher", "--help",
                  "--nnodes", "--node-rank", "--nproc-per-node", "--master-addr", "--master-port",
                  "--nodes", "--ntasks-per-node", "--gpus-per-node"}
README_MAX_BYTES = 22_000


def python_files() -> list[Path]:
    """The repository's own .py files: none under hidden folders (.venv, .git) or the run outputs."""
    found, skip = [], {"checkpoints", "runs", "__pycache__"}
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if not s.startswith(".") and s not in skip]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def module_of(path: Path) -> types.ModuleType:
    """The module of a repository .py file, imported by its dotted name from the root (toy_task/gold_judge.py is
    toy_task.gold_judge, plumbing/__init__.py is plumbing): the module object the tests use, when they have imported
    it already."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))


def name_in_docs(path: Path) -> str:
    """What the docs call a .py file's module: its stem, or for a package's modules (plumbing/folders.py) the package,
    whose names the stages reach as plumbing.NAME."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if (ROOT / parts[0] / "__init__.py").exists() else path.stem


# What the import system sets in every module: not names the module defines.
IMPORT_SYSTEM_NAMES = {"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__file__", "__cached__",
                       "__builtins__"}


def own_function_or_class(value, module: types.ModuleType) -> bool:
    """Whether value is a function (decorated or not: a cache, a pytest fixture) or a class defined in module."""
    value = inspect.unwrap(value) if callable(value) else value
    return isinstance(value, (types.FunctionType, type)) and value.__module__ == module.__name__


def top_level_names(module: types.ModuleType) -> set[str]:
    """The names a module defines: its functions and classes (not those it imports, which name another module as
    theirs), and its other values, except those bound to the same object under the same name in a module it imports
    from (one it holds, or the module of one of its values)."""
    bound = vars(module)
    origins = {getattr(value, "__module__", None) for value in bound.values()}
    sources = {value for value in bound.values() if isinstance(value, types.ModuleType)} | {
        sys.modules[origin] for origin in origins if origin in sys.modules}
    sources.discard(module)
    names = set()
    for name, value in bound.items():
        if name in IMPORT_SYSTEM_NAMES or isinstance(value, types.ModuleType):
            continue
        if callable(value) and isinstance(inspect.unwrap(value), (types.FunctionType, type)):
            if own_function_or_class(value, module):
                names.add(name)
        elif not any(name in vars(source) and vars(source)[name] is value for source in sources):
            names.add(name)
    return names


def function_names(module: types.ModuleType) -> set[str]:
    """The names of a module's own functions and of the methods of its own classes (nested classes too)."""
    def methods(cls: type) -> set[str]:
        names = set()
        for name, value in vars(cls).items():
            value = getattr(value, "__func__", value)  # a staticmethod's or classmethod's function
            if isinstance(value, property):
                names.update(name for accessor in (value.fget, value.fset, value.fdel) if accessor)
            elif isinstance(value, type) and value.__qualname__.startswith(cls.__qualname__ + "."):
                names |= methods(value)
            elif callable(value) and isinstance(inspect.unwrap(value), types.FunctionType):
                names.add(name)
        return names

    names = set()
    for name, value in vars(module).items():
        if own_function_or_class(value, module):
            names |= methods(value) if isinstance(value, type) else {name}
    return names


def args_flags(module: types.ModuleType) -> set[str] | None:
    """The --flags of a module's own `Args` dataclass, or None if it has none."""
    args = vars(module).get("Args")
    if not (own_function_or_class(args, module) and dataclasses.is_dataclass(args)):
        return None
    annotations = typing.get_type_hints(args, include_extras=True)
    flags = set()
    for field in dataclasses.fields(args):
        flag = "--" + field.name.replace("_", "-")
        flags.add(flag)
        annotation = annotations[field.name]  # bool, or Annotated[bool, ...]
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        if annotation is bool:
            flags.add("--no-" + flag[2:])
    return flags


PY_FILES = python_files()


def repository_modules() -> dict[Path, types.ModuleType]:
    """Each .py file's module, imported when a test asks (at this file's import, this module would be half made)."""
    return {path: module_of(path) for path in PY_FILES}


def split_markdown(text: str) -> tuple[list[tuple[int, str]], str]:
    """(code-block lines as (line number, logical line, continuations joined), the text outside code blocks)."""
    code, prose, fence, pending = [], [], False, None
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            prose.append("")
            continue
        if not fence:
            prose.append(line)
            continue
        prose.append("")
        if pending:
            start, joined = pending
            line, number = joined + " " + line.strip(), start
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
        else:
            pending = None
            code.append((number, line))
    return code, "\n".join(prose)


def spans_and_lines(path: Path) -> list[tuple[str, str, bool]]:
    """Every inline code span and every code-block line of a page: (where, text, is_inline_span)."""
    code, prose = split_markdown(path.read_text())
    name = path.relative_to(ROOT).as_posix()
    found = [(f"{name}:{number}", line, False) for number, line in code]
    for match in re.finditer(r"`([^`]+)`", prose):
        number = prose.count("\n", 0, match.start()) + 1
        found.append((f"{name}:{number}", match.group(1).replace("\n", " "), True))
    return found


def links(path: Path) -> list[tuple[str, str]]:
    """Every markdown link or image target outside code: (where, target)."""
    _, prose = split_markdown(path.read_text())
    prose = re.sub(r"`[^`]+`", lambda span: "\n" * span.group(0).count("\n"), prose)  # keeps the line numbers
    name = path.relative_to(ROOT).as_posix()
    return [(f"{name}:{prose.count(chr(10), 0, m.start()) + 1}", m.group(1))
            for m in re.finditer(r"\]\(([^)\s]+)\)", prose)]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    _, prose = split_markdown(path.read_text())
    return {re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", prose, re.M)}


def tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[\s,;()\[\]{}<>\"'=|]+", text) if t]


def is_file_token(token: str) -> bool:
    return token.endswith(FILE_SUFFIXES) or token.startswith(FILE_PREFIXES)


def test_readme_is_at_most_22_kb():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move long material to docs/"


def test_named_files_exist():
    missing = []
    for page in PAGES:
        for where, text, _ in spans_and_lines(page):
            for token in tokens(text):
                token = token.rstrip(".:").removeprefix("./")
                if not is_file_token(token) or re.fullmatch(r"\.\w+", token):
                    continue  # not a path, or a bare extension such as .json
                if token.startswith(RUN_CREATED_PREFIXES) or token in RUN_CREATED_FILES:
                    continue  # made by a run
                exists = any(ROOT.glob(token)) if "*" in token else (ROOT / token).exists()
                if not exists:
                    missing.append(f"{where}: {token}")
        for where, target in links(page):
            if re.match(r"\w+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                missing.append(f"{where}: link to {target}")
            elif anchor and anchor not in heading_anchors(linked):
                missing.append(f"{where}: link to {target}: no such heading in {linked.relative_to(ROOT)}")
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)


def test_named_functions_are_defined():
    modules_by_path = repository_modules()
    defined = {}
    for path, module in modules_by_path.items():
        defined.setdefault(name_in_docs(path), set()).update(top_level_names(module))
    functions = set().union(*map(function_names, modules_by_path.values()))
    modules = "|".join(sorted(defined, key=len, reverse=True))
    missing = []
    for page in PAGES:
        for where, text, inline in spans_and_lines(page):
            for module, name in re.findall(rf"(?<![\w.])({modules})\.([A-Za-z_]\w*)", text):
                if "." + name in FILE_SUFFIXES:
                    continue  # a file name such as ppo.py
                if name not in defined[module]:
                    missing.append(f"{where}: {module}.{name} (not defined in {module}.py)")
            if inline:
                for name in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\(\)", text):
                    if name not in functions:
                        missing.append(f"{where}: {name}() (no function or method of that name in any .py file)")
    assert not missing, "functions named in the docs that are not defined:\n" + "\n".join(missing)


def test_named_flags_exist():
    script_flags = {path.relative_to(ROOT).as_posix(): flags for path, module in repository_modules().items()
                    if (flags := args_flags(module)) is not None}
    any_script_flag = set().union(*script_flags.values())
    scripts = "|".join(re.escape(s) for s in sorted(script_flags, key=len, reverse=True))
    missing = []
    for page in PAGES:
        for where, text, _ in spans_and_lines(page):
            script = None  # the script whose flags follow, in this command
            for match in re.finditer(rf"(?<![\w/.-])({scripts})(?![\w.])|(?<![\w-])(--[A-Za-z][\w-]*)", text):
                if match.group(1):
                    script = match.group(1)
                    continue
                flag = match.group(2)
                if flag in LAUNCHER_FLAGS:
                    continue
                if script and flag not in script_flags[script]:
                    missing.append(f"{where}: {flag} (not a flag of {script})")
                elif not script and flag not in any_script_flag:
                    missing.append(f"{where}: {flag} (not a flag of any script)")
    assert not missing, "flags named in the docs that no script has:\n" + "\n".join(missing)


def detail_numbers() -> list[int]:
    return [int(n) for n in re.findall(r"^### (\d+)\. ", DETAILS.read_text(), re.M)]


def detail_references(text: str) -> list[tuple[int, int]]:
    """(line number, N) of every "detail N" ("details N, M and K", "details N to M") that is not the N+
    implementation details' numbering."""
    found = []
    for match in re.finditer(r"\bdetails?\s+(\d+(?:(?:,\s*|\s+and\s+|\s+to\s+)\d+)*)", text):
        if "N+" in text[max(0, match.start() - 60) : match.start()]:
            continue
        line = text.count("\n", 0, match.start()) + 1
        for first, last in re.findall(r"(\d+)(?:\s+to\s+(\d+))?", match.group(1)):
            found += [(line, n) for n in range(int(first), int(last or first) + 1)]
    return found


def test_detail_numbers():
    numbers = detail_numbers()
    assert numbers == list(range(1, len(numbers) + 1)), \
        f"docs/implementation_details.md must number its details 1, 2, ... as '### N. title' headings: {numbers}"
    problems = []
    readme = README.read_text()
    items = re.findall(r"^- \*\*\[(\d+)\. [^\]]*\]\(docs/implementation_details\.md#([^)]*)\)\.\*\*.*\n(?:  .*\n)*",
                       readme, re.M)
    if not items:
        problems.append("README.md lists no detail as '- **[N. title](docs/implementation_details.md#anchor).**'")
    for item in re.finditer(r"^- \*\*\[(\d+)\. .*\n(?:  .*\n)*", readme, re.M):
        lines = item.group(0).rstrip("\n").count("\n") + 1
        if lines > 2:
            problems.append(f"README.md: detail {item.group(1)} takes {lines} lines, not at most 2")
    for number, anchor in items:
        if int(number) not in numbers:
            problems.append(f"README.md: detail {number} is not in docs/implementation_details.md")
        elif not anchor.startswith(f"{number}-"):
            problems.append(f"README.md: detail {number} links to #{anchor}, another detail's heading")
    for page in PAGES:
        for line, number in detail_references(page.read_text()):
            if number not in numbers:
                problems.append(f"{page.relative_to(ROOT)}:{line}: detail {number} does not exist")
    for path in PY_FILES:
        if path.name == Path(__file__).name:
            continue
        for line, number in detail_references(path.read_text()):
            if number not in numbers:
                problems.append(f"{path.relative_to(ROOT)}:{line}: detail {number} does not exist")
    assert not problems, "detail numbers that do not match docs/implementation_details.md:\n" + "\n".join(problems)


def test_the_readme_test_command_is_what_ci_runs():
    """The README's Quick start is two lines that run as written in a new shell, the demo (which makes .venv) and the
    suite in .venv's Python; .ci/run makes .venv as the demo does and ends with that same line."""
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#")]
    quick_start = [line.split("#")[0].strip() for line in README.read_text().split("```bash\n")[1].split("```")[0]
                   .splitlines()]
    assert quick_start == ["./demo.sh", ".venv/bin/python -m pytest -q"] == ["./demo.sh", ci_commands[-1]], \
        f"README.md's Quick start {quick_start} must end with what .ci/run runs, {ci_commands[-1]!r}"
    assert "python3 -m venv .venv" in ci_commands and "python3 -m venv .venv" in (ROOT / "demo.sh").read_text()


# What reads a module's source or a running function's frames: each a regular expression, written in two parts so
# that this list is not a use of it, and what it does. The scan of test_no_test_reads_source_or_stack_frames.
READING_SOURCE_OR_FRAMES = [
    (r"\b_get" r"frame\b", "reads a caller's stack frame"),
    (r"\bcurrent" r"frame\b", "reads a stack frame"),
    (r"\bf_" r"(globals|locals|back)\b", "reads a frame's variables or its caller"),
    (r"\btb_" r"frame\b", "reads a traceback's frame"),
    (r"\binspect\.(st" r"ack|tr" r"ace)\b", "reads the stack"),
    (r"\b(get" r"outerframes|get" r"innerframes|get" r"frameinfo|_current_" r"frames)\b", "reads stack frames"),
    (r"\b(set" r"trace|set" r"profile)\b", "reads every frame a call runs"),
    (r"\bget" r"source", "reads a module's or a function's source"),
    (r"\bimport a" r"st\b|\ba" r"st\.", "parses source"),
    (r"(?<![\w.])com" r"pile\(", "compiles source of its own making"),
    (r"\brun" r"py\b", "runs a script as __main__, out of reach of its module's attributes"),
]
SEAM = ("Reach the code through its functions instead: the script's main(args) called directly "
        "(test_sft_and_reward_model.run_in_process), with helpers patched through its module "
        "(monkeypatch.setattr(ppo, NAME, ...)), and what a test records taken from the values the code passes to a "
        "helper it calls anyway")


def test_no_test_reads_source_or_stack_frames():
    """Reading a script's source or a running function's frames freezes the file's shape (which helper holds which
    variable, which line follows which), the shape a reader needs us free to improve (STYLE.md). The one exception is
    the reader's paste (PASTE), whose subject is a function's source, and which stays in test_docs.py."""
    found = []
    for path in sorted([*ROOT.glob("test_*.py"), ROOT / "conftest.py", ROOT / "benchmark.py"]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.endswith(PASTE) and path.name == "test_docs.py":
                continue
            for pattern, what in READING_SOURCE_OR_FRAMES:
                if match := re.search(pattern, line):
                    found.append(f"{path.name}:{number}: {match.group(0)!r} {what}: {line.strip()[:100]}")
    assert not found, "tests that read source or stack frames:\n" + "\n".join(found) + "\n" + SEAM


# The mark of the lines that copy a function's source as a reader does (test_functions_to_copy_run_pasted_alone).
PASTE = "# the reader's paste"
NEEDS = "Pasted alone it needs"


def paste_needs(function) -> tuple[list[str], list[str]]:
    """What the docstring of FUNCTION says a paste of it needs: (import lines, names of its module's helpers and
    values); a function that says nothing needs `import torch` alone (the README, rlhf_math.py's docstring)."""
    doc = " ".join((inspect.getdoc(function) or "").split())
    if NEEDS not in doc:  # (the README: then `import torch` alone)
        return ["import torch"], []
    sentence = re.split(r"\.(?:\s|$)", doc.split(NEEDS, 1)[1])[0]
    names = [name for name in re.findall(r"[A-Za-z_]\w*", re.sub(r"`[^`]*`", "", sentence)) if name != "and"]
    return re.findall(r"`([^`]*)`", sentence), names


def functions_to_copy() -> list:
    """Every function of rlhf_math.py, the ppo.NAMEs that the README's "Functions to copy" names, and the functions
    their docstrings name as what a paste needs."""
    import ppo
    import rlhf_math
    section = README.read_text().split("## Functions to copy", 1)[1].split("\n## ", 1)[0]
    named = [getattr(ppo, name) for name in re.findall(r"`ppo\.(?!py`)(\w+)`", section)]
    named += [getattr(ppo, name) for function in named for name in paste_needs(function)[1]
              if inspect.isfunction(getattr(ppo, name))]
    return [value for value in vars(rlhf_math).values() if inspect.isfunction(value) and
            value.__module__ == "rlhf_math"] + list(dict.fromkeys(named))


# The child: each pasted function against the function itself, on the same inputs (the toy task's tokenizer and
# base model for ppo's), and from the same seed. It prints "ok MODULE.NAME" for each that gives the same.
PASTES_RUN = r"""
import importlib, sys
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
import ppo, rlhf_math
sys.path.insert(0, sys.argv[1])
torch.manual_seed(0)
mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
x, y, z, logits = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5, 7)
tokens = torch.randint(7, (3, 5))
tokenizer = AutoTokenizer.from_pretrained("toy_task/base_model", padding_side="left")
policy = AutoModelForCausalLM.from_pretrained("toy_task/base_model").eval()
critic = AutoModelForSequenceClassification.from_pretrained("toy_task/base_model", num_labels=1).eval()
prompts = tokenizer(["The story", "I watched this film last night and"], padding=True, return_tensors="pt")
P, config = prompts["input_ids"].shape[1], ppo.sampling_config(tokenizer, 6, 0.7)
with torch.no_grad():
    responses = ppo.sample(policy, prompts["input_ids"], prompts["attention_mask"], config)
S = torch.cat([prompts["input_ids"], responses], dim=1)
A = torch.cat([prompts["attention_mask"], rlhf_math.response_mask_from_stop(responses, tokenizer.eos_token_id)], 1)
CASES = {
    "rlhf_math.logprobs_from_logits": (logits, tokens, 0.7), "rlhf_math.entropy_from_logits": (logits, 0.7),
    "rlhf_math.masked_mean": (x, mask), "rlhf_math.masked_var": (x, mask),
    "rlhf_math.mean_var_from_moments": (torch.tensor(4.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64),
                                        torch.tensor(3.0, dtype=torch.float64)),
    "rlhf_math.masked_whiten": (x, mask), "rlhf_math.first_true_index": (tokens == 3,),
    "rlhf_math.response_mask_from_stop": (tokens, 3), "rlhf_math.kl_per_token": (x, y, "k3"),
    "rlhf_math.per_token_rewards": (z[:, 0], x, y, mask, 0.1, 1.0),
    "rlhf_math.adaptive_kl_coef": (0.1, 7.0, 6.0, 1e4, 64),
    "rlhf_math.gae_advantages_and_returns": (x, y, mask, 0.9, 0.8), "rlhf_math.policy_loss": (x, y, z, mask),
    "rlhf_math.value_loss": (x, y, z, mask), "rlhf_math.ema_update": (x, y, 0.9),
    "rlhf_math.pairwise_reward_loss": (x[:, 0], y[:, 0], 0.5),
    "ppo.sampling_config": (tokenizer, 6, 0.7), "ppo.sample": (policy, prompts["input_ids"], prompts["attention_mask"],
                                                               config),
    "ppo.generation_settings": (policy, config), "ppo.position_ids_from": (A,),
    "ppo.response_logits": (policy, S, A, P), "ppo.response_logprobs": (policy, S, A, P, 0.7),
    "ppo.head_at_every_position": (critic, S, A), "ppo.critic_values": (critic, S, A, P, 0.5, 2.0),
    "ppo.in_micro_batches": (ppo.response_logprobs, 1, policy, S, A, P, 0.7),
}

def same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if hasattr(a, "to_dict"):
        return a.to_dict() == b.to_dict()
    return a == b

for case, args in CASES.items():
    module, name = case.split(".")
    results = []
    for function in (getattr(sys.modules[module], name), getattr(importlib.import_module(f"paste_{name}"), name)):
        torch.manual_seed(2)
        with torch.no_grad():
            results.append(function(*args))
    assert same(*results), case
    print("ok", case)
"""


def test_functions_to_copy_run_pasted_alone(tmp_path):
    """Each function the README offers to copy, pasted into a file of its own with only what its docstring names
    (imports, and its module's helpers and values: none of plumbing's), runs in a fresh process and gives what the
    function itself gives; a helper left unnamed, or a call into plumbing, stops it with a NameError."""
    functions = functions_to_copy()
    assert {function.__name__ for function in functions} >= {"sample", "response_logprobs", "critic_values"}
    for function in functions:
        imports, names = paste_needs(function)
        module = sys.modules[function.__module__]
        parts = [inspect.getsource(getattr(module, name)) if callable(getattr(module, name))  # the reader's paste
                 else f"{name} = {getattr(module, name)!r}\n" for name in names]
        paste = "\n".join(imports) + "\n\n\n" + "\n\n".join(parts + [inspect.getsource(function)])  # the reader's paste
        assert "plumbing" not in paste, f"{function.__name__} reaches plumbing/, which a paste does not have"
        (tmp_path / f"paste_{function.__name__}.py").write_text(paste)
    result = subprocess.run([sys.executable, "-c", PASTES_RUN, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    ran = set(re.findall(r"^ok (\S+)$", result.stdout, re.MULTILINE))
    assert ran == {f"{function.__module__}.{function.__name__}" for function in functions}, ran
