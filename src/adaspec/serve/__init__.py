"""``adaspec serve``: an OpenAI-compatible streaming server that learns from its traffic.

app.py (FastAPI app factory and uvicorn runner), protocol.py (request / response shapes and
OpenAI error JSON), scheduler.py (bounded queue and the engine worker), state.py (learnt state
and its file), metrics.py (Prometheus), output.py (stop strings and streamed text).
"""

from .app import (DEFAULT_DRAFTERS, DEFAULT_LENGTH, DEFAULT_SELECTOR, SUFFIX_STORE_TOKENS, ServeConfig, create_app,
                  default_drafters, run_server, serve_drafters)

__all__ = ["DEFAULT_DRAFTERS", "DEFAULT_LENGTH", "DEFAULT_SELECTOR", "SUFFIX_STORE_TOKENS", "ServeConfig", "create_app",
           "default_drafters", "run_server", "serve_drafters"]
