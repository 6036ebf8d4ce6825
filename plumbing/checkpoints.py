"""A run's state on disk: an engine's training state in safetensors, the run started or resumed, its checkpoints."""

import contextlib
import json
import math
import os
import re
import shutil
from dataclasses import asdict

import deepspeed
import peft
import safetensors.torch
import torch
import torch.distributed as dist

from .folders import (ITERATION_FOLDER, RECORD, RUN_NAME, WRITE_ERRORS, claim_output_dir, folder_identity, fsync_tree,
                      new_run_name, open_log, own_path, read_record, refuse_entries_not_ours, save_engine_folder,
                      start_tensorboard, stop_after_failed_write, write_fix, write_json, write_whole)
from .processes import fail, script


def load_weights(engine, weights: dict[str, torch.Tensor]) -> None:
    """Every parameter of an engine set from WEIGHTS (by name), under ZeRO-3 into every rank's partition."""
    for name, param in engine.module.named_parameters():
        with torch.no_grad(), deepspeed.zero.GatheredParameters(
                param, modifier_rank=0, enabled=engine.zero_optimization_stage() == 3):
            param.data.copy_(weights[name])

def torch_optimizer(engine):
    """The torch optimizer inside an engine (its state holds Adam's step): under ZeRO or bf16 the private `optimizer`
    of DeepSpeed's wrapper, else the engine's own (DeepSpeed 0.19.8, test_killed_run_resumes_to_the_same_metrics)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)

def local_master(engine, param) -> torch.Tensor | None:
    """Under ZeRO-0, the fp32 tensor that the torch optimizer steps and keys its state by, whole on every rank: in
    fp32 the parameter itself, in fp16 its copy in DeepSpeed's FP16_UnfusedOptimizer (its fp16_groups and
    fp32_groups, DeepSpeed 0.19.8). None where DeepSpeed's tensor-fragment API assembles it (ZeRO 1-3, bf16)."""
    optimizer = engine.optimizer
    if optimizer is torch_optimizer(engine):
        return param
    if isinstance(optimizer, deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer):
        for fp16_group, fp32_group in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            for fp16, fp32 in zip(fp16_group, fp32_group):
                if fp16 is param:
                    return fp32
    return None

def master_weight(engine, param) -> torch.Tensor:
    """A parameter whole, as the optimizer holds it: the fp32 master copy that DeepSpeed keeps under bf16, fp16 or
    ZeRO (the module's weight is its rounded or partitioned copy); a frozen parameter's module weight, gathered."""
    if not param.requires_grad or engine.optimizer is None:
        with deepspeed.zero.GatheredParameters(param, enabled=engine.zero_optimization_stage() == 3):
            return param.detach().float().clone()
    master = local_master(engine, param)
    return master.detach().float() if master is not None else deepspeed.utils.safe_get_full_fp32_param(param)

def merged_master_weight(engine, name: str) -> torch.Tensor:
    """The fp32 master of weight NAME of the plain model (whole_state_dict's names with merge_lora) of an engine whose
    model may carry LoRA adapters: for an adapted layer's weight W + (alpha / r) B A, from the masters of all three."""
    layer_name, _, kind = name.rpartition(".")
    layer = engine.module.get_submodule(layer_name)
    if not isinstance(layer, peft.tuners.lora.LoraLayer):
        return master_weight(engine, engine.module.get_parameter(name))
    value = master_weight(engine, getattr(layer.base_layer, kind))
    if kind == "weight":
        delta = master_weight(engine, layer.lora_B["default"].weight) @ \
            master_weight(engine, layer.lora_A["default"].weight)
        value = value + layer.scaling["default"] * peft.utils.transpose(delta, layer.fan_in_fan_out)
    return value

def link_optimizer_states(engine) -> None:
    """DeepSpeed 0.19.8's ZeRO-1/2 and bf16 optimizers link each parameter to its slice of Adam's moments once, right
    after the first parameter group's first step: a second group's moments (LoRA's adapters) do not exist yet and stay
    unlinked, and safe_get_full_optimizer_state fails on them. Linked again here, after every group has stepped."""
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()

