"""Prometheus metrics, named as vLLM names them (``vllm:`` -> ``specgraft:``) so existing dashboards work.

Speculative decoding, per verification step of a request:
    num_drafts                  steps that verified at least one candidate
    num_draft_tokens            candidates verified (tree nodes without the root)
    num_accepted_tokens         candidates accepted (the bonus token excluded)
    num_accepted_tokens_per_pos accepted candidates by depth (0 = the root's child), vLLM's "position"
Ours: emitted tokens by source (head / matrix / context / bonus; the prefill token is not counted). Latencies: time to
first token, inter-token latency (a step's wall time shared by the tokens it emitted, one observation per token)
and end-to-end latency.

Each app owns a registry (tests run several apps in one process; every Ray replica exports its own).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # no ``*_created`` series: vLLM's exposition has none, and dashboards do not use them

PREFIX = "specgraft:"
_LATENCY = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TTFT = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, [*m, *labels], registry=r)

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Verification steps with at least one candidate.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Candidate tokens verified.")
        self.num_accepted = counter("spec_decode_num_accepted_tokens", "Candidate tokens accepted (no bonus).")
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Accepted candidates by depth.",
                               ["position"])
        self.by_source = counter("spec_decode_num_accepted_tokens_by_source",
                                 "Emitted tokens by source: head, matrix, context or the target's bonus token.", ["source"])
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the batch.", m, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for a batch slot.", m, registry=r)
        self.shed = counter("spec_decode_requests_shed", "Requests without a method admitted as AR: at the "
                            "batch they joined, the budget policy gave the server's --method auto choice no tree.")
        self.shed.labels(model_name)  # exported from the start, at 0
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.ttft = hist("time_to_first_token_seconds", "Arrival to the first token.", _TTFT)
        self.itl = hist("inter_token_latency_seconds", "Per-token latency after the first.", _ITL)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.", _LATENCY)

    def step(self, draft_tokens: int, accepted: int, sources: list[str]) -> None:
        """One request's verification step (see the module docstring)."""
        name = self.model_name
        if draft_tokens:
            self.num_drafts.labels(name).inc()
            self.num_draft_tokens.labels(name).inc(draft_tokens)
            self.num_accepted.labels(name).inc(accepted)
            for pos in range(accepted):
                self.per_pos.labels(name, str(pos)).inc()
        for src in sources:
            if src != "prefill":
                self.by_source.labels(name, src).inc()

    def tokens(self, n: int, gap_s: float | None) -> None:
        """``n`` tokens emitted ``gap_s`` after the request's previous output (None: the first output)."""
        self.generation_tokens.labels(self.model_name).inc(n)
        if gap_s is not None and n:
            for _ in range(n):
                self.itl.labels(self.model_name).observe(gap_s / n)
