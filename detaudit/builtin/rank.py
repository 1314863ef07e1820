"""One rank of the built-in engine's real TP, in its own worker process (`detaudit.workers.WorkerPool`
runs `python -m detaudit.builtin.rank`): it joins the process group (gloo on CPU, NCCL on GPU, one GPU
per rank) and serves one `LocalEngine` holding this rank's shards."""

from __future__ import annotations

import os

from detaudit.workers import exit_now, serve, worker_args


def main() -> None:
    rank, size, port, conn, listen_fd = worker_args()
    group = None

    def open_rank(options, extra: dict):
        nonlocal group
        os.environ["OMP_NUM_THREADS"] = str(extra["threads"])
        import torch

        from detaudit.builtin import dist
        from detaudit.builtin.local import LocalEngine

        device = f"cuda:{rank}" if options.settings.cuda else "cpu"
        if device != "cpu":
            torch.cuda.set_device(rank)
        torch.set_num_interop_threads(1)
        group = dist.init(rank, size, port, device, listen_fd=listen_fd)
        return LocalEngine(options, rank=rank, group=group, device=device, threads=extra["threads"])

    closed = False
    try:
        closed = serve(rank, conn, open_rank)
    finally:
        from detaudit.builtin import dist

        dist.shutdown(group)
    if closed:
        exit_now()


if __name__ == "__main__":
    main()
