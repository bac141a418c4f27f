"""Scripts the checkpoint tests start as real processes, and what they share."""
