"""Prometheus metrics of a server, in a registry of its own (so several can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)


class ServerMetrics:
    """The server's metrics. ``model_name`` labels the gauges published under vLLM's names
    (``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
    and its older name ``vllm:gpu_cache_usage_perc``), which inference gateways (the Gateway
    API inference extension, llm-d's endpoint picker) read to route requests. KV cache usage
    is blocks in use over blocks: with compression, a request holds at most its budget's
    blocks, so usage counts the requests' kept tokens, not their lengths."""

    def __init__(self, model_name: str = ""):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("zipage_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("zipage_requests_waiting", "Requests queued for the engine", registry=r)
        self.kv_blocks_used = Gauge("zipage_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("zipage_kv_blocks_total", "KV cache blocks in all", registry=r)
        self.kv_usage = Gauge("zipage_kv_cache_usage_ratio", "Share of KV cache blocks in use", registry=r)
        self.compressions = Counter("zipage_compressions", "Compressions of a request's KV cache", registry=r)
        self.preemptions = Counter("zipage_preemptions", "Requests preempted for lack of blocks", registry=r)
        self.prompt_tokens = Counter("zipage_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("zipage_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("zipage_requests_finished", "Requests finished, by reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("zipage_requests_rejected", "Requests refused because the queue was full",
                                registry=r)
        self.ttft = Histogram("zipage_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("zipage_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.latency = Histogram("zipage_request_latency_seconds", "From arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        vllm = dict(labelnames=["model_name"], registry=r)
        self.router_gauges = [
            (Gauge("vllm:num_requests_waiting", "Requests waiting for the engine (vLLM's name)", **vllm), "waiting"),
            (Gauge("vllm:num_requests_running", "Requests the engine is running (vLLM's name)", **vllm), "running"),
            (Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full (vLLM's name)", **vllm), "kv_usage"),
            (Gauge("vllm:gpu_cache_usage_perc", "KV cache usage, 1 = full (vLLM's older name)", **vllm), "kv_usage")]
        self.model_name = model_name
        # By KV budget: "full" (no compression) or the request's budget in tokens (its own or the
        # server's; multiples of the block size up to the server's, so few values).
        budget = ["kv_budget"]
        self.running_by_budget = Gauge("zipage_requests_running_by_kv_budget", "Requests running, by KV budget",
                                       budget, registry=r)
        self.finished_by_budget = Counter("zipage_requests_finished_by_kv_budget", "Requests finished, by KV budget",
                                          budget, registry=r)
        self.generation_tokens_by_budget = Counter("zipage_generation_tokens_by_kv_budget",
                                                   "Tokens generated, by KV budget", budget, registry=r)
        self.compressions_by_budget = Counter("zipage_compressions_by_kv_budget",
                                              "Compressions of finished requests, by KV budget", budget, registry=r)
        self.evicted_by_budget = Counter("zipage_evicted_tokens_by_kv_budget",
                                         "Tokens evicted from finished requests (per layer and KV head), by KV budget",
                                         budget, registry=r)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """The engine's load, under Zipage's names and vLLM's."""
        values = {"running": running, "waiting": waiting, "kv_usage": kv_usage}
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        for gauge, key in self.router_gauges:
            gauge.labels(self.model_name).set(values[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)
