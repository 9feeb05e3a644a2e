"""Prometheus metrics of the server, under the names vLLM and llama-server export (and ours beside them).

vLLM (v1/spec_decode/metrics.py): vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
_num_accepted_tokens_per_pos{position}; its request/token counters and latency histograms.
llama-server (--metrics): llamacpp:prompt_tokens_total, prompt_seconds_total, tokens_predicted_total,
tokens_predicted_seconds_total, requests_processing, requests_deferred. llama-server reports its draft
counts per response only (timings.draft_n / draft_n_accepted); their running sums are specdec:draft_n_total
and specdec:draft_n_accepted_total. Every server gets its own registry (tests run several).
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.limits import K_MAX
from engine.types import Step, Summary

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServeMetrics:
    """Counters fed by the HTTP layer as steps and answers arrive; gauges read from the scheduler."""

    def __init__(self, model: str, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        labels = {"model_name": model}
        self._labels = labels
        names = ("model_name",)
        # vLLM's speculative counters (prometheus_client appends _total).
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Steps that verified a draft.", names, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", names, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", names, registry=r)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by position in the draft.", (*names, "position"), registry=r)
        # vLLM's request and token counters.
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens taken in.", names, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", names, registry=r)
        self.success = Counter("vllm:request_success", "Requests answered, by why they finished.",
                               (*names, "finished_reason"), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Seconds to the first token.", names,
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Seconds from admission to the last token.",
                             names, buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Seconds a request waited in the queue.",
                                    names, buckets=_LATENCY, registry=r)
        Gauge("vllm:num_requests_running", "Requests being decoded.", names, registry=r) \
            .labels(**labels).set_function(running)
        Gauge("vllm:num_requests_waiting", "Requests waiting in the queue.", names, registry=r) \
            .labels(**labels).set_function(waiting)
        # llama-server's names.
        self.ll_prompt = Counter("llamacpp:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.ll_prompt_s = Counter("llamacpp:prompt_seconds", "Prompt process time.", registry=r)
        self.ll_predicted = Counter("llamacpp:tokens_predicted", "Generation tokens processed.", registry=r)
        self.ll_predicted_s = Counter("llamacpp:tokens_predicted_seconds", "Predict process time.", registry=r)
        Gauge("llamacpp:requests_processing", "Requests processing.", registry=r).set_function(running)
        Gauge("llamacpp:requests_deferred", "Requests deferred.", registry=r).set_function(waiting)
        # Ours.
        self.draft_n = Counter("specdec:draft_n", "Sum of timings.draft_n over answers.", registry=r)
        self.draft_n_accepted = Counter("specdec:draft_n_accepted", "Sum of timings.draft_n_accepted.", registry=r)
        self.target_forwards = Counter("specdec:target_forwards", "Target forwards after prefill.", registry=r)
        self.rejected = Counter("specdec:requests_rejected", "Requests refused, by HTTP status.", ("status",),
                                registry=r)
        self.cancelled = Counter("specdec:requests_cancelled", "Generations ended by a client that left.",
                                 registry=r)
        for pos in range(K_MAX):  # every position exists from the start, so rates never miss a series
            self.per_pos.labels(**labels, position=str(pos))

    def step(self, step: Step) -> None:
        """One round: its drafts and how far they were accepted (counted as they happen)."""
        if not step.proposed:
            return
        self.drafts.labels(**self._labels).inc()
        self.draft_tokens.labels(**self._labels).inc(len(step.proposed))
        self.accepted.labels(**self._labels).inc(step.accepted)
        for pos in range(step.accepted):
            self.per_pos.labels(**self._labels, position=str(pos)).inc()

    def finished(self, summary: Summary, finish: str, *, queued_s: float, ttft_s: float | None, e2e_s: float) -> None:
        self.prompt_tokens.labels(**self._labels).inc(summary.prompt_tokens)
        self.generation_tokens.labels(**self._labels).inc(summary.new_tokens)
        self.success.labels(**self._labels, finished_reason=finish).inc()
        self.queue_time.labels(**self._labels).observe(queued_s)
        if ttft_s is not None:
            self.ttft.labels(**self._labels).observe(ttft_s)
        self.e2e.labels(**self._labels).observe(e2e_s)
        self.ll_prompt.inc(summary.prompt_tokens)
        self.ll_prompt_s.inc(summary.prefill_s)
        self.ll_predicted.inc(summary.new_tokens)
        self.ll_predicted_s.inc(max(summary.seconds - summary.prefill_s, 0.0))
        self.draft_n.inc(summary.drafted)
        self.draft_n_accepted.inc(summary.accepted)
        self.target_forwards.inc(summary.target_forwards)

    def text(self) -> bytes:
        return generate_latest(self.registry)
