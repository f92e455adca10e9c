"""difftune: train from one YAML job file.

    python run.py config/job.yaml [more.yaml ...] [--name NAME] [--recover] [--quiet]
    accelerate launch run.py config/job.yaml
    python run.py --control RUN_FOLDER stop|save|sample     # steer a running job
    python run.py --status RUN_FOLDER                       # running / stopped / finished / failed / crashed
    python run.py --report RUN_FOLDER                       # rebuild RUN_FOLDER/report.html
    python run.py --convert-lora IN OUT --to comfy|diffusers|peft [--arch ARCH] [--model NAME_OR_PATH]
    python run.py --models-from COMFY_MODELS_DIR [--arch ARCH]   # the bases in a ComfyUI folder, as `model:` sections
    python run.py --ui [TRAINING_FOLDER] [--host 127.0.0.1] [--port 8675] [--token T] [--allow-outside]
                  [--gpus 0,1 --gpus 2,3]                  # the web dashboard and its job queue (docs/ui.md)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("difftune")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune diffusion models (LoRA) from job files.")
    parser.add_argument("configs", nargs="*", metavar="CONFIG", help="job file path, or a name under config/")
    parser.add_argument("--name", help="fills [name] in the job files")
    parser.add_argument("--recover", action="store_true", help="go on with the next job after a failure")
    parser.add_argument("--quiet", action="store_true", help="no progress bars (logs still go to stderr)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error too (also: "
                        "DIFFTUNE_DEBUG=1)")
    parser.add_argument("--control", nargs=2, metavar=("RUN_FOLDER", "ACTION"),
                        help="ask the run training in RUN_FOLDER to stop (saving a checkpoint), save or sample now")
    parser.add_argument("--status", metavar="RUN_FOLDER", help="print the state of the run in RUN_FOLDER")
    parser.add_argument("--report", metavar="RUN_FOLDER", help="rebuild RUN_FOLDER/report.html from its files")
    parser.add_argument("--convert-lora", nargs=2, metavar=("IN", "OUT"),
                        help="rewrite an adapter file in the other form (effective deltas unchanged)")
    parser.add_argument("--to", choices=["comfy", "diffusers", "peft"],
                        help="--convert-lora: the form to write (peft: a folder for PeftModel.from_pretrained)")
    parser.add_argument("--arch", help="--convert-lora: the model family, when the file's header does not say; "
                        "--models-from: the one family to look for")
    parser.add_argument("--models-from", metavar="COMFY_MODELS_DIR", help="list which files of a ComfyUI models "
                        "folder make a complete base for each family, and print the `model:` section to paste")
    parser.add_argument("--model", help="--convert-lora from kohya keys: the model whose module names resolve them "
                        "(default: the base model in the file's header)")
    parser.add_argument("--import-config", metavar="FILE", help="write a difftune job that means the same training "
                        "as an ai-toolkit job or a kohya sd-scripts configuration, and print what each key became")
    parser.add_argument("-o", "--output", metavar="OUT", help="--import-config: the job file to write (default: "
                        "FILE's name with .difftune.yaml)")
    parser.add_argument("--force", action="store_true", help="--import-config: replace OUT if it exists")
    parser.add_argument("--family", choices=["sd15", "sdxl", "flux"], help="--import-config of a kohya "
                        "configuration: the model family, where its arguments cannot tell SD 1.x from SDXL")
    parser.add_argument("--ui", nargs="?", const="output", metavar="TRAINING_FOLDER",
                        help="serve the web dashboard for the runs under TRAINING_FOLDER (default: output)")
    parser.add_argument("--host", default="127.0.0.1", help="--ui: the address to listen on (any address but a "
                        "loopback one needs a token)")
    parser.add_argument("--port", type=int, default=8675, help="--ui: the port (default 8675)")
    parser.add_argument("--token", help="--ui: the token every request must carry (generated and printed when the "
                        "host is not a loopback address)")
    parser.add_argument("--allow-outside", action="store_true", help="--ui: queued jobs may write outside "
                        "TRAINING_FOLDER")
    parser.add_argument("--gpus", action="append", metavar="IDS", help="--ui: a CUDA_VISIBLE_DEVICES set for queued "
                        "jobs; give it several times to run that many jobs at once (default: one at a time)")
    args = parser.parse_args(argv)
    if args.convert_lora is not None and args.to is None:
        parser.error("--convert-lora needs --to comfy, --to diffusers or --to peft")
    tools = [name for name in ("control", "status", "report", "convert_lora", "ui", "import_config", "models_from")
             if getattr(args, name) is not None]
    if len(tools) > 1 or (tools and args.configs):
        parser.error("give job files, or one of --control / --status / --report / --convert-lora / --ui / "
                     "--import-config / --models-from")
    if not tools and not args.configs:
        parser.error("give one or more job files (or --control / --status / --report / --convert-lora / --ui / "
                     "--import-config / --models-from)")
    if args.output is not None and args.import_config is None:
        parser.error("-o/--output goes with --import-config")
    return args


def run_tool(args: argparse.Namespace) -> int:
    """--control / --status / --report / --convert-lora / --ui / --import-config: the tools beside training."""
    from toolkit.run import control
    from toolkit.run.report import write_report

    if args.convert_lora is not None:
        return convert_lora(args)
    if args.models_from is not None:
        return models_from(args)
    if args.import_config is not None:
        return import_config(args)
    if args.ui is not None:
        return serve_ui(args)
    if args.control is not None:
        folder, action = Path(args.control[0]), args.control[1]
        try:
            path = control.request(folder, action)
        except (ValueError, FileNotFoundError) as err:
            log.error("%s", err)
            return 2
        log.info("asked %s to %s (%s); the trainer acts at its next update", folder, action, path.name)
        return 0
    if args.status is not None:
        state, line = control.describe_status(Path(args.status))
        print(line)
        return 0 if state in ("running", "finished", "stopped") else 1
    folder = Path(args.report)
    if not (folder / "metrics.jsonl").is_file() and not (folder / "config.yaml").is_file():
        log.error("%s is not a run folder (no metrics.jsonl or config.yaml)", folder)
        return 2
    print(write_report(folder))
    return 0


def import_config(args: argparse.Namespace) -> int:
    """--import-config: another trainer's job file as a difftune job that means the same training, the table of what
    each key became, and the keys to check; the written job is checked against the schema before it is kept."""
    from jobs.registry import build_registry
    from toolkit.config.importers.importer import convert, default_output, output_problem, write_job
    from toolkit.config.loader import ConfigError, validate_job
    from toolkit.errors import UserError

    source = Path(args.import_config)
    out = Path(args.output) if args.output else default_output(source)
    try:
        if not source.is_file():
            raise UserError(f"--import-config: {source} not found")
        problem = output_problem(source, out, args.force)
        if problem:
            raise UserError(problem)
        conversion = convert(source, args.family)
        print(conversion.table())
        # checked before anything is written: a job difftune would refuse is not left behind, and the refusal is
        # told in the source file's keys
        try:
            validate_job(conversion.job, out, build_registry(ROOT / "extensions"))
        except ConfigError as err:
            lines = str(err).splitlines()
            raise UserError(conversion.refusal(source, lines[1:] or lines)) from err
        write_job(conversion, out)
    except UserError as err:
        report_user_error(err, args)
        return 1
    print(f"\nwrote {out}; check the list above, then: python run.py {out}")
    return 0


def serve_ui(args: argparse.Namespace) -> int:
    """--ui: the dashboard, with a job queue whose jobs run as `python run.py JOB` processes."""
    from jobs.registry import build_registry
    from toolkit.ui.app import serve

    return serve(Path(args.ui), build_registry(ROOT / "extensions"), ROOT / "config", ROOT / "run.py", args.host,
                 args.port, args.token, args.allow_outside, args.gpus)


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    # bitsandbytes warns on CPU-only machines that an optional 4-bit kernel package is missing; difftune
    # does not use that kernel, so the warning is noise on every start.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def run_jobs(args: argparse.Namespace) -> int:
    """Every job file is read and checked against the schema before the first one starts, and before any training
    library is imported: a typo in the third file fails in a second, not after two trainings. A job's paths are
    checked just before it starts (an earlier job may write what a later one reads)."""
    from jobs.registry import build_registry
    from toolkit.config.loader import load_config
    from toolkit.errors import UserError

    registry = build_registry(ROOT / "extensions")
    loaded, failed = [], []
    for arg in args.configs:
        try:
            config, path = load_config(arg, registry, name=args.name, config_root=ROOT / "config")
            loaded.append((arg, config, path))
        except UserError as err:
            report_user_error(err, args)
            failed.append(arg)
    if failed and not args.recover:
        log.error("failed: %s", ", ".join(failed))
        return 1
    for arg, config, path in loaded:
        outcome = run_job(arg, config, path, registry, args)
        if outcome == "stopped":
            return 0
        if outcome == "failed":
            failed.append(arg)
            if not args.recover or distributed():
                if args.recover:
                    log.error("--recover does not apply under a multi-process launch: a failed process stops the "
                              "launch")
                break
    if failed:
        log.error("failed: %s", ", ".join(failed))
    return 1 if failed else 0


def run_job(arg: str, config, path: Path, registry, args: argparse.Namespace) -> str:
    """One job: "finished", "failed", or "stopped" (Ctrl-C, --control stop: the whole command ends cleanly)."""
    from toolkit.config.loader import check_paths
    from toolkit.errors import UserError

    try:
        # before the training libraries load: a missing folder is said in a second (what an earlier process of the
        # job writes is checked when the process that reads it starts)
        check_paths(config, path, skip_earlier_outputs=True)
        from jobs.job import get_job
        from jobs.process.base_process import StopRequested
    except UserError as err:
        report_user_error(err, args)
        return "failed"
    try:
        get_job(config, path, registry).run()
    except StopRequested as stop:
        log.info("%s", stop)
        return "stopped"
    except UserError as err:
        report_user_error(err, args)
        return "failed"
    except Exception:
        log.exception("job %s failed", arg)
        return "failed"
    return "finished"


def report_user_error(err: Exception, args: argparse.Namespace) -> None:
    """One clear message; the traceback only when asked for (it is noise for a typo or a missing folder)."""
    if args.debug or os.environ.get("DIFFTUNE_DEBUG", "").lower() in ("1", "true", "yes"):
        log.error("%s", err, exc_info=err)
    else:
        log.error("%s", err)


def load_for_names(family, arch: str, source: Path, given: str | None, in_header: str | None):
    """The model whose module names resolve a file's names (kohya's flattened ones, another layout, text encoders):
    `--model`, else the base model its header names (else, for a family that builds its parts from configs, its
    first published variant). A family that can builds every part on the meta device from configs alone, no weight
    read (`ModelAdapter.for_module_names`); the others load the model on the CPU for that only."""
    import torch

    from toolkit.errors import UserError
    from toolkit.models.registry import model_config

    model = given or in_header
    try:
        built = family.for_module_names(model)
    except (OSError, ValueError, UserError) as err:
        if given:
            raise ValueError(f"{source}: converting it needs the model's module names, and --model {given!r} gave "
                             f"none ({err})") from err
        built = family.for_module_names(None)  # the header's base is not here: the family's published layout
    if built is not None:
        return built
    if not model:
        raise ValueError(f"{source}: converting it needs the model's module names; give --model")
    try:
        return family.load(model_config(arch=arch, name_or_path=model), torch.device("cpu"), torch.float32)
    except (OSError, ValueError) as err:
        said = "--model" if given else "the base model its header names (a local path is reduced to its last " \
            "component there)"
        raise ValueError(f"{source}: converting it needs the model's module names, and {said}, {model!r}, did not "
                         f"load ({err}); give --model with the model's folder, file or hub id") from err


def convert_lora(args: argparse.Namespace) -> int:
    """--convert-lora: the same conversion code as saving, between the ComfyUI/kohya form, the diffusers form and
    a peft folder; kohya's flattened names are resolved against the model's real module names (the model is
    loaded for that only)."""
    from toolkit.errors import UserError
    from toolkit.models.registry import get_adapter_class
    from toolkit.network.files import (
        ComponentNaming,
        convert_file,
        has_other_components,
        is_comfy_file,
        read_header,
    )

    source, target = Path(args.convert_lora[0]), Path(args.convert_lora[1])
    try:
        header = {} if source.is_dir() else read_header(source)
        arch = args.arch or header.get("difftune_arch")
        if arch is None:
            raise ValueError(f"{source}: its header does not name the model family; give --arch")
        family = get_adapter_class(arch)
        files = family.files
        # kohya names are flattened (reading them needs the real module names); some families' kohya names also
        # follow another module layout (writing them needs the model's structure); text-encoder weights need the
        # text encoders' module trees
        relayout = args.to == "comfy" and files.comfy_renames is not None
        others = family.facts.text_encoder_lora and has_other_components(source, files)
        renamed = files.comfy_separator == "_" or files.comfy_renames is not None
        if others or (renamed and (is_comfy_file(source, files) or relayout)):
            adapter = load_for_names(family, arch, source, args.model, header.get("difftune_base_model"))
            # components that share their files' names (one file per expert) need naming once: the first
            components = list({c.prefix: c for c in reversed(adapter.lora_components(text_encoders=others))}.values())
            namings = [ComponentNaming.of(c) for c in reversed(components)]
        else:
            namings = [ComponentNaming.of_files(files)]
        count = convert_file(source, target, args.to, namings)
    except (ValueError, OSError, UserError) as err:  # FileNotFoundError included
        log.error("%s", err)
        return 2
    log.info("wrote %s (%s form, %d modules)", target, args.to, count)
    return 0


def models_from(args: argparse.Namespace) -> int:
    """--models-from: the bases a ComfyUI models folder holds, family by family (file headers only)."""
    from toolkit.errors import UserError
    from toolkit.models.comfy_folder import report
    from toolkit.models.registry import available_archs, family_files

    try:
        families = {arch: family_files(arch) for arch in available_archs()}
        if args.arch and families.get(args.arch, family_files(args.arch)) is None:
            raise UserError(f"--arch {args.arch}: difftune lists no ComfyUI files of this family (docs/models.md, "
                            "\"A base from single files\")")
        readable = {arch: files for arch, files in families.items() if files is not None}
        print(report(args.models_from, readable, [args.arch] if args.arch else None), end="")
    except (UserError, ValueError) as err:
        log.error("%s", err)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"  # tqdm's own switch: library bars (diffusers, accelerate) go quiet too
    if (args.control or args.status or args.report or args.convert_lora or args.ui or args.import_config
            or args.models_from):
        return run_tool(args)
    return run_jobs(args)


if __name__ == "__main__":
    sys.exit(main())
