"""Saves a screenshot of the main window after one streamed answer, a race or a sweep (scripted engine or real models),
or of the "Train a draft head" dialog showing the training log of the head in use.

    .venv/bin/python tools/screenshot.py --real --tune --tune-prompts 2 --max-new-tokens 16 --out assets/screenshot-tune.png
    .venv/bin/python tools/screenshot.py --real --runtime torch --train-dialog --out assets/screenshot-train.png
    .venv/bin/python tools/screenshot.py --remote http://127.0.0.1:8000/v1 --max-new-tokens 48 --out assets/screenshot-remote.png
    .venv/bin/python tools/screenshot.py --proposer head --mode auto --tokens --hover-branch --out assets/screenshot-tree.png
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "用中文解释快速排序，然后 show me a short Python version."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(ROOT / "assets" / "screenshot.png"))
    p.add_argument("--real", action="store_true", help="load the default pair instead of the scripted engine")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--size", default="1480x900")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for loading + answer")
    p.add_argument("--max-new-tokens", type=int, default=0, help="override the panel's max new tokens")
    p.add_argument("--mid", type=int, default=0, help="grab mid-answer, once this many tokens have streamed")
    p.add_argument("--race", action="store_true", help="run the prompt in the Race tab and grab the finished race")
    p.add_argument("--theme", choices=["light", "dark"], default="light")
    p.add_argument("--conversations", type=int, default=0,
                   help="saved conversations to show in the sidebar (scripted ones, in a throw-away data folder)")
    p.add_argument("--beside", default="", help="also save the last answer rendered beside its token view here")
    p.add_argument("--runtime", default="auto", choices=["auto", "torch", "llamacpp"], help="with --real")
    p.add_argument("--proposer", default="", help="the panel's proposer (draft, ngram, draft+ngram, head)")
    p.add_argument("--mode", default="", help="the panel's mode (standard, speculative, auto)")
    p.add_argument("--tune", action="store_true", help="run a sweep in the Tune tab and grab it finished")
    p.add_argument("--tune-k", default="1,2,3,5,8", help="the Tune tab's K list")
    p.add_argument("--tune-t", default="0,0.7", help="the Tune tab's temperatures")
    p.add_argument("--tune-prompts", type=int, default=2, help="how many bench prompts the sweep uses")
    p.add_argument("--train-dialog", action="store_true",
                   help="open File > Train a draft head... and grab only that dialog: with --real --runtime torch it "
                        "shows the training log of the head loaded for the target")
    p.add_argument("--dialog-size", default="760x760", help="the train dialog's size, with --train-dialog")
    p.add_argument("--welcome", action="store_true", help="grab the empty chat (the welcome pane) once loaded")
    p.add_argument("--rejected-display", choices=["mark", "flash"], default="",
                   help="how the answer shows rejected drafts (default: the palette's)")
    p.add_argument("--temperature", type=float, default=None, help="the panel's temperature")
    p.add_argument("--remote", default="", metavar="URL",
                   help="chat through this OpenAI-compatible server instead of loading models (e.g. a running serve)")
    p.add_argument("--remote-model", default="", help="the model to ask the --remote server for (default: its first)")
    p.add_argument("--tokens", action="store_true", help="show the finished answer's coloured tokens, not its markdown")
    p.add_argument("--hover-branch", action="store_true",
                   help="with --tokens: hover the first token a draft tree's branch brought and grab its tooltip too")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)

    import os

    # Never the user's conversations: a throw-away data folder, seeded with scripted ones if asked.
    os.environ["SPECDEC_DATA_DIR"] = tempfile.mkdtemp(prefix="specdec-shot-")
    import shiboken6
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.core.demo import ScriptedEngine
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from engine.settings import ModelSelection
    from widgets.palette import load_stylesheet
    from widgets.remote_box import RemoteChoice

    app = QApplication.instance() or QApplication(["specdec-studio"])
    app.setStyle("Fusion")
    app.setStyleSheet(load_stylesheet())
    settings = AppSettings(Path(tempfile.mkdtemp()) / "settings.ini")  # never the user's layout
    settings.set_theme(args.theme)
    if args.conversations:
        from app.core.conversations import ConversationStore, default_folder
        from app.core.demo import demo_conversations

        demo_conversations(ConversationStore(default_folder()), args.conversations)
    if args.real:
        window = MainWindow(settings=settings)
    else:
        window = MainWindow(engine_factory=lambda _r, _p: ScriptedEngine(delay_s=0.02, acceptance=0.88),
                            settings=settings)
    width, height = (int(v) for v in args.size.split("x"))
    window.resize(width, height)
    window.show()

    def wait_for(condition, timeout_s: float) -> None:
        loop = QEventLoop()
        timer = QTimer()
        timer.timeout.connect(lambda: loop.quit() if condition() else None)
        timer.start(50)
        QTimer.singleShot(int(timeout_s * 1000), loop.quit)
        loop.exec()

    if args.remote:
        window.use_remote(RemoteChoice(use=True, url=args.remote, model=args.remote_model))
        wait_for(lambda: not window.model_label.text().startswith("Remote: first"), 30)  # the server named its model
    else:
        window.load_models(ModelSelection(runtime=args.runtime))
        wait_for(lambda: window.info is not None or not window.is_loading(), args.timeout)
    if window.info is None:
        print("models did not load", file=sys.stderr)
        return 1
    if args.max_new_tokens:
        window.panel.set_values(replace(window.panel.values(), max_new_tokens=args.max_new_tokens))
    if args.proposer or args.mode:
        values = window.panel.values()
        window.panel.set_values(replace(values, proposer=args.proposer or values.proposer, mode=args.mode or values.mode))
    if args.temperature is not None:
        window.panel.set_values(replace(window.panel.values(), temperature=args.temperature))
    if args.rejected_display:
        from widgets import token_text

        original = token_text.TokenTextView.__init__

        def with_display(self, *a, **k) -> None:
            original(self, *a, **k)
            self.set_rejected_display(args.rejected_display)

        token_text.TokenTextView.__init__ = with_display  # every answer view made from now on
    shot = window  # what is grabbed
    if args.welcome:
        pass
    elif args.train_dialog:
        if window.info.runtime != "torch":  # the window would say so in a modal box, which a script cannot close
            print(f"the train dialog needs the torch runtime (loaded: {window.info.runtime}); pass --runtime torch",
                  file=sys.stderr)
            return 1
        if window.info.head_name is None:
            logging.warning("no draft head was loaded for %s: the dialog shows no training log",
                            window.info.target_name)
        shot = window.open_train_dialog()
        shot.resize(*(int(v) for v in args.dialog_size.split("x")))
    elif args.tune:
        view = window.tune_view
        window.show_tab(view)
        view.ks.setText(args.tune_k)
        view.temperatures.setText(args.tune_t)
        view.prompts.setValue(args.tune_prompts)
        if args.max_new_tokens:
            view.max_new_tokens.setValue(args.max_new_tokens)
        view.start_button.click()
        wait_for(lambda: window.tune.running, 5.0)
        wait_for(lambda: not window.tune.running, args.timeout)
    elif args.race:
        window.show_tab(window.race_view)
        window.race_view.set_prompt_text(args.prompt)
        window.race_view.race_button.click()
        wait_for(lambda: not window.race.running, args.timeout)
    else:
        window.prompt.set_text(args.prompt)
        window.prompt.edit.submitted.emit()

        def streamed() -> int:
            rid = window.active_request
            entry = window.session._in_flight.get(rid) if rid is not None else None
            return sum(s.new_tokens for s in entry.steps) if entry is not None else 1 << 30

        wait_for(lambda: window.active_request is None or (args.mid and streamed() >= args.mid), args.timeout)
    if args.tokens and window.chat.answer_ids():
        window.chat.set_answer_markdown(window.chat.answer_ids()[-1], False)
    # Let the charts' timer and the layout settle (briefly for a flash: it lasts only until the next step).
    wait_for(lambda: False, 0.5 if args.rejected_display != "flash" or not args.mid else 0.03)
    grabbed = shot.grab()
    if args.hover_branch and window.chat.answer_ids():
        hover_branch(window, grabbed, wait_for)
    grabbed.save(args.out)
    print(f"saved {args.out}")
    if args.beside:
        save_beside(window, args.beside, wait_for)
        print(f"saved {args.beside}")
    window.close()
    shiboken6.delete(window)  # before the QApplication goes, or PySide6 can crash at exit
    gc.collect()
    return 0


def hover_branch(window, pixmap, wait_for) -> None:
    """Shows the tooltip of the last token a draft tree's branch brought and paints it into `pixmap` below the
    token, inside the chat column (a tooltip is a window of its own: the main window's grab leaves it out)."""
    from PySide6.QtCore import QPoint
    from PySide6.QtGui import QPainter, QTextCursor
    from PySide6.QtWidgets import QApplication, QToolTip

    view = window.chat.token_view(window.chat.answer_ids()[-1])
    spans = [s for s, _e, _status in view.token_spans() if view.token_at(s).branch]
    if not spans:
        logging.warning("no token came through a branch: nothing to hover")
        return
    cursor = QTextCursor(view.document())
    cursor.setPosition(spans[-1] + 1)
    caret = view.cursorRect(cursor)
    QToolTip.showText(view.viewport().mapToGlobal(caret.center()), view.tooltip_at(spans[-1]), view.viewport())
    wait_for(lambda: False, 0.3)
    tip = next((w for w in QApplication.topLevelWidgets() if w.inherits("QTipLabel") and w.isVisible()), None)
    if tip is None:
        logging.warning("the tooltip did not show")
        return
    below = view.viewport().mapTo(window, caret.bottomLeft()) + QPoint(-4, 6)
    column = window.chat.mapTo(window, QPoint(window.chat.width(), 0)).x()
    painter = QPainter(pixmap)
    painter.drawPixmap(QPoint(max(0, min(below.x(), column - tip.width() - 8)), below.y()), tip.grab())
    painter.end()


def save_beside(window, path: str, wait_for) -> None:
    """The last answer twice, side by side: rendered as markdown, then as its coloured tokens."""
    from PySide6.QtGui import QColor, QPainter, QPixmap

    rid = window.chat.answer_ids()[-1]
    bubble = window.chat._assistants[rid]
    window.chat.set_answer_markdown(rid, True)
    wait_for(lambda: bubble.showing_markdown() and bubble.markdown.is_complete(), 10)
    wait_for(lambda: False, 0.3)
    rendered = bubble.grab()
    window.chat.set_answer_markdown(rid, False)
    wait_for(lambda: False, 0.3)
    tokens = bubble.grab()
    window.chat.set_answer_markdown(rid, True)
    gap = 16
    out = QPixmap(rendered.width() + tokens.width() + 3 * gap, max(rendered.height(), tokens.height()) + 2 * gap)
    out.fill(QColor(window.palette().window().color()))
    painter = QPainter(out)
    painter.drawPixmap(gap, gap, rendered)
    painter.drawPixmap(2 * gap + rendered.width(), gap, tokens)
    painter.end()
    out.save(path)


if __name__ == "__main__":
    sys.exit(main())
