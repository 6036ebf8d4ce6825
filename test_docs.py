"""The docs name only what exists. README.md and docs/*.md are read as text and the repository's scripts are parsed
with ast (none is imported, nothing runs), so this takes well under a second.

What is collected, from inline code spans (`...`) and fenced code blocks, and what each must be:
- a file: a token ending in .py .md .txt .json .jsonl .sh .png, or starting with toy_task/ docs/ .ci/, must exist,
  relative to the repository root (`./x` is `x`; a token with `*` must match something). A markdown link's target,
  relative to the page, must exist too, and its #anchor must be a heading of the page it names.
  Skipped, by these explicit rules only: a bare extension such as `.json`; paths that a run creates, starting with
  one of RUN_CREATED_PREFIXES; and the file names in RUN_CREATED_FILES, which the scripts write inside the folders
  they make.
- a function: `module.name` (module one of the repository's .py files, by its stem) must be a top-level def, class
  or assignment of that file; a bare `name()` in an inline span must be a def somewhere in the repository.
- a flag: `--some-flag` must be a field of a script's `Args` dataclass (field foo_bar is --foo-bar, and a bool field
  also gives --no-foo-bar), or one of LAUNCHER_FLAGS. In a command, a code-block line (continuations joined) or one
  inline span, a flag that follows a script's name must be a field of that script's Args; any other flag may be a
  field of any script's Args.
- detail numbers: docs/implementation_details.md numbers its details 1, 2, ... as headings; the README lists some of
  them, each at most two lines, linking to the heading of the same number; every "detail N" in the docs and every
  "README detail N" / "detail N" in a .py file names one of them. One with "N+" in the 60 characters before it cites
  the N+ implementation details, another numbering, and is skipped.
- every metric name the stages log appears in the README, and the README's test command is the one .ci/run runs.
- README.md is at most 25,000 bytes.
"""

import ast
import os
import re
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
METRIC_PREFIXES = ("objective", "policy", "loss", "val", "time", "memory", "train", "eval", "charts")
README_MAX_BYTES = 25_000


def python_files() -> list[Path]:
    """The repository's own .py files: none under hidden folders (.venv, .git) or the run outputs."""
    found, skip = [], {"checkpoints", "runs", "__pycache__"}
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if not s.startswith(".") and s not in skip]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def args_flags(tree: ast.Module) -> set[str] | None:
    """The --flags of a script's `Args` dataclass, or None if it has none."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            flags = set()
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
                    flag = "--" + field.target.id.replace("_", "-")
                    flags.add(flag)
                    annotation = field.annotation  # bool, or Annotated[bool, ...]
                    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in {
                            "Annotated", "typing.Annotated"} and isinstance(annotation.slice, ast.Tuple):
                        annotation = annotation.slice.elts[0]
                    if isinstance(annotation, ast.Name) and annotation.id == "bool":
                        flags.add("--no-" + flag[2:])
            return flags
    return None


PY_FILES = python_files()
TREES = {p: parse(p) for p in PY_FILES}
MODULES = {p.stem: top_level_names(tree) for p, tree in TREES.items()}
ALL_DEFS = {node.name for tree in TREES.values() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
SCRIPT_FLAGS = {p.relative_to(ROOT).as_posix(): flags for p, tree in TREES.items()
                if (flags := args_flags(tree)) is not None}
ANY_SCRIPT_FLAG = set().union(*SCRIPT_FLAGS.values())


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


def test_readme_is_at_most_25_kb():
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
    modules = "|".join(sorted(MODULES, key=len, reverse=True))
    missing = []
    for page in PAGES:
        for where, text, inline in spans_and_lines(page):
            for module, name in re.findall(rf"(?<![\w.])({modules})\.([A-Za-z_]\w*)", text):
                if "." + name in FILE_SUFFIXES:
                    continue  # a file name such as ppo.py
                if name not in MODULES[module]:
                    missing.append(f"{where}: {module}.{name} (no def in {module}.py)")
            if inline:
                for name in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\(\)", text):
                    if name not in ALL_DEFS:
                        missing.append(f"{where}: {name}() (no def in any .py file)")
    assert not missing, "functions named in the docs that are not defined:\n" + "\n".join(missing)


def test_named_flags_exist():
    scripts = "|".join(re.escape(s) for s in sorted(SCRIPT_FLAGS, key=len, reverse=True))
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
                if script and flag not in SCRIPT_FLAGS[script]:
                    missing.append(f"{where}: {flag} (not a flag of {script})")
                elif not script and flag not in ANY_SCRIPT_FLAG:
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


def logged_metrics() -> set[str]:
    """The metric names in sft.py, reward_model.py and ppo.py: string constants such as "objective/kl", and every
    constant key of a dict that holds one of them (ppo.py's "lr", "episode", "eps")."""
    pattern = re.compile(rf"(?:{'|'.join(METRIC_PREFIXES)})/\w+")
    names = set()
    for script in ["sft.py", "reward_model.py", "ppo.py"]:
        for node in ast.walk(TREES[ROOT / script]):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.fullmatch(node.value):
                names.add(node.value)
            if isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
                if any(pattern.fullmatch(k) for k in keys):
                    names.update(keys)
    return names


def test_every_logged_metric_is_in_the_readme():
    named = {span for _, span, inline in spans_and_lines(README) if inline}
    missing = sorted(logged_metrics() - named)
    assert not missing, "metrics the stages log that the README's metrics guide does not name: " + ", ".join(missing)


def test_the_readme_test_command_is_what_ci_runs():
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#")]
    assert "python -m pytest -q" in README.read_text() and ci_commands[-1] == "python -m pytest -q", \
        f"README.md must show the test command that .ci/run runs; .ci/run ends with {ci_commands[-1]!r}"
