"""``kvload serve``: an OpenAI-compatible HTTP server over a loaded model (needs the ``serve`` extra).

``command`` holds the subcommand (importing nothing heavy); ``app`` the FastAPI app, ``protocol``
the request checks, ``metrics`` the Prometheus registry, ``server`` uvicorn around them.
"""
