"""The GPU memory budget: weight sizes by kind and the memory plan (docs/DESIGN.md section 6)."""
