"""`lmcli serve`: an OpenAI-compatible HTTP server with continuous batching and a chat page.

- ``batch_cache.py``: the batched KV cache whose rows join and leave between steps;
- ``scheduler.py``: the decoding thread: admission, the batch's layout, limits and delivery
  around the row engine (``generate.engine``), which decodes;
- ``protocol.py``: OpenAI request bodies to scheduler jobs, events to responses and chunks;
- ``app.py``: the Starlette endpoints, API key, body limit, server-sent events;
- ``server.py``: uvicorn, the graceful stop, a background server for tests and benchmarks;
- ``page.html``: the chat page served at ``/``.

Needs the ``serve`` extra (starlette, uvicorn, jinja2); see docs/serve.md.
"""
