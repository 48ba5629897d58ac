"""Building blocks shared by all model files: RMSNorm, rotary embedding, gated MLP."""
