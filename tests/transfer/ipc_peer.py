"""The decode side of a cuda_ipc test, in its own process (CUDA IPC cannot
open a handle in the process that exported it): a pool on `device`, the data
socket's receiver, and the lease table, driven over a multiprocessing pipe."""
from __future__ import annotations

import time

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer import make_receiver
from pdd.transfer.leases import LeaseTable
from tests.transfer.conftest import make_pool


def serve_pool(conn, layout: dict, device: str, seed: int, keys_dir: str | None = None) -> None:
    """Sends (address, the data socket's public key or "") once it listens;
    `keys_dir`: the data socket runs CURVE with that cluster's keys."""
    layout = KVLayout.from_dict(layout)
    pool = make_pool(layout, seed).to(device)
    leases = LeaseTable()
    security = None
    if keys_dir is not None:
        from pdd.security import data_security
        from tests.security.conftest import secure_config
        security = data_security(secure_config(keys_dir))
    receiver = make_receiver("tcp", pool, layout, leases, security=security)
    receiver.start()
    conn.send((receiver.address, security.public_key if security else ""))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "grant":
                conn.send(leases.grant(*args))
            elif cmd == "close":
                conn.send(leases.close(*args))
            elif cmd == "released":
                conn.send([lease.lease_id for lease in leases.released()])
            elif cmd == "pool":
                torch.cuda.synchronize(device)
                conn.send(pool.cpu())
            else:
                conn.send(None)
                return
    finally:
        receiver.close()


def wait_result(sender, rid: str, timeout: float = 60.0):
    """The sender's result for `rid` (a generous bound: only a broken transfer takes this long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in sender.poll():
            if r.request_id == rid:
                return r
        time.sleep(0.005)
    raise AssertionError(f"no result for {rid}")
