"""The Hydra entry point ``lightning-hpp-train`` (``train``), experiment snapshots (``snapshot``)
and the end-of-sweep summary (``summary``)."""
