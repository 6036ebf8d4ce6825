"""A run's state on disk: an engine's training state in safetensors, the run started or resumed, its checkpoints."""

import math
import os
import time
from dataclasses import asdict

import deepspeed
import peft
import safetensors.torch
import torch
import torch.distributed as dist

from .folders import (RECORD, RUN_NAME, WRITE_ERRORS, claim_output_dir, commit_checkpoint, complete_checkpoints,
                      continue_metrics_file, folder_identity, new_run_name, open_log, read_record, read_state,
                      read_text, regular_file, remove_earlier_runs, run_metrics_file, save_engine_folder,
                      start_tensorboard, stop_after_failed_write, write_fix, write_json, write_whole)
from .processes import fail, on_rank_0, script


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
        if not regular_file(os.path.join(folder, file)):  # never a FIFO, whose opening would wait for a writer
            return f"{os.path.basename(folder)}/{file} is missing, or no file"
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
    """The flags of this run whose values differ from those a checkpoint was written with, but for MAY_CHANGE, and the
    number of ranks (the fields that follow from it are in MAY_CHANGE)."""
    changed = [f"--{name.replace('_', '-')} {saved[name]!r} (now {value!r})" for name, value in asdict(args).items()
               if name not in may_change and name in saved and saved[name] != value]
    if saved.get("world_size", args.world_size) != args.world_size:
        changed.append(f"the number of ranks {saved['world_size']} (now {args.world_size})")
    return changed

OWNER = "output_dir.txt"  # in runs/RUN_NAME: the output folder whose run logs there, from the working folder

def start_run(args, inputs: dict[str, str | None], subfolders: list[str], may_change: list[str]) -> dict:
    """Rank 0, before anything loads: the output folder claimed (claim_output_dir: nothing else is written), and a new
    run, or with --resume the unfinished one in OUTPUT_DIR with its settings (but MAY_CHANGE) and inputs (INPUTS: flag
    -> path; a flag with "model" names a model folder, another a data set), known by content wherever they are now;
    its logs in runs/RUN_NAME of the working folder, as tensorboard's. Returns its name, its metrics.jsonl, the
    checkpoints to resume from, newest first, and the inputs' identities (folder_identity)."""
    models = {flag: path for flag, path in inputs.items() if "model" in flag}  # checked again once loaded
    identities = {flag: folder_identity(path, data=flag not in models) for flag, path in inputs.items()}
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
    removed = [name for name, value in states[0]["args"].items() if value is True and not hasattr(args, name)]
    if removed:
        fail(f"--resume: the run was started with --{removed[0].replace('_', '-')}, which {script()} no longer has, "
             "and no run can continue without it; start a new run with --overwrite, or name another --output-dir")
    changed = changed_settings(states[0]["args"], args, may_change)
    if changed:
        fail(f"--resume: the run was started with other settings: {', '.join(changed)}; resume with its settings "
             "(only how a run is saved, logged, sampled or laid out in memory may change)")
    replaced = [flag for flag, identity in record.get("inputs", {}).items() if identities.get(flag) != identity]
    if replaced:
        what = "model" if replaced[0] in models else "data set"
        fail(f"--resume: {replaced[0]} {inputs[replaced[0]]!r} does not hold the {what} the run started from (its "
             f"files differ); name that {what}, wherever it is now")
    run_name = record["run_name"]
    logs = os.path.join("runs", run_name)
    metrics_file = os.path.abspath(os.path.join(logs, "metrics.jsonl"))
    if os.path.islink(logs) or os.path.lexists(logs) and not os.path.isdir(logs):
        fail(f"{logs} is {'a link' if os.path.islink(logs) else 'no folder'}, where the run keeps its logs in a "
             "folder of its own: move it away, then run again")
    owner = read_text(os.path.join(logs, OWNER)).strip() if regular_file(os.path.join(logs, OWNER)) else ""
    if owner and os.path.isdir(owner) and not os.path.samefile(owner, args.output_dir) \
            and (read_record(owner) or {}).get("run_name") == run_name:  # both hold the run: this one is a copy
        fail(f"--resume: {args.output_dir!r} is a copy of {owner!r}, whose run {run_name} logs to {logs} in this "
             "folder: the copy would write into the original's logs. Move the original away (the copy then continues "
             "the run), or resume the copy from another working folder (it then logs to that folder's runs/)")
    named = run_metrics_file(record)  # where it logged before: another working folder's, or this one moved
    if named and os.path.isfile(named) and not os.path.lexists(metrics_file):
        print(f"the run's metrics up to its checkpoint are in {named}; from here on it logs to {metrics_file}")
    try:  # runs/RUN_NAME, made again if it is gone
        os.makedirs(logs, exist_ok=True)
    except OSError as error:
        fail(f"cannot write the run's logs to {logs} ({error.strerror}); run from a folder you can write")
    return {"run_name": run_name, "metrics_file": metrics_file, "checkpoints": checkpoints, "inputs": identities,
            "models": models}

