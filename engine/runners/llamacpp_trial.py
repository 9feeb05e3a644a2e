"""The child process of llama.cpp's AMX trial (llamacpp_probe.run_child): load a model with repacking, decode."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from engine.runners.llamacpp import LlamaCppRunner


def trial(path: Path) -> int:
    """Loads the model with llama.cpp's extra buffers and decodes a batch, then single tokens."""
    runner = LlamaCppRunner(path, n_ctx=256, repack=True)
    vocab = min(runner.vocab_size, 1000)
    runner.forward(torch.arange(16) % vocab)  # a prompt: the batched matmuls that died
    runner.forward(torch.arange(6) % vocab)  # a verify of K = 5
    runner.forward(torch.tensor([7]))  # one token
    return 0


def main(argv: list[str]) -> int:
    """The child's command line: one line and a non-zero status for anything but a model that decodes."""
    if len(argv) != 1:
        print("usage: python -m engine.runners.llamacpp_trial MODEL.gguf", file=sys.stderr)
        return 2
    try:
        return trial(Path(argv[0]))
    except Exception as exc:  # the parent logs this line; exit 1 is not kept as a verdict
        print(f"llamacpp_probe: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
