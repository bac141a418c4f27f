"""A training process that starts an asynchronous S3 save and keeps training until it is killed.

Arguments: CKPT_URL STEP. The S3 endpoint and credentials come from the environment. Prints
``SAVING`` once ``save_sharded(..., async_save=True)`` has returned.
"""

from __future__ import annotations

import sys
import time

import torch

from lightning_hpp.checkpoint import save_sharded
from tests.ckpt_workers.common import big_state


def main() -> None:
    url, step = sys.argv[1], int(sys.argv[2])
    state = big_state(step)
    save_sharded(state, url, step=step, async_save=True)
    print("SAVING", flush=True)
    while True:  # training goes on while the upload runs in the background
        with torch.no_grad():
            for tensor in state["model"].values():
                tensor.mul_(0.999)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
