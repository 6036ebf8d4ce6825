"""Output folders, claimed and locked before anything loads and written whole (detail 40); records, logs, models;
the checkpoints' and snapshots' folders in them, kept and removed."""

import atexit
import contextlib
import errno
import hashlib
import json
import math
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


def folder_identity(path: str | None, data: bool = False) -> str | None:
    """What identifies a model folder (with DATA, a data set's file or folder) wherever it is, and tells it from
    another, even one a weight or a token apart: a SHA-256 of the names and content of its files (a model's:
    SAVED_FILE's but the record and generation config; a data set's: all but hidden ones, which `datasets` skips;
    about 1 GB/s). A hub name (or None) is itself."""
    if path is None or not os.path.exists(path):
        return path
    if os.path.isfile(path):
        files = [path]
    elif data:
        files = []
        for root, folders, names in os.walk(path):
            folders[:] = sorted(name for name in folders if not name.startswith((".", "_")))
            files += [os.path.join(root, name) for name in sorted(names) if not name.startswith((".", "_"))]
    else:
        files = [os.path.join(path, name) for name in sorted(os.listdir(path))
                 if SAVED_FILE.fullmatch(name) and name not in (RECORD, "generation_config.json")]
    digest = hashlib.sha256()
    for file in filter(os.path.isfile, files):  # regular files (a FIFO's reading would wait for a writer)
        with open(file, "rb") as f:
            digest.update(f"{os.path.relpath(file, path)} {os.fstat(f.fileno()).st_size}".encode())
            while block := f.read(2**24):
                digest.update(block)
    return digest.hexdigest()

RECORD = "training_run.json"  # in every folder a stage writes: the script, run name and arguments that wrote it

# A record's fields, each of its type: a record with one of another type is none that this project wrote.
RECORD_FIELDS = {"script": str, "finished": bool, "run_name": str, "metrics_file": str, "args": dict, "inputs": dict,
                 "files": list, "iteration": int}

def read_text(path: str) -> str:
    """The text of a file that a run reads in its folders (a record, `latest`, a state.json, a lock, a log), or
    OSError for anything but a regular file: never read through a link, nor from a FIFO (whose reading would wait for
    a writer, forever)."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), errors="replace") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise OSError(errno.ENXIO, "not a regular file")
        return f.read()  # (a folder: IsADirectoryError)

def read_record(folder: str) -> dict | None:
    """The training_run.json of a folder, or None if it has none, only a link to one, or one that is not this project's
    (it does not parse, a field is of another type than RECORD_FIELDS says)."""
    with contextlib.suppress(OSError, ValueError, RecursionError):
        record = json.loads(read_text(os.path.join(folder, RECORD)))
        if isinstance(record, dict) and all(isinstance(record[key], kind) for key, kind in RECORD_FIELDS.items()
                                            if key in record):
            return record
    return None

# Names read back from an output folder (its record, `latest`) are untrusted: own_path uses one only if it is of the
# kind this project writes there (one of these patterns: never a path, never hidden), and never through a link.
SAVED_FILE = re.compile(r"(model|adapter_model)(-\d+-of-\d+)?\.safetensors(\.index\.json)?|(config|generation_config|"
                        r"tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab|chat_template)\.json|"
                        r"(vocab|merges)\.txt|chat_template\.jinja|\w[\w.-]*\.(model|tiktoken)|training_run\.json")

STAGED_FILE = re.compile(rf"{SAVED_FILE.pattern}|\..+\.tmp")  # in a save's staging folder: SAVED_FILE's, write_whole's
ITERATION_FOLDER = re.compile(r"iteration_\d+")  # a checkpoint (resume/) or snapshot (snapshots/); .tmp: not whole
RUN_NAME = re.compile(r"[^/\x00]+__\d+__\d+(_\d+)?")  # new_run_name's: EXP_NAME__SEED__TIME, _N if taken

def regular_file(path: str) -> bool:
    """Whether PATH is a regular file: not a link, a folder or a FIFO."""
    return os.path.lexists(path) and stat.S_ISREG(os.lstat(path).st_mode)

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
    if error.errno in (errno.ENXIO, errno.EMLINK):
        return "it is no file of the run's own (a FIFO, a device, or another name of a file: a hard link): move it away"
    return "free some space"

def write_json(path: str, value) -> None:
    """Write a JSON file whole or not at all (write_whole)."""
    write_whole(path, json.dumps(value, indent=1))

def write_whole(path: str, content: str | bytes) -> None:
    """Write a file whole or not at all, or one line: a new file of a fresh name beside it (never an entry there
    already, which may be linked to another file), flushed to disk and renamed into place."""
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
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
        for name in [name for name in files if stat.S_ISREG(os.lstat(os.path.join(root, name)).st_mode)] + ["."]:
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
    """Stop with one line where a run would write through a link in OUTPUT_DIR or its SUBFOLDERS, or read or write an
    entry that no run left there: a .saving (staging) that is not a folder, a .tmp (an unfinished write) or anything in
    the subfolders that is neither a regular file nor a folder (a FIFO would keep the run waiting)."""
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
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) and name != ".saving"):
            fail(f"{path!r} is not what a run leaves in --output-dir (" + ("a save's staging folder" if name ==
                 ".saving" else "a file or a folder, not a FIFO, a socket or a device") + "): move it away, or name "
                 "another --output-dir")

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
        if written := written_by(script_name, output_dir, subfolders):
            fail(f"--output-dir {output_dir!r} holds output of {script_name} ({', '.join(written[:3])}), but its "
                 f"{RECORD} is missing or damaged, so no run can continue it: name another --output-dir, or pass "
                 "--overwrite to start a new run there, whose own checkpoints, snapshots and models replace it")
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
            a_run_lock = regular_file(lock) and os.lstat(lock).st_nlink == 1  # (a hard link: the user's file)
            fields = read_text(lock)[:256].split() if a_run_lock else []
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
        with contextlib.suppress(OSError):
            if read_text(lock) == me:
                os.remove(lock)
    atexit.register(release_lock)
    if not ours:
        write_json(os.path.join(output_dir, RECORD), {"script": script_name, "finished": False})

def written_by(script_name: str, output_dir: str, subfolders: list[str]) -> list[str]:
    """The SUBFOLDERS of OUTPUT_DIR, and the folders in them, that a run of SCRIPT_NAME wrote: their record says so,
    or they are a checkpoint (a state.json)."""
    found = []
    for name in subfolders:
        folder = os.path.join(output_dir, name)
        for path in [folder, *(os.path.join(folder, child) for child in sorted(os.listdir(folder)))] \
                if os.path.isdir(folder) else []:
            if (read_record(path) or {}).get("script") == script_name or regular_file(os.path.join(path, "state.json")):
                found.append(os.path.relpath(path, output_dir))
    return found

def open_log(path: str):
    """A log file of the run (metrics.jsonl, trace.jsonl) opened to append to, or one line: a regular file of its own,
    never a link, another name of a file (a hard link) or a FIFO (opened without waiting for a reader)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_nlink != 1:
            os.close(fd)
            raise OSError(errno.EMLINK, "not a file of its own")
        return os.fdopen(fd, "a")
    except OSError as error:
        fail(f"cannot write to {path!r} ({error.strerror}); {write_fix(error)}, then run again (with --resume to "
             "continue the run)")

