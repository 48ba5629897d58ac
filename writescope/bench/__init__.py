"""``writescope bench``: policies side by side over a grid of batch sizes and contexts."""
