"""Entry point `specdec-studio`: the desktop app, or the headless `generate` / `bench` commands."""
from __future__ import annotations

import os
import signal
import sys


def _interrupted_early(_signum: int, _frame: object) -> None:
    """Ctrl+C while the first imports run: nothing to clean up yet, so one line and exit 130 at once."""
    os.write(2, b"specdec-studio: interrupted\n")
    os._exit(130)


# The very first thing: a Ctrl+C from here on is one line, never a traceback from inside an import. Only
# when started as the program (python -m app.main, the specdec-studio script), not when a test imports us;
# a shell that started us with SIGINT ignored, for a background job, keeps it ignored.
_STARTED = __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "").startswith("specdec-studio")
if _STARTED and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_early)

import argparse  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from engine.settings import PRECISIONS, ModelChoice, ModelSelection  # noqa: E402

log = logging.getLogger(__name__)

# Two models on one GPU fragment the caching allocator over hours; expandable segments keep memory flat.
# Set before torch initialises CUDA (nothing above imports torch); a value the user set is kept.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

HEADLESS_COMMANDS = ("generate", "bench", "sweep", "distill", "cache", "plan", "check", "serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdec-studio",
        description="Watch speculative decoding work. Headless: specdec-studio generate|bench|sweep|distill|cache|plan --help.",
    )
    p.add_argument("--target", default=None, help="model folder, .gguf file or hub id (default: the packaged pair)")
    p.add_argument("--draft", default=None, help="model folder, .gguf file or hub id (default: the packaged pair)")
    p.add_argument("--no-draft", action="store_true", help="load the target only (n-gram or standard decoding)")
    p.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: last used, else auto)")
    p.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float16", "float32"],
                   help="float dtype of both models (default: last used, else auto)")
    p.add_argument("--target-quant", "--target-dtype", dest="target_dtype", default=None, choices=PRECISIONS,
                   help="the target's precision: int8 / nf4 (bitsandbytes) or a float dtype (default: last used)")
    p.add_argument("--draft-quant", "--draft-dtype", dest="draft_dtype", default=None, choices=PRECISIONS,
                   help="the draft's precision (default: last used)")
    p.add_argument("--context", type=int, default=None, help="positions each KV cache holds (default: last used)")
    p.add_argument("--runtime", default=None, choices=["auto", "torch", "llamacpp"],
                   help="auto: llama.cpp on the CPU for GGUF models, torch otherwise (default: last used, else auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per decode (llama.cpp, torch on a CPU), 0 = chosen for the cores "
                        "(default: last used, else 0)")
    p.add_argument("--demo", action="store_true", help="no models: a scripted engine streams a sample answer")
    p.add_argument("--settings", default=None, help="use this .ini file for settings instead of the user's")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    # For tests and scripted checks: close the window after this many milliseconds (as if by Ctrl+Q).
    p.add_argument("--quit-after-ms", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _selection_from_args(args: argparse.Namespace, saved: ModelSelection) -> ModelSelection:
    """Command-line models override the remembered ones; unspecified parts keep what was saved."""
    return ModelSelection(
        target=saved.target if args.target is None else ModelChoice.from_spec(args.target),
        draft=saved.draft if args.draft is None else ModelChoice.from_spec(args.draft),
        device=args.device or saved.device,
        dtype=args.dtype or saved.dtype,
        no_draft=args.no_draft or (saved.no_draft and args.draft is None),
        target_precision=args.target_dtype or saved.target_precision,
        draft_precision=args.draft_dtype or saved.draft_precision,
        context=saved.context if args.context is None else max(0, args.context),
        runtime=args.runtime or saved.runtime,
        threads=saved.threads if args.threads is None else max(0, args.threads),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the app or a headless command; a Ctrl+C at any moment is one line and exit 130."""
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_early:
            # From here KeyboardInterrupt is caught, so the commands can clean up (partial files) as they stop.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return _run(argv)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, _interrupted_early)  # a second Ctrl+C while this line is written
        print("specdec-studio: interrupted", file=sys.stderr)
        return 130


def _no_display() -> str:
    """Why the window cannot open here (a Linux machine with no display and no Qt platform chosen), or "".
    Qt would otherwise abort with several lines about platform plugins."""
    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM"):
        return ""
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return ""
    return ("no display to open the window on: start it on a desktop, under Xvfb (xvfb-run specdec-studio), "
            "or use a headless command (generate, bench, serve, ...; see --help)")


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in HEADLESS_COMMANDS:
        from app.cli import (
            main as cli_main,  # torch and friends only when a command runs
        )

        return cli_main(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    missing = _no_display()
    if missing:
        print(f"specdec-studio: {missing}", file=sys.stderr)
        return 2
    from PySide6.QtWidgets import QApplication

    from app.ui.settings import APPLICATION, ORGANIZATION, AppSettings
    from widgets.palette import load_stylesheet

    app = QApplication.instance() or QApplication([sys.argv[0], *argv])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationDisplayName(APPLICATION)
    app.setStyle("Fusion")  # the same look on every platform; the stylesheet is written against it
    app.setStyleSheet(load_stylesheet())

    from app.ui.window import MainWindow

    settings = AppSettings(args.settings)
    if args.demo:
        from app.core.demo import ScriptedEngine

        window = MainWindow(engine_factory=lambda _req, _progress: ScriptedEngine(), settings=settings)
    else:
        window = MainWindow(settings=settings)
    window.show()
    if args.quit_after_ms is not None:
        from PySide6.QtCore import QTimer

        QTimer.singleShot(min(max(0, args.quit_after_ms), 2**31 - 1), window.close)
    # The default (or remembered) pair loads in the background while the window is already usable; a remote
    # server chosen last time is used again instead, unless models are named on the command line.
    asked = any(getattr(args, name) is not None for name in ("target", "draft", "device", "runtime")) or args.demo
    if settings.remote().use and not asked:
        window.use_remote(settings.remote())
    else:
        window.load_models(_selection_from_args(args, settings.models()))
    code = app.exec()
    # The window must go before the QApplication: the reverse order crashes PySide6 at exit.
    del window
    gc.collect()
    return code


if __name__ == "__main__":
    sys.exit(main())
