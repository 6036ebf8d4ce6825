"""Output folders, claimed and locked before anything loads and written whole (detail 40); records, logs, models."""

import atexit
import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import asdict

import safetensors.torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from .models import whole_state_dict
from .processes import fail, pid_alive, script


def folder_identity(path: str | None) -> str | None:
    """What identifies a model folder wherever it is, and tells it from another model, even one a weight or a token
    apart: a SHA-256 of the names and content of its model and tokenizer files (SAVED_FILE's but the record and
    generation config; about 1 GB/s). A hub name (or None) is itself."""
    if path is None or not os.path.isdir(path):
        return path
    digest = hashlib.sha256()
    for name in sorted(name for name in os.listdir(path) if SAVED_FILE.fullmatch(name)
                       and name not in (RECORD, "generation_config.json")):
        with open(os.path.join(path, name), "rb") as f:
            digest.update(f"{name} {os.fstat(f.fileno()).st_size}".encode())
            while block := f.read(2**24):
                digest.update(block)
    return digest.hexdigest()

RECORD = "training_run.json"  # in every folder a stage writes: the script, run name and arguments that wrote it

# A record's fields, each of its type: a record with one of another type is none that this project wrote.
RECORD_FIELDS = {"script": str, "finished": bool, "run_name": str, "metrics_file": str, "args": dict, "inputs": dict,
                 "files": list, "iteration": int}

def read_record(folder: str) -> dict | None:
    """The training_run.json of a folder, or None if it has none, only a link to one, or one that is not this project's
    (it does not parse, a field is of another type than RECORD_FIELDS says)."""
    with contextlib.suppress(OSError, ValueError, RecursionError), open(own_path(folder, RECORD, SAVED_FILE)
                                                                         or os.devnull) as f:
        record = json.load(f)
        if isinstance(record, dict) and all(isinstance(record[key], kind) for key, kind in RECORD_FIELDS.items()
                                            if key in record):
            return record
    return None

# Names read back from an output folder (its record, `latest`) are untrusted: own_path uses one only if it is of the
# kind this project writes there (one of these patterns: never a path, never hidden), and never through a link.
SAVED_FILE = re.compile(r"(model|adapter_model)(-\d+-of-\d+)?\.safetensors(\.index\.json)?|(config|generation_config|"
                        r"tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab|chat_template)\.json|"
                        r"(vocab|merges)\.txt|chat_template\.jinja|\w[\w.-]*\.(model|tiktoken)|training_run\.json")

ITERATION_FOLDER = re.compile(r"iteration_\d+")  # a checkpoint (resume/) or snapshot (snapshots/); .tmp while written
RUN_NAME = re.compile(r"[^/\x00]+__\d+__\d+(_\d+)?")  # new_run_name's: EXP_NAME__SEED__TIME, _N if taken

def own_path(folder: str, name, pattern: re.Pattern, is_dir: bool = False) -> str | None:
    """FOLDER/NAME if NAME (read back from a file: untrusted) is a name that this project writes in FOLDER (PATTERN)
    and a regular file there (is_dir: a folder), not a link; else None."""
    if not (isinstance(name, str) and pattern.fullmatch(name)):
        return None
    path = os.path.join(folder, name)
    mode = os.lstat(path).st_mode if os.path.lexists(path) else 0
    return path if (stat.S_ISDIR(mode) if is_dir else stat.S_ISREG(mode)) else None

def write_fix(error: OSError) -> str:
    """What to do about a failed write: a link or a folder where a file of the run goes, no permission, a full disk."""
    if error.errno == errno.ELOOP:
        return "it is a link, and a run never writes through one: remove the link"
    if error.errno == errno.EISDIR:
        return "a folder is in its place: move it away"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable"
    return "free some space"