def save_training_state(engine, path: str, is_main: bool) -> dict:
    """For --resume: an engine's parameters in fp32, whole, by name (every rank takes part, rank 0 writes): the
    trained ones' master copies in model.safetensors and Adam's moments in adam.safetensors, the frozen ones' (LoRA's
    base, a frozen engine's all) weights. Returns the optimizer's step, scheduler state and fp16 loss scale, or {}."""
    base_optimizer = torch_optimizer(engine)
    trained = any(param.requires_grad for param in engine.module.parameters())  # else a frozen engine (the EMA)
    link_optimizer_states(engine)
    weights, moments = {}, {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:  # the optimizer never had it: no master copy, no moments
            weight = master_weight(engine, param)
            if is_main:
                weights[name] = weight.cpu().contiguous()
            continue
        master = local_master(engine, param)
        if master is not None:
            state = base_optimizer.state[master]
            master, exp_avg, exp_avg_sq = master.detach(), state["exp_avg"], state["exp_avg_sq"]
        else:
            master = deepspeed.utils.safe_get_full_fp32_param(param)
            exp_avg = deepspeed.utils.safe_get_full_optimizer_state(param, "exp_avg")
            exp_avg_sq = deepspeed.utils.safe_get_full_optimizer_state(param, "exp_avg_sq")
        if is_main:
            weights[name] = master.cpu().contiguous()
            moments[f"{name}.exp_avg"] = exp_avg.cpu().contiguous()
            moments[f"{name}.exp_avg_sq"] = exp_avg_sq.cpu().contiguous()
    if is_main:
        os.makedirs(path, exist_ok=True)
        safetensors.torch.save_file(weights, os.path.join(path, "model.safetensors"))
        if trained:
            safetensors.torch.save_file(moments, os.path.join(path, "adam.safetensors"))
    if not trained:
        return {}
    adam_step = int(next(iter(base_optimizer.state.values()))["step"])
    return {"adam_step": adam_step, "scheduler": engine.lr_scheduler.state_dict(), "loss_scale": loss_scale(engine)}

LOSS_SCALE_FIELDS = ["cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"]

def loss_scaler(engine):
    """What holds fp16's loss scale in the engine's optimizer (ZeRO 1-3: loss_scaler; ZeRO-0: loss_scale_config), or
    None without fp16 (DeepSpeed 0.19.8, no public API; test_mixed_precision_resume_keeps_master_weights_and_scale)."""
    optimizer = engine.optimizer
    return (getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)) \
        if engine.fp16_enabled() else None

def loss_scale(engine) -> dict | None:
    """The dynamic loss scale's state (the scale, the steps since the last overflow, the hysteresis), for --resume."""
    scaler = loss_scaler(engine)
    return None if scaler is None else {name: getattr(scaler, name) for name in LOSS_SCALE_FIELDS
                                        if hasattr(scaler, name)}

def load_training_state(engine, path: str, saved: dict, device: torch.device) -> None:
    """Restore what save_training_state wrote into an engine built as at the start: weights (and the fp32 masters),
    Adam's moments and step count, the learning rate, and in fp16 the loss scale."""
    # Adam's moments appear at the first step: one with lr 0 and zero gradients makes them; all is overwritten below.
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(engine(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device)).logits.sum() * 0.0)
        engine.step()
    link_optimizer_states(engine)
    weights = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    load_weights(engine, weights)
    moments = safetensors.torch.load_file(os.path.join(path, "adam.safetensors"))
    base_optimizer = torch_optimizer(engine)
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:  # frozen: load_weights has set it, and the optimizer has nothing of it
            continue
        master = local_master(engine, param)
        if master is None:
            deepspeed.utils.safe_set_full_fp32_param(param, weights[name].to(device))
        elif master is not param:  # fp16 at ZeRO-0: the fp32 copy (load_weights set the module's fp16 one)
            master.data.copy_(weights[name])
        for moment in ("exp_avg", "exp_avg_sq"):
            if master is not None:
                base_optimizer.state[master][moment].copy_(moments[f"{name}.{moment}"])
            else:
                deepspeed.utils.safe_set_full_optimizer_state(param, moments[f"{name}.{moment}"].to(device), moment)
    for state in base_optimizer.state.values():
        state["step"] = torch.full_like(state["step"], saved["adam_step"]) if torch.is_tensor(state["step"]) \
            else saved["adam_step"]
    engine.lr_scheduler.load_state_dict(saved["scheduler"])
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr
    for name, value in (saved.get("loss_scale") or {}).items():  # fp16: after the steps above, which moved it
        setattr(loss_scaler(engine), name, value)

