"""The user-facing engine: model loading, sampling, the generate loop."""