def start_logging(run: dict, start_iteration: int, args, logs: list[str]) -> tuple:
    """Rank 0, once every input has loaded and the models still hold what start_run fingerprinted (a stage saving into
    a model folder meanwhile would make the run train from a model its record does not name): the run's record written
    (a new run's replaces an earlier run's; a resumed run's names where it logs now), and runs/RUN_NAME's OWNER; a
    resumed run's logs (metrics.jsonl and LOGS beside it) lose the lines after its checkpoint. Returns the tensorboard
    writer and the open metrics.jsonl of the RUN (start_run's)."""
    for flag, path in run["models"].items():
        if folder_identity(path) != run["inputs"][flag]:
            fail(f"{flag} {path!r} changed while this run loaded it (is a run writing into it?); run again once the "
                 "folder is written")
    record = read_record(args.output_dir) if args.resume else None  # a resumed run's, kept but for where it logs
    record = record or {"script": script(), "finished": False, "run_name": run["run_name"], "args": asdict(args)}
    write_json(os.path.join(args.output_dir, RECORD), {**record, "metrics_file": run["metrics_file"],
                                                       "inputs": run["inputs"]})
    write_whole(os.path.join(os.path.dirname(run["metrics_file"]), OWNER),
                os.path.relpath(os.path.realpath(args.output_dir), os.path.realpath(".")) + "\n")
    writer = start_tensorboard(run["run_name"], args,
                               purge_step=start_iteration * args.batch_size + 1 if args.resume else None)
    for path in [run["metrics_file"], *(os.path.join(os.path.dirname(run["metrics_file"]), log) for log in logs)]:
        continue_metrics_file(path, start_iteration)
        open_log(path).close()
    print(f"{args.num_iterations} iterations of {args.batch_size} episodes; logging to {writer.log_dir}")
    return writer, open_log(run["metrics_file"])

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
        if not regular_file(os.path.join(checkpoint, file)):
            return f"{file} is not a rank's file of tensors"
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
    (every rank takes part); rank 0 writes the rest (begin_checkpoint first)."""
    is_main = dist.get_rank() == 0
    checkpoint_dir = os.path.join(args.output_dir, "resume")
    path = os.path.join(checkpoint_dir, f"iteration_{iteration}")
    state = {"iteration": iteration, **values, "args": asdict(args), "run_name": run_name}
    on_rank_0(lambda: begin_checkpoint(path, state))
    try:
        for name, engine in {**trained, **frozen}.items():
            if engine is not None:
                state[name] = save_training_state(engine, os.path.join(path + ".tmp", name), is_main)
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

def begin_checkpoint(path: str, state: dict) -> None:
    """Rank 0, before the checkpoint PATH is written: an earlier run's checkpoints removed (their space is free, and a
    failed write names only this run's checkpoint), then PATH.tmp made, its STATE (the engines' to come) its first file:
    from its first byte on, a folder that a later run recognises as a run's."""
    remove_earlier_runs(os.path.dirname(path), state["run_name"], read_state)
    try:
        os.makedirs(path + ".tmp")  # (one that a run left is gone: finish_removals)
    except OSError as error:
        fail(f"cannot write the checkpoint {path + '.tmp'!r} ({error.strerror}); " + (
            "it is in the way, and no run wrote it (no state.json): move it away" if os.path.lexists(path + ".tmp")
            else write_fix(error) + ", then run again with --resume"))
    write_json(os.path.join(path + ".tmp", "state.json"), state)

def finish_run(engines: dict, tokenizer, saved_by: dict, logs: list, start_time: float, args) -> None:
    """The end of a run: each engine (name -> engine, or None) saved as a Hugging Face folder in OUTPUT_DIR/NAME, LoRA
    merged in (every rank takes part), then the run's record marked finished and rank 0's LOGS closed."""
    record = {**saved_by, "iteration": args.num_iterations, "finished": True}
    saved = [name for name, engine in engines.items() if engine is not None]
    for name in saved:
        save_engine_folder(engines[name], tokenizer, os.path.join(args.output_dir, name), record, merge_lora=True)
    if dist.get_rank() == 0:
        write_json(os.path.join(args.output_dir, RECORD), {**(read_record(args.output_dir) or saved_by),
                                                           "finished": True})
        print(f"saved the {' and the '.join(saved)} to {', '.join(f'{args.output_dir}/{name}' for name in saved)} in "
              f"{time.time() - start_time:.0f}s")
        for log in logs:
            log.close()

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