def continue_metrics_file(path: str, iteration: int) -> None:
    """On --resume, a log of the run (metrics.jsonl, trace.jsonl) keeps the lines up to the checkpoint's ITERATION, not
    later or cut-short ones, written anew (write_whole), or one line if something else is in its place."""
    if not os.path.lexists(path):
        return
    try:
        text = read_text(path)
    except OSError as error:
        fail(f"cannot continue {path!r} ({error.strerror}); {write_fix(error)}, then run again")
    kept = []
    for line in text.split("\n"):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            if json.loads(line)["iteration"] <= iteration:
                kept.append(line + "\n")
    write_whole(path, "".join(kept))

def run_metrics_file(record: dict) -> str | None:
    """The metrics file a folder's record names if it is runs/RUN_NAME/metrics.jsonl (absolute) of the record's run, a
    regular file or none yet; else None (a path read back from an output folder is untrusted)."""
    named, run_name = record.get("metrics_file"), record.get("run_name")
    if not (isinstance(named, str) and isinstance(run_name, str) and RUN_NAME.fullmatch(run_name)
            and os.path.isabs(named) and named.split(os.sep)[-3:] == ["runs", run_name, "metrics.jsonl"]):
        return None
    return named if regular_file(named) or not os.path.lexists(named) else None

def append_line(file, line: str) -> None:
    """LINE appended to an open log file and flushed to it, or one line on a full disk."""
    try:
        file.write(line + "\n")
        file.flush()
    except OSError as error:
        fail(f"cannot write to {file.name!r} ({error.strerror}); {write_fix(error)}, then continue the run with "
             "--resume")

def log_rows(path: str, rows: list[dict], shown: list[str]) -> None:
    """ROWS printed as columns of their SHOWN keys (text as its repr, cut at 14 characters; a float to 4 places; None
    as -) and appended to the log file PATH, one JSON object a line."""
    print(" ".join(f"{name:>{14 if isinstance(rows[0].get(name), str) else 11}}" for name in shown))
    for row in rows:
        print(" ".join(("-" if v is None else f"{v:.4f}" if isinstance(v, float) else repr(v)[:14] if isinstance(
            v, str) else str(v)).rjust(14 if isinstance(v, str) else 11) for v in map(row.get, shown)))
    with open_log(path) as f:
        append_line(f, "\n".join(map(json.dumps, rows)))

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
        left = os.listdir(staging) if os.path.isdir(staging) else []  # by a save that was cut short: removed
        if not all(own_path(staging, name, STAGED_FILE) for name in left):
            fail(f"{staging!r} holds more than a save leaves there (a folder of yours?): move it away, then run again")
        shutil.rmtree(staging, ignore_errors=True)
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

