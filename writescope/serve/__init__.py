"""``writescope serve``: an OpenAI-compatible HTTP server over the continuous-batching engine
(:mod:`writescope.engine.runner`), with ``stop`` strings, ``n`` choices and ``logprobs`` as the
OpenAI API defines them (:mod:`writescope.serve.app`). Needs the ``serve`` extra
(``pip install -e ".[serve]"``)."""
