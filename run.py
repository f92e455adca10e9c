"""difftune: train from one YAML job file.

    python run.py config/job.yaml [more.yaml ...] [--name NAME] [--recover]
    accelerate launch run.py config/job.yaml
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
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="job file path, or a name under config/")
    parser.add_argument("--name", help="fills [name] in the job files")
    parser.add_argument("--recover", action="store_true", help="go on with the next job after a failure")
    return parser.parse_args(argv)


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
    from jobs import build_registry, get_job
    from jobs.process.base_process import StopRequested
    from toolkit.config import ConfigError, load_config

    registry = build_registry(ROOT / "extensions")
    failed = []
    for arg in args.configs:
        try:
            config, path = load_config(arg, registry, name=args.name, config_root=ROOT / "config")
            get_job(config, path, registry).run()
        except StopRequested as stop:
            log.info("%s", stop)
            return 0
        except ConfigError as err:
            log.error("%s", err)
            failed.append(arg)
        except Exception:
            log.exception("job %s failed", arg)
            failed.append(arg)
        if failed and (not args.recover or distributed()):
            if args.recover and distributed():
                log.error("--recover does not apply under a multi-process launch: a failed process stops the launch")
            break
    if failed:
        log.error("failed: %s", ", ".join(failed))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    return run_jobs(args)


if __name__ == "__main__":
    sys.exit(main())
