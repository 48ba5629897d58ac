"""The ``writescope`` command line."""
