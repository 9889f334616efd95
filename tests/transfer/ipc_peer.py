"""The decode side of a cuda_ipc test, in its own process (CUDA IPC cannot
open a handle in the process that exported it): a pool on `device`, the data
socket's receiver, and the lease table, driven over a multiprocessing pipe."""
from __future__ import annotations

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer import make_receiver
from pdd.transfer.leases import LeaseTable
from tests.transfer.conftest import make_pool


def serve_pool(conn, layout: dict, device: str, seed: int) -> None:
    layout = KVLayout.from_dict(layout)
    pool = make_pool(layout, seed).to(device)
    leases = LeaseTable()
    receiver = make_receiver("tcp", pool, layout, leases)
    receiver.start()
    conn.send(receiver.address)
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "grant":
                conn.send(leases.grant(*args))
            elif cmd == "close":
                conn.send(leases.close(*args))
            elif cmd == "released":
                conn.send(leases.released())
            elif cmd == "pool":
                torch.cuda.synchronize(device)
                conn.send(pool.cpu())
            else:
                conn.send(None)
                return
    finally:
        receiver.close()
