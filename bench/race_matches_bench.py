"""Does the Race tab report the speedup that `specdec-studio bench` measures? Prints both.

Drives the real main window offscreen: loads the pair through the real worker, then races every
prompt of assets/bench_prompts.jsonl (standard, then speculative, each alone on the device) and
sums tokens and seconds per mode exactly as bench does. Compare with a bench JSON of the same
settings:

    .venv/bin/python bench/race_matches_bench.py --bench-json bench/results/cpu_fp32.json --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-json", type=Path, help="a bench --json result with the same settings to compare with")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--target", default="")
    ap.add_argument("--draft", default="")
    ap.add_argument("--limit", type=int, default=0, help="race only the first N prompts (0: all)")
    ap.add_argument("--json", type=Path, help="write the per-prompt race results here")
    args = ap.parse_args()

    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from engine.settings import GenerationSettings, ModelChoice, ModelSelection

    app = QApplication.instance() or QApplication([])
    settings_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"race-vs-bench-{os.getpid()}.ini"
    window = MainWindow(settings=AppSettings(settings_file))

    def wait(signal, timeout_s: float) -> list:
        loop, got = QEventLoop(), []
        signal.connect(lambda *a: (got.append(a), loop.quit()))
        QTimer.singleShot(int(timeout_s * 1000), loop.quit)
        loop.exec()
        return got

    def choice(spec: str) -> ModelChoice:
        return ModelChoice("folder", spec) if spec else ModelChoice()

    t0 = time.perf_counter()
    window.load_models(ModelSelection(target=choice(args.target), draft=choice(args.draft)))
    if not wait(window.models_loaded, 1800):
        print("models did not load", file=sys.stderr)
        return 2
    print(f"loaded {window.info.target_name} + {window.info.draft_name} ({window.info.dtype}, "
          f"{window.info.fast_path}) in {time.perf_counter() - t0:.0f} s", flush=True)
    # The bench sends the prompt alone: no system prompt here either.
    window.panel.set_values(GenerationSettings(k=args.k, max_new_tokens=args.max_new_tokens, system_prompt=""))
    prompts = window.race.prompts[: args.limit or None]
    rows = []
    for prompt in prompts:
        window.race_view.set_prompt_text(prompt.prompt)
        window.race_view.set_repeats(1)
        window.race.start(prompt.prompt, 1)
        if not wait(window.race.race_finished, 1800):
            print(f"race on {prompt.id} did not finish", file=sys.stderr)
            return 2
        r = window.race.results[-1]
        rows.append(r)
        print(f"{prompt.id:>4} {prompt.category:<12} standard {r.standard.tokens_per_s:6.2f} tok/s  "
              f"speculative {r.speculative.tokens_per_s:6.2f} tok/s  speedup {r.speedup:.2f}x  "
              f"identical {r.identical}", flush=True)

    def rate(mode: str) -> float:
        summaries = [getattr(r, mode) for r in rows]
        return sum(s.new_tokens for s in summaries) / sum(s.seconds for s in summaries)

    race_speedup = rate("speculative") / rate("standard")
    out = {"race": {"standard_tokens_per_s": rate("standard"), "speculative_tokens_per_s": rate("speculative"),
                    "speedup": race_speedup, "identical": sum(bool(r.identical) for r in rows), "compared": len(rows)}}
    print(f"race: standard {rate('standard'):.2f} tok/s, speculative {rate('speculative'):.2f} tok/s, "
          f"speedup {race_speedup:.3f}x, identical {out['race']['identical']}/{len(rows)}")
    if args.bench_json:
        bench = json.loads(args.bench_json.read_text())["summary"]
        out["bench"] = {"speedup": bench["speedup"], "standard_tokens_per_s": bench["standard"]["tokens_per_s"],
                        "speculative_tokens_per_s": bench["speculative"]["tokens_per_s"]}
        out["race_over_bench"] = race_speedup / bench["speedup"]
        print(f"bench: speedup {bench['speedup']:.3f}x -> race / bench = {out['race_over_bench']:.3f} "
              f"({'within' if abs(out['race_over_bench'] - 1) <= 0.10 else 'NOT within'} 10%)")
    if args.json:
        write_record(args.json, {k: str(v) for k, v in vars(args).items()}, out)
    window.close()
    app.processEvents()
    return 0


if __name__ == "__main__":
    sys.exit(main())
