"""``writescope serve``: an OpenAI-compatible HTTP server over the continuous-batching engine
(:mod:`writescope.engine.runner`). Needs the ``serve`` extra (``pip install -e ".[serve]"``)."""
