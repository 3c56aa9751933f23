"""``specgraft serve``: an OpenAI-compatible HTTP server on the one engine loop (docs/serving.md).

    app.py       FastAPI routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, / (playground)
    protocol.py  request validation (OpenAI's fields + ours), responses, the error envelope
    runner.py    one engine thread: a bounded waiting queue, continuous batching, aborts and timeouts
    metrics.py   prometheus metrics with vLLM's names under our prefix
    ray.py       the same app as a Ray Serve deployment (optional extra ``specgraft[ray]``)
"""
