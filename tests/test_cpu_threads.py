"""The CPU thread policy: counts for the cores found, a person's override, OpenMP's passive wait, and that
llama.cpp decodes the same greedy answers whatever the counts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import cpu_threads
from engine.cpu_threads import ThreadPolicy, choose_threads, prepare_openmp
from engine.types import GenerationRequest, Message

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the choice

@pytest.mark.parametrize("cores, decode, batch", [(1, 1, 1), (2, 2, 2), (3, 3, 3), (4, 3, 4), (8, 7, 8), (64, 63, 64)])
def test_auto_counts_for_fake_core_counts(cores, decode, batch):
    policy = choose_threads(cores, wait="passive")
    assert (policy.decode, policy.batch, policy.chosen, policy.cores) == (decode, batch, "auto", cores)


def test_a_persons_count_is_used_for_both_widths():
    policy = choose_threads(8, requested=3, wait="passive")
    assert (policy.decode, policy.batch, policy.chosen) == (3, 3, "setting")
    assert choose_threads(2, requested=6, wait="passive").decode == 6  # more than the cores: theirs to ask
    for unset in (None, 0):  # 0 is the setting's "auto"
        assert choose_threads(8, requested=unset, wait="passive").chosen == "auto"


def test_labels_and_descriptions_name_the_counts_and_the_wait():
    assert choose_threads(2, wait="passive").label() == "2 threads"
    assert choose_threads(1, wait="passive").label() == "1 thread"
    eight = choose_threads(8, wait="passive")
    assert eight.label() == "7 threads (8 for prompts)"
    assert eight.describe() == ("7 threads (8 for prompts), chosen for 8 physical cores; "
                                "idle threads sleep (OMP_WAIT_POLICY=PASSIVE)")
    assert "--threads" in choose_threads(8, requested=2, wait="spin").describe()
    assert "spin" in choose_threads(2, wait="spin").describe()


def test_physical_cores_is_at_least_one_and_at_most_the_cpus_allowed():
    assert 1 <= cpu_threads.physical_cores() <= len(os.sched_getaffinity(0))


# --------------------------------------------------------------------------- OpenMP's wait

def test_passive_wait_is_asked_for_when_nobody_chose_and_openmp_has_not_loaded():
    environ: dict[str, str] = {}
    assert prepare_openmp(environ, modules={}) == "passive"
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("environ, wait", [({"OMP_WAIT_POLICY": "active"}, "spin"),
                                           ({"OMP_WAIT_POLICY": "PASSIVE"}, "passive"),
                                           ({"GOMP_SPINCOUNT": "1000"}, "GOMP_SPINCOUNT=1000")])
def test_a_persons_openmp_variables_are_kept(environ, wait):
    before = dict(environ)
    assert prepare_openmp(environ, modules={}) == wait
    assert environ == before


def test_too_late_once_torch_loaded_openmp():
    environ: dict[str, str] = {}
    assert prepare_openmp(environ, modules={"torch": object()}) == "spin"
    assert environ == {}  # setting it now would only make the process claim what it does not do


def test_importing_the_engine_first_makes_openmp_wait_passively():
    """libgomp itself reports the wait it runs with (OMP_DISPLAY_ENV): importing engine before torch is enough."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import engine, torch; torch.ones(64, 64) @ torch.ones(64, 64)"
    shown = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_DISPLAY_ENV": "TRUE", "PYTHONPATH": str(ROOT)},
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr[-500:]
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in shown.stderr


# --------------------------------------------------------------------------- llama.cpp with the policy

@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tests.tiny_gguf import save_gguf_pair

    return save_gguf_pair(tmp_path_factory.mktemp("threads"), noise=0.02, seed=0)


def test_the_runner_gives_llamacpp_both_counts(ggufs):
    from engine.runners.llamacpp import LlamaCppRunner

    runner = LlamaCppRunner(ggufs[0], n_ctx=128, threads=1, batch_threads=2)
    lib = runner._lib
    assert (lib.llama_n_threads(runner._ctx), lib.llama_n_threads_batch(runner._ctx)) == (1, 2)
    runner.set_threads(2)
    assert (lib.llama_n_threads(runner._ctx), lib.llama_n_threads_batch(runner._ctx)) == (2, 2)
    runner.close()


def test_greedy_answers_are_identical_whatever_the_thread_counts(ggufs, tmp_path, monkeypatch):
    """The engine's policy (auto) and a person's count load the same pair; greedy standard and speculative
    answers must be token for token the same, and the info names the counts the runners use."""
    from engine import assemble
    from engine.loadspec import LoadSpec

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(assemble, "physical_cores", lambda: 4)  # auto: 3 threads for a row, 4 for prompts
    answers = {}
    for threads in (None, 1):
        engine = assemble.build_engine(LoadSpec(str(ggufs[0]), str(ggufs[1]), runtime="llamacpp", threads=threads))
        expected = (3, 4) if threads is None else (1, 1)
        assert (engine.info.threads, engine.info.threads_batch) == expected
        assert (engine.target_runner.threads, engine.target_runner.batch_threads) == expected
        assert engine.info.threads_note.startswith(choose_threads(4, threads, wait=cpu_threads.wait_policy()).label())
        for mode in ("standard", "speculative"):
            for prompt in ("def add(a, b):", "快速排序是一种"):
                run = engine.generate(GenerationRequest(messages=(Message("user", prompt),), mode=mode, k=4,
                                                        max_new_tokens=24, proposer="draft"))
                list(run)
                answers.setdefault((mode, prompt), []).append(run.token_ids)
    for key, runs in answers.items():
        assert runs[0] and runs[0] == runs[1], key
    assert answers[("standard", "def add(a, b):")][0] == answers[("speculative", "def add(a, b):")][0]


def test_torch_keeps_its_own_count_unless_the_policy_differs(monkeypatch):
    from engine.runners.cpu import use_torch_threads

    before = torch.get_num_threads()
    try:
        assert use_torch_threads(ThreadPolicy(2, 2, "passive", "auto", 2)) == before  # torch's default already
        assert use_torch_threads(ThreadPolicy(1, 1, "passive", "setting", 2)) == 1
        assert use_torch_threads(ThreadPolicy(3, 4, "passive", "auto", 4)) == 3
    finally:
        torch.set_num_threads(before)