def read_state(checkpoint: str) -> dict | None:
    """A checkpoint's state.json, or None if it does not read or a value is not of its kind (the file is untrusted):
    the iteration an int, the args and each engine's state a dict, the run name text, each other a finite number."""
    with contextlib.suppress(OSError, ValueError, RecursionError):
        state = json.loads(read_text(os.path.join(checkpoint, "state.json")))
        if isinstance(state, dict) and type(state.get("iteration")) is int and isinstance(state.get("args"), dict) \
                and isinstance(state.get("run_name", ""), str) and all(
                    isinstance(value, dict) or type(value) in (int, float) and math.isfinite(value)
                    for key, value in state.items() if key != "run_name"):
            return state
    return None

def complete_checkpoints(checkpoint_dir: str) -> list[str]:
    """The complete checkpoints (renamed from .tmp) in CHECKPOINT_DIR, newest first, the one `latest` names first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    names = sorted((name for name in os.listdir(checkpoint_dir)
                    if own_path(checkpoint_dir, name, ITERATION_FOLDER, is_dir=True)),
                   key=lambda name: int(name.removeprefix("iteration_")), reverse=True)
    with contextlib.suppress(OSError):
        latest = read_text(os.path.join(checkpoint_dir, "latest")).strip()
        if latest in names:
            names.insert(0, names.pop(names.index(latest)))
    return [os.path.join(checkpoint_dir, name) for name in names]

def commit_checkpoint(path: str, run_name: str) -> None:
    """Rank 0: PATH.tmp flushed and renamed to PATH, then named in `latest`. Of the checkpoints of run RUN_NAME (their
    state.json says so) the newest two stay (one older, if latest is damaged); the others go, and what saves or
    removals cut short left (finish_removals). A folder that no run wrote is never removed, nor counted."""
    checkpoint_dir = os.path.dirname(path)
    fsync_tree(path + ".tmp")
    refuse_entries_not_ours(checkpoint_dir, [os.path.basename(path)])
    if os.path.lexists(path):  # a checkpoint of this iteration written before
        if not regular_file(os.path.join(path, "state.json")):
            fail(f"{path!r} is in the way of this run's checkpoint, and no run wrote it (no state.json): move it away")
        remove_run_folder(path)
    os.replace(path + ".tmp", path)
    fsync_tree(checkpoint_dir)
    write_whole(os.path.join(checkpoint_dir, "latest"), os.path.basename(path))
    fsync_tree(checkpoint_dir)
    runs = [c for c in complete_checkpoints(checkpoint_dir) if (read_state(c) or {}).get("run_name") == run_name]
    for old in runs[2:]:
        remove_run_folder(old)
    finish_removals(checkpoint_dir)

def remove_earlier_runs(folder: str, run_name: str, record_of) -> None:
    """Rank 0, as a run writes into FOLDER (snapshots/, resume/): each iteration_N folder whose record (record_of(path))
    names another run of this script goes, and what saves or removals cut short left; nothing else does. An earlier
    run's work stays until then."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = own_path(folder, name, ITERATION_FOLDER, is_dir=True)
        if path and (record_of(path) or {}).get("run_name") not in (None, run_name):
            remove_run_folder(path)
    finish_removals(folder)

MARKERS = ("state.json", RECORD)  # what says that a run wrote a checkpoint's or a snapshot's folder: removed last
LEFT_OVER = re.compile(ITERATION_FOLDER.pattern + r"(\.\w+)?\.tmp")  # a save, or a removal, cut short

def remove_run_folder(path: str) -> None:
    """Remove a checkpoint's or a snapshot's folder, so that a removal cut short leaves it recognisably a run's, no
    longer whole, for finish_removals: renamed to a fresh iteration_N.*.tmp, emptied, its MARKERS last."""
    if not LEFT_OVER.fullmatch(os.path.basename(path)):
        trash = tempfile.mkdtemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
        os.replace(path, trash)  # (over the fresh empty folder)
        path = trash
    for name in sorted(os.listdir(path), key=lambda name: name in MARKERS):
        if stat.S_ISDIR(os.lstat(os.path.join(path, name)).st_mode):
            shutil.rmtree(os.path.join(path, name))
        else:
            os.remove(os.path.join(path, name))
    os.rmdir(path)

def finish_removals(folder: str) -> None:
    """Rank 0: the iteration_N.tmp folders in FOLDER that a save or a removal cut short left (their state.json or
    record is still there), and empty ones, removed; a folder of the user's of that name stays."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = own_path(folder, name, LEFT_OVER, is_dir=True)
        if path and (any(regular_file(os.path.join(path, marker)) for marker in MARKERS) or not os.listdir(path)):
            remove_run_folder(path)

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