def open_own(path: str, mode: str = "w"):
    """open(PATH, MODE), to write ("w", "wb") or append ("a"), for a file of the run's own: never through a link
    (O_NOFOLLOW), which would write over the file it points to."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o666), mode)

def write_json(path: str, value) -> None:
    """Write a JSON file whole or not at all (write_whole)."""
    write_whole(path, json.dumps(value, indent=1))

def write_whole(path: str, text: str) -> None:
    """Write a file whole or not at all, or one line: a new file of a fresh name beside it (never an entry there
    already, which may be linked to another file), flushed to disk and renamed into place."""
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:  # a full disk, a folder made read-only meanwhile
        if temporary:
            with contextlib.suppress(OSError):
                os.remove(temporary)
        fail(f"cannot write {path!r} ({error.strerror}); {write_fix(error)} and run again")

WRITE_ERRORS = (OSError, safetensors.SafetensorError)  # a full disk, a quota, a folder made read-only meanwhile

def stop_after_failed_write(error: Exception, partial: str, what: str, kept: str) -> None:
    """Stop with one line after a write failed: how much of PARTIAL (this run's folder) was written, removed now, and
    what is still whole (KEPT)."""
    written = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(partial) for name in names)
    shutil.rmtree(partial, ignore_errors=True)
    fail(f"cannot write {what} ({' '.join(str(error).split())[:200]}); the {written / 2**20:.1f} MB of it written are "
         f"removed again, and {kept}. Free some space and run again")

def fsync_tree(path: str) -> None:
    """Flush a folder's files and entries to disk: a rename after this names complete files, even after a power cut."""
    for root, _, files in os.walk(path):
        for name in files + ["."]:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

def check_output_dir(output_dir: str, inputs: dict[str, str | None]) -> None:
    """OUTPUT_DIR is not a file, a link to nowhere, or an input (INPUTS: flag -> path), holding one or inside one (a
    file written into a data set folder would be read as data next time)."""
    if os.path.isfile(output_dir):
        fail(f"--output-dir {output_dir!r} is a file; name a folder")
    if os.path.islink(output_dir) and not os.path.exists(output_dir):
        fail(f"--output-dir {output_dir!r} is a link to {os.readlink(output_dir)!r}, which does not exist; make that "
             "folder or name another")
    real = os.path.realpath(output_dir)
    for flag, path in inputs.items():
        if path and os.path.exists(path) and (os.path.realpath(path) + os.sep).startswith(real + os.sep):
            fail(f"--output-dir {output_dir!r} is or holds {flag} {path!r}, which this run reads; name another folder")
        if path and os.path.isdir(path) and real.startswith(os.path.realpath(path) + os.sep):
            fail(f"--output-dir {output_dir!r} is inside {flag} {path!r}, which this run reads (its files would "
                 "become part of it); name a folder outside it")

def refuse_entries_not_ours(output_dir: str, subfolders: list[str]) -> None:
    """Stop with one line where a run would write through a link in OUTPUT_DIR or its SUBFOLDERS, or over an entry of a
    run's names that no run left: a .saving (staging) that is not a folder, a .tmp (an unfinished write) that is
    neither a regular file nor a folder."""
    paths = [os.path.join(output_dir, name) for name in [".saving", *subfolders]]
    for path in list(paths):
        if os.path.isdir(path) and not os.path.islink(path):
            paths += [os.path.join(root, name) for root, folders, files in os.walk(path) for name in folders + files]
    if os.path.isdir(output_dir):
        paths += [os.path.join(output_dir, name) for name in os.listdir(output_dir) if name.endswith(".tmp")]
    for path in filter(os.path.lexists, paths):
        mode, name = os.lstat(path).st_mode, os.path.basename(path)
        if stat.S_ISLNK(mode):
            fail(f"{path!r} is a link (to {os.readlink(path)!r}) inside --output-dir: the run writes there and never "
                 "through a link; remove the link, or name another --output-dir")
        if (name == ".saving" and not stat.S_ISDIR(mode)) or (
                name.endswith(".tmp") and not (stat.S_ISDIR(mode) or stat.S_ISREG(mode))):
            fail(f"{path!r} is not what a run leaves in --output-dir (a save's staging folder, an unfinished write): "
                 "move it away, or name another --output-dir")

def claim_output_dir(output_dir: str, inputs: dict[str, str | None], overwrite: bool,
                     subfolders: list[str] = ()) -> None:
    """Make OUTPUT_DIR this run's before any model loads, or one line: it and its SUBFOLDERS checked (check_output_dir,
    refuse_entries_not_ours); if not empty, this script's earlier output unless --overwrite; writable. OUTPUT_DIR/.lock
    (host and pid) keeps a second run out while this one lives (a killed run's is taken over)."""
    script_name = script()
    for path in [output_dir] + [os.path.join(output_dir, name) for name in subfolders]:
        check_output_dir(path, inputs)
    refuse_entries_not_ours(output_dir, list(subfolders))
    ours = (read_record(output_dir) or {}).get("script") == script_name
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite and not ours:
        fail(f"--output-dir {output_dir!r} is not empty and holds no earlier output of {script_name}; name a new or "
             "empty folder, or pass --overwrite to write into it (files of the same names are replaced, nothing else "
             "is deleted)")
    lock, me = os.path.join(output_dir, ".lock"), f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(lock, "x") as f:
                f.write(me)
            break
        except FileExistsError:  # a run's lock is a regular file of its own, "host pid"
            a_run_lock = own_path(output_dir, ".lock", re.compile(r"\.lock")) and os.stat(lock).st_nlink == 1
            fields = open(lock).read(256).split() if a_run_lock else []
            if len(fields) != 2 or not fields[1].isdigit():
                fail(f"{lock!r} is not the lock file of a run (a host and a pid, in a file of its own); remove it")
            host, pid = fields
            if host != socket.gethostname() or pid_alive(int(pid)):
                fail(f"--output-dir {output_dir!r} is in use by another run (pid {pid} on {host}); wait for it to end "
                     f"or stop it (if it is gone, delete {lock})")
            os.remove(lock)  # left by a run that was killed
        except OSError as error:
            fail(f"cannot write to --output-dir {output_dir!r} ({error.strerror}); name a folder you can write")
    def release_lock():
        with contextlib.suppress(OSError), open(lock) as f:
            if f.read() == me:
                os.remove(lock)
    atexit.register(release_lock)
    if not ours:
        write_json(os.path.join(output_dir, RECORD), {"script": script_name, "finished": False})

def open_log(path: str):
    """A log file of the run (metrics.jsonl, trace.jsonl) opened to append to, never through a link, or one line."""
    try:
        return open_own(path, "a")
    except OSError as error:
        fail(f"cannot write to {path!r} ({error.strerror}); {write_fix(error)}, then run again (with --resume to "
             "continue the run)")

def append_line(file, line: str) -> None:
    """LINE appended to an open log file and flushed to it, or one line on a full disk."""
    try:
        file.write(line + "\n")
        file.flush()
    except OSError as error:
        fail(f"cannot write to {file.name!r} ({error.strerror}); {write_fix(error)}, then continue the run with "
             "--resume")

def new_run_name(exp_name: str, seed: int) -> str:
    """A new run's name, EXP_NAME__SEED__TIME (cleanrl's), and its folder runs/RUN_NAME for its logs, made for it alone:
    a run started in the same second under the same name gets RUN_NAME_2 (and so on), and says so."""
    if "/" in exp_name or os.sep in exp_name or exp_name in ("", ".", ".."):
        fail(f"--exp-name {exp_name!r} must be a plain name (no '/'): it names the run's folder in runs/")
    base = f"{exp_name}__{seed}__{int(time.time())}"
    for number in range(1, 1000):
        run_name = base if number == 1 else f"{base}_{number}"
        try:
            os.makedirs(os.path.join("runs", run_name))  # exclusive: two runs never get one folder
        except FileExistsError:
            continue
        except OSError as error:  # a file named runs, a folder that cannot be written
            fail(f"cannot make runs/{run_name} for the run's logs ({error.strerror}); run from a folder you can "
                 "write, where runs is no file")
        if number > 1:
            print(f"runs/{base} is another run's (started in the same second): this run logs to runs/{run_name}")
        return run_name
    fail(f"runs/{base} and 998 more names like it are taken; pass another --exp-name")

def save_model_folder(model, tokenizer, output_dir: str, record: dict, state_dict: dict | None = None) -> None:
    """The model as an ordinary Hugging Face folder (safetensors, tokenizer, record), written in OUTPUT_DIR/.saving,
    flushed and moved into place file by file (a run killed while saving leaves the earlier model whole); the files an
    earlier save wrote (its record lists them) and this one does not are removed, no other."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        staging = os.path.join(output_dir, ".saving")
        refuse_entries_not_ours(output_dir, [])
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was cut short
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        saved = os.listdir(staging) + [RECORD]
        write_json(os.path.join(staging, RECORD), {**record, "files": sorted(saved)})
        fsync_tree(staging)
        ignored = []
        for name in (read_record(output_dir) or {}).get("files", []):  # (read_record has checked that it is a list)
            if name in saved:
                continue
            earlier = own_path(output_dir, name, SAVED_FILE)
            if earlier:  # an earlier save's file (its record names it) not written now
                with contextlib.suppress(FileNotFoundError):
                    os.remove(earlier)
            elif not (isinstance(name, str) and SAVED_FILE.fullmatch(name)
                      and not os.path.lexists(os.path.join(output_dir, name))):  # (one removed already: nothing to do)
                ignored.append(name)
        if ignored:
            print(f"{os.path.join(output_dir, RECORD)} lists {len(ignored)} names that are no files of a save there "
                  f"({', '.join(map(repr, ignored[:3]))}): left alone")
        for name in sorted(saved, key=lambda name: name == RECORD):  # the record last: it says the folder is complete
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        os.rmdir(staging)
        fsync_tree(output_dir)
    except WRITE_ERRORS as error:
        stop_after_failed_write(error, os.path.join(output_dir, ".saving"), f"the model to {output_dir!r}",
                                f"{output_dir!r} keeps what it held")

def save_engine_folder(engine, tokenizer, output_dir: str, record: dict, merge_lora: bool = False) -> None:
    """save_model_folder of an engine's model, its weights copied to rank 0's CPU memory first (whole_state_dict: under
    ZeRO-3 one layer gathered at a time), with merge_lora its LoRA adapters folded in; every rank takes part."""
    is_main = dist.get_rank() == 0
    state = whole_state_dict(engine.module, engine.zero_optimization_stage() == 3, is_main, merge_lora)
    if is_main:
        save_model_folder(engine.module, tokenizer, output_dir, record, state)

def start_tensorboard(run_name: str, args, purge_step: int | None = None) -> SummaryWriter:
    """Rank 0's tensorboard writer in runs/RUN_NAME with the hyperparameters (Args) as a table, mirrored to wandb with
    --track; purge_step: a resumed run drops the events its killed predecessor logged from that step on."""
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, name=run_name, config=asdict(args), sync_tensorboard=True)
    writer = SummaryWriter(os.path.join("runs", run_name), purge_step=purge_step)
    table = "\n".join(f"|{name}|{value}|" for name, value in asdict(args).items())
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    return writer
