"""`rollout serve`: an OpenAI-compatible HTTP server over an inference engine.

    from rollout.serve.app import ServerSettings, create_app
    app = create_app(engine, ServerSettings(model_name="sft-tiny", api_key="k"))

`app.py` holds the routes (generation goes through
`rollout.inference.sampler.BatchingSampler`: the bounded queue and the worker
thread that batches requests into forward passes), `protocol.py` the OpenAI
bodies and response shapes, `http.py` errors, auth and body limits,
`metrics.py` the Prometheus metrics.
"""