def engine_state_problem(folder: str, engine, trained: bool) -> str | None:
    """Why FOLDER cannot restore ENGINE (model.safetensors, and adam.safetensors of its trained parameters if trained,
    whole and complete: a tensor of each parameter's name and whole shape, ds_shape under ZeRO-3)."""
    shapes = {name: list(getattr(param, "ds_shape", param.shape)) for name, param in engine.module.named_parameters()}
    files = {"model.safetensors": shapes}
    if trained:
        files["adam.safetensors"] = {f"{name}.{moment}": shapes[name] for name, param in
                                     engine.module.named_parameters() if param.requires_grad
                                     for moment in ("exp_avg", "exp_avg_sq")}
    for file, expected in files.items():
        try:
            with safetensors.safe_open(os.path.join(folder, file), "pt") as f:
                if set(f.keys()) != set(expected) or any(f.get_slice(name).get_shape() != shape
                                                         for name, shape in expected.items()):
                    return f"{os.path.basename(folder)}/{file} does not hold this model's parameters (their names " \
                           "and shapes)"
        except (OSError, safetensors.SafetensorError) as error:
            return f"{os.path.basename(folder)}/{file}: {' '.join(str(error).split())[:200]}"
    return None

def same_layout(value, template) -> bool:
    """Whether VALUE, read back from a JSON file (untrusted), has TEMPLATE's layout: the same keys, list lengths and
    kinds of values (a number for a number, a bool for a bool, text for text), all the way down."""
    if isinstance(template, dict):
        return isinstance(value, dict) and value.keys() == template.keys() and \
            all(same_layout(value[key], template[key]) for key in template)
    if isinstance(template, (list, tuple)):
        return isinstance(value, list) and len(value) == len(template) and all(map(same_layout, value, template))
    if isinstance(template, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(template, bool)
    if isinstance(template, (int, float)):
        return isinstance(value, (int, float)) and math.isfinite(value)
    return type(value) is type(template)

def changed_settings(saved: dict, args, may_change: list[str]) -> list[str]:
    """The flags of this run whose values differ from those a checkpoint was written with, but for MAY_CHANGE; the
    switches that the run was started with on and the script no longer has (a feature taken out); and the number of
    ranks (the fields that follow from it are in MAY_CHANGE)."""
    changed = [f"--{name.replace('_', '-')} {saved[name]!r} (now {value!r})" for name, value in asdict(args).items()
               if name not in may_change and name in saved and saved[name] != value]
    changed += [f"--{name.replace('_', '-')} (a switch that {script()} no longer has)" for name, value in saved.items()
                if value is True and not hasattr(args, name)]
    if saved.get("world_size", args.world_size) != args.world_size:
        changed.append(f"the number of ranks {saved['world_size']} (now {args.world_size})")
    return changed

def complete_checkpoints(checkpoint_dir: str) -> list[str]:
    """The complete checkpoints (renamed from .tmp) in CHECKPOINT_DIR, newest first, the one `latest` names first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    names = sorted((name for name in os.listdir(checkpoint_dir)
                    if own_path(checkpoint_dir, name, ITERATION_FOLDER, is_dir=True)),
                   key=lambda name: int(name.removeprefix("iteration_")), reverse=True)
    with contextlib.suppress(OSError), open(os.path.join(checkpoint_dir, "latest")) as f:
        latest = f.read().strip()
        if latest in names:
            names.insert(0, names.pop(names.index(latest)))
    return [os.path.join(checkpoint_dir, name) for name in names]

def commit_checkpoint(path: str, run_name: str) -> None:
    """Rank 0: PATH.tmp flushed and renamed to PATH, then named in `latest`. Of the checkpoints of run RUN_NAME (their
    state.json says so) the newest two stay (one older, if latest is damaged); the others go, and the iteration_N.tmp
    folders of checkpoints cut short. A folder that no run wrote is never removed, nor counted."""
    checkpoint_dir = os.path.dirname(path)
    fsync_tree(path + ".tmp")
    refuse_entries_not_ours(checkpoint_dir, [os.path.basename(path)])
    if os.path.lexists(path) and not os.path.isfile(os.path.join(path, "state.json")):
        fail(f"{path!r} is in the way of this run's checkpoint, and no run wrote it (no state.json): move it away")
    shutil.rmtree(path, ignore_errors=True)  # a checkpoint of this iteration written before
    os.replace(path + ".tmp", path)
    fsync_tree(checkpoint_dir)
    write_whole(os.path.join(checkpoint_dir, "latest"), os.path.basename(path))
    fsync_tree(checkpoint_dir)
    runs = [c for c in complete_checkpoints(checkpoint_dir) if (read_state(c) or {}).get("run_name") == run_name]
    cut_short = re.compile(ITERATION_FOLDER.pattern + r"\.tmp")
    for old in runs[2:] + [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)
                           if own_path(checkpoint_dir, name, cut_short, is_dir=True)]:
        shutil.rmtree(old)

def remove_earlier_runs(folder: str, run_name: str, record_of) -> None:
    """Rank 0, as a run writes into FOLDER (snapshots/, resume/): each iteration_N folder whose record (record_of(path))
    names another run of this script goes; nothing else does. An earlier run's work stays until then."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = own_path(folder, name, ITERATION_FOLDER, is_dir=True)
        if path and (record_of(path) or {}).get("run_name") not in (None, run_name):
            shutil.rmtree(path)

def run_metrics_file(record: dict) -> str | None:
    """The metrics file a folder's record names if it is runs/RUN_NAME/metrics.jsonl (absolute) of the record's run, a
    regular file or none yet; else None (a path read back from an output folder is untrusted)."""
    named, run_name = record.get("metrics_file"), record.get("run_name")
    if not (isinstance(named, str) and isinstance(run_name, str) and RUN_NAME.fullmatch(run_name)
            and os.path.isabs(named) and named.split(os.sep)[-3:] == ["runs", run_name, "metrics.jsonl"]):
        return None
    regular = own_path(os.path.dirname(named), "metrics.jsonl", re.compile(r"metrics\.jsonl"))
    return named if regular or not os.path.lexists(named) else None

def continue_metrics_file(path: str, iteration: int) -> None:
    """On --resume, the metrics.jsonl keeps the lines up to the checkpoint's ITERATION: not later or cut-short ones."""
    if not os.path.lexists(path):
        return
    kept = []
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:  # never through a link
            for line in f:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    if json.loads(line)["iteration"] <= iteration:
                        kept.append(line if line.endswith("\n") else line + "\n")
    except OSError as error:
        fail(f"cannot continue {path!r} ({error.strerror}); {write_fix(error)} and run again")
    write_whole(path, "".join(kept))

def start_run(args, inputs: dict[str, str | None], subfolders: list[str], may_change: list[str]) -> dict:
    """Rank 0, before anything loads: the output folder claimed (claim_output_dir: nothing else is written), and a new
    run, or with --resume the unfinished one in OUTPUT_DIR with its settings (but MAY_CHANGE) and models (INPUTS: flag
    -> path; a model's flag names one), by content. Returns its name, its metrics.jsonl, the checkpoints to resume
    from, newest first, and the models' identities (folder_identity)."""
    models = {flag: path for flag, path in inputs.items() if "model" in flag}  # folders, known by their content
    identities = {flag: folder_identity(path) for flag, path in models.items()}
    record = read_record(args.output_dir) or {}  # an earlier run's, if this script wrote this folder before
    record = record if record.get("script") == script() else {}
    claim_output_dir(args.output_dir, inputs, args.overwrite, subfolders)
    checkpoint_dir = os.path.join(args.output_dir, "resume")
    # The checkpoints of the folder's run (one whose state.json does not read stays: load_checkpoint says why).
    checkpoints = [checkpoint for checkpoint in complete_checkpoints(checkpoint_dir) if record and
                   (read_state(checkpoint) or {}).get("run_name", record.get("run_name")) == record.get("run_name")]
    if not args.resume:
        if checkpoints and not record.get("finished") and not args.overwrite:
            fail(f"{args.output_dir!r} holds checkpoints of an unfinished run ({os.path.basename(checkpoints[0])}): "
                 "continue it with --resume, or pass --overwrite to start a new run, which deletes them")
        # The earlier run's record, checkpoints and snapshots stay until this run writes its own.
        run_name = new_run_name(args.exp_name, args.seed)
        return {"run_name": run_name, "metrics_file": os.path.abspath(os.path.join("runs", run_name, "metrics.jsonl")),
                "checkpoints": [], "inputs": identities, "models": models}
    if "run_name" not in record:
        fail(f"--resume: no run of {script()} in {args.output_dir!r} to continue")
    if not RUN_NAME.fullmatch(record["run_name"]):  # (read_record has checked the fields' types)
        fail(f"--resume: {os.path.join(args.output_dir, RECORD)} is damaged (its run_name is not one {script()} "
             "writes); start a new run with --overwrite")
    if record.get("finished"):
        fail(f"--resume: the run in {args.output_dir!r} has finished all its iterations; nothing to resume")
    states = [state for state in map(read_state, checkpoints) if state is not None]
    if not states:
        fail(f"--resume: the state.json of every checkpoint in {checkpoint_dir} is missing or damaged; start a new "
             "run with --overwrite" if checkpoints else f"--resume: no complete checkpoint in {checkpoint_dir}; run "
             "with --save-every N first")
    changed = changed_settings(states[0]["args"], args, may_change)
    if changed:
        fail(f"--resume: the run was started with other settings: {', '.join(changed)}; resume with its settings "
             "(only how a run is saved, logged, sampled or laid out in memory may change)")
    replaced = [flag for flag, identity in record.get("inputs", {}).items() if identities.get(flag) != identity]
    if replaced:
        fail(f"--resume: {replaced[0]} {inputs[replaced[0]]!r} does not hold the model the run started from (its "
             "files differ); name that model's folder, wherever it is now")
    # The metrics.jsonl it continues: the one its record names if that is the run's (else, said, one here).
    run_name, named = record["run_name"], run_metrics_file(record)
    metrics_file = named or os.path.abspath(os.path.join("runs", run_name, "metrics.jsonl"))
    if named is None:
        print(f"the run's record names {record.get('metrics_file')!r} as its metrics file, which is no "
              f"runs/{run_name}/metrics.jsonl file: left alone; the metrics go to {metrics_file}")
    try:  # runs/RUN_NAME, made again if it is gone
        os.makedirs(os.path.join("runs", run_name), exist_ok=True)
    except OSError as error:
        fail(f"cannot write the run's logs to runs/{run_name} ({error.strerror}); run from a folder you can write")
    return {"run_name": run_name, "metrics_file": metrics_file, "checkpoints": checkpoints, "inputs": identities,
            "models": models}

def start_logging(run: dict, start_iteration: int, args, logs: list[str]) -> tuple:
    """Rank 0, once every input has loaded and still holds what start_run fingerprinted (a stage saving into a model
    folder meanwhile would make the run train from a model its record does not name): a new run's record replaces an
    earlier run's; a resumed run's logs (metrics.jsonl and LOGS beside it) lose the lines after its checkpoint. Returns
    the tensorboard writer and the open metrics.jsonl of the RUN (start_run's)."""
    for flag, path in run["models"].items():
        if folder_identity(path) != run["inputs"][flag]:
            fail(f"{flag} {path!r} changed while this run loaded it (is a run writing into it?); run again once the "
                 "folder is written")
    if not args.resume:
        write_json(os.path.join(args.output_dir, RECORD), {
            "script": script(), "finished": False, "run_name": run["run_name"], "metrics_file": run["metrics_file"],
            "args": asdict(args), "inputs": run["inputs"]})
    writer = start_tensorboard(run["run_name"], args,
                               purge_step=start_iteration * args.batch_size + 1 if args.resume else None)
    for path in [run["metrics_file"], *(os.path.join(os.path.dirname(run["metrics_file"]), log) for log in logs)]:
        continue_metrics_file(path, start_iteration)
        open_log(path).close()
    print(f"{args.num_iterations} iterations of {args.batch_size} episodes; logging to {writer.log_dir}")
    return writer, open_log(run["metrics_file"])

def read_state(checkpoint: str) -> dict | None:
    """A checkpoint's state.json, or None if it does not read or a value is not of its kind (the file is untrusted):
    the iteration an int, the args and each engine's state a dict, the run name text, each other a finite number."""
    with contextlib.suppress(OSError, ValueError, RecursionError), open(os.path.join(checkpoint, "state.json")) as f:
        state = json.load(f)
        if isinstance(state, dict) and type(state.get("iteration")) is int and isinstance(state.get("args"), dict) \
                and isinstance(state.get("run_name", ""), str) and all(
                    isinstance(value, dict) or type(value) in (int, float) and math.isfinite(value)
                    for key, value in state.items() if key != "run_name"):
            return state
    return None

def load_checkpoint(checkpoints: list[str], trained: dict, frozen: dict, values: list[str], rank_keys: list[str],
                    args, device) -> tuple[dict, dict | None]:
    """--resume: the TRAINED and FROZEN engines (name -> engine, or None) take the state of the newest checkpoint that
    reads whole. Returns its state.json (the iteration, VALUES) and this rank's tensors (RANK_KEYS), or None."""
    is_main, frozen = dist.get_rank() == 0, {name: engine for name, engine in frozen.items() if engine is not None}
    for resume_dir in checkpoints:
        state = read_state(resume_dir)
        problem = checkpoint_problem(resume_dir, state, trained, frozen, values, rank_keys, args.num_iterations)
        if problem is None:
            break
        if is_main:
            print(f"warning: cannot resume from {resume_dir} ({problem}); trying the checkpoint before it")
    else:
        fail(f"--resume: no checkpoint in {os.path.join(args.output_dir, 'resume')} reads whole; start a new run with "
             "--overwrite")
    for name, engine in trained.items():
        load_training_state(engine, os.path.join(resume_dir, name), state[name], device)
    for name, engine in frozen.items():
        load_weights(engine, safetensors.torch.load_file(os.path.join(resume_dir, name, "model.safetensors")))
    if is_main:
        left = args.num_iterations - state["iteration"]
        print(f"resumed from {resume_dir} at iteration {state['iteration']}; "
              + (f"{left} iterations left" if left else "no iteration left: saving the models"))
    rank_file = os.path.join(resume_dir, f"rank_{dist.get_rank()}.safetensors")
    return state, safetensors.torch.load_file(rank_file, device=str(device)) if os.path.exists(rank_file) else None

def checkpoint_problem(checkpoint: str, state: dict | None, trained: dict, frozen: dict, values: list[str],
                       rank_keys: list[str], num_iterations: int) -> str | None:
    """Why --resume cannot continue from CHECKPOINT, or None: no STATE (read_state's), an iteration not the run's, one
    of VALUES missing, the TRAINED engines' optimizer or scheduler states of another layout, an engine's files not
    whole (engine_state_problem), a rank's tensors not RANK_KEYS. Every rank reads all ranks' files, so that all
    choose the same checkpoint."""
    if state is None:
        return "its state.json is missing or damaged"
    if not 1 <= state["iteration"] <= num_iterations:
        return f"its iteration {state['iteration']} is not one of the run's 1 to {num_iterations}"
    if missing := [name for name in values if name not in state]:
        return f"its state.json has no {missing[0]!r}"
    for name, engine in trained.items():
        if not same_layout(state.get(name), {"adam_step": 0, "scheduler": engine.lr_scheduler.state_dict(),
                                             "loss_scale": loss_scale(engine)}):
            return f"its state.json's {name!r} is not the optimizer and scheduler state of this run's {name}"
    for name, engine in {**trained, **frozen}.items():
        if problem := engine_state_problem(os.path.join(checkpoint, name), engine, name in trained):
            return problem
    for file in sorted(name for name in os.listdir(checkpoint) if name.startswith("rank_")):
        try:
            with safetensors.safe_open(os.path.join(checkpoint, file), "pt") as f:
                if set(f.keys()) != set(rank_keys):
                    return f"{file} does not hold the tensors a rank saves"
        except (OSError, safetensors.SafetensorError):
            return f"{file} is damaged"
    return None

def save_checkpoint(iteration: int, run_name: str, trained: dict, frozen: dict, values: dict,
                    rank_tensors: dict[str, torch.Tensor], args) -> None:
    """A checkpoint for --resume in OUTPUT_DIR/resume/iteration_N, whole or not at all: the state of the TRAINED and
    FROZEN engines (name -> engine, or None), the iteration, VALUES (name -> number) and each rank's RANK_TENSORS
    (every rank takes part); rank 0 writes the rest, and first removes an earlier run's checkpoints."""
    is_main = dist.get_rank() == 0
    checkpoint_dir = os.path.join(args.output_dir, "resume")
    path = os.path.join(checkpoint_dir, f"iteration_{iteration}")
    if is_main:  # before this run's own: their space is free, and a failed write names only this run's checkpoint
        remove_earlier_runs(checkpoint_dir, run_name, read_state)
        shutil.rmtree(path + ".tmp", ignore_errors=True)  # this iteration's, cut short: written anew, not through
    dist.barrier()
    try:
        state = {"iteration": iteration, **values, "args": asdict(args), "run_name": run_name}
        for name, engine in {**trained, **frozen}.items():
            if engine is not None:
                state[name] = save_training_state(engine, os.path.join(path + ".tmp", name), is_main)
        os.makedirs(path + ".tmp", exist_ok=True)
        safetensors.torch.save_file({k: v.cpu().contiguous() for k, v in rank_tensors.items()},
                                    os.path.join(path + ".tmp", f"rank_{dist.get_rank()}.safetensors"))
        dist.barrier()  # every rank's tensors are written before rank 0 commits
        if is_main:
            write_json(os.path.join(path + ".tmp", "state.json"), state)
            commit_checkpoint(path, run_name)
    except WRITE_ERRORS as error:
        kept = complete_checkpoints(checkpoint_dir)
        stop_after_failed_write(error, path + ".tmp", f"the checkpoint {path!r}", f"--resume continues from "
                                f"{kept[0]!r}" if kept else "no checkpoint is complete yet")

def save_snapshot(engine, tokenizer, iteration: int, saved_by: dict, args) -> None:
    """The engine's model as a Hugging Face folder in OUTPUT_DIR/snapshots/iteration_N, after every --snapshot-every
    iterations and the last (N counts them); an earlier run's snapshots go now."""
    if not args.snapshot_every or (iteration % args.snapshot_every and iteration != args.num_iterations):
        return
    snapshots = os.path.join(args.output_dir, "snapshots")
    if dist.get_rank() == 0:
        remove_earlier_runs(snapshots, saved_by["run_name"], read_record)
    save_engine_folder(engine, tokenizer, os.path.join(snapshots, f"iteration_{iteration}"),
                       {**saved_by, "iteration": iteration, "finished": False}, merge_lora=True)
