"""The entry point of every headless command: parse, dispatch, and turn any failure into one line."""
from __future__ import annotations

import argparse
import logging
import sys

from app.cli import options as opt
from app.cli.common import PROG, CliError, fail, setup_logging
from app.cli.parser import build_parser
from engine.errors import EngineError, ModelWontFitError

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; bad input and engine errors are one stderr line and exit code 2."""
    try:
        args = build_parser().parse_args(argv)
        opt.check_devices(args)
    except CliError as e:
        return fail(str(e))
    except argparse.ArgumentTypeError as e:
        return fail(str(e))
    except SystemExit as e:  # --help and --version exit through argparse
        return int(e.code or 0)
    if args.command == "cache":  # no torch, no transformers: answers in a moment
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        from app.cli.cache import cmd_cache

        try:
            return cmd_cache(args)
        except (CliError, EngineError) as e:
            return fail(str(e))
        except OSError as e:
            return fail(f"cannot use the cache: {e.strerror or e} ({e.filename})")
    setup_logging(args.verbose)
    import torch

    if args.command == "sweep":
        from app.cli.sweep import cmd_sweep as command
    elif args.command == "distill":
        from app.cli.distill import cmd_distill as command
    elif args.command == "plan":
        from app.cli.plan import cmd_plan as command
    elif args.command == "check":
        from app.cli.check import run as command
    else:
        from app.cli.bench import cmd_bench
        from app.cli.generate import cmd_generate
        from app.cli.serve import run as cmd_serve

        command = {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve}[args.command]
    try:
        return command(args)
    except ModelWontFitError as e:
        from engine.models.plan import format_plan

        print(format_plan(e.plan), file=sys.stderr)  # type: ignore[arg-type]  # a MemoryPlan
        return fail(f"{e} (--force loads it anyway)")
    except (CliError, EngineError) as e:
        return fail(str(e))
    except torch.OutOfMemoryError:
        return fail("out of memory while generating: lower --max-new-tokens or --k, use --dtype bfloat16, "
                     "or a smaller model")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specdec-studio generate ... | head` closed the pipe: not an error
        return 0
    except OSError as e:  # a file or folder the checks above could not foresee (a full disk, a vanished file)
        log.debug("OSError", exc_info=True)
        return fail(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
    except Exception as e:  # a bug: still one line for the person (the details with -v), never a traceback
        log.info("internal error", exc_info=True)
        what = (str(e).strip().splitlines() or [""])[0][:200]
        return fail(f"internal error ({type(e).__name__}: {what}); run again with -v for the details, and "
                     f"please report it")
