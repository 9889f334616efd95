"""What a NIXL descriptor costs, and whether prepped descriptor lists remove it:
one WRITE of N scattered pages between two agents of this process (UCX over host
memory), its descriptors listed per write (get_xfer_descs + initialize_xfer, as
pdd.transfer.nixl_agent.Agent.write does) or prepped once per pool
(prep_xfer_dlist) and named by index per write (make_prepped_xfer).

    python -m tests.transfer.bench_nixl_descriptors [N]      # N pages of 4 KiB (default 16384)
"""
import time, sys
import numpy as np, torch
from pdd.transfer.nixl_agent import Agent, _load

nixl = _load()
N = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
page = 4096                      # small pages: the time is the descriptors', not the bytes'
src = torch.zeros(N * page, dtype=torch.uint8); dst = torch.zeros(N * page, dtype=torch.uint8)
a, b = Agent("p"), Agent("d")
a.register(src); b.register(dst)
peer = a.add_peer(b.metadata())
ag = a._agent
perm = np.random.default_rng(0).permutation(N)
local = [(src.data_ptr() + i * page, page, 0) for i in range(N)]
remote = [(dst.data_ptr() + int(j) * page, page, 0) for j in perm]

def wait(h):
    while True:
        s = ag.check_xfer_state(h)
        b._agent.get_new_notifs()      # the target progresses too (no progress threads)
        if s == "DONE": break
        assert s != "ERR", s
    ag.release_xfer_handle(h)

def listed():
    t0 = time.perf_counter()
    h = ag.initialize_xfer("WRITE", ag.get_xfer_descs(local, "DRAM"), ag.get_xfer_descs(remote, "DRAM"), peer, b"x")
    t1 = time.perf_counter(); ag.transfer(h); wait(h)
    return t1 - t0, time.perf_counter() - t0

t0 = time.perf_counter()
lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.data_ptr() + i * page, page, 0) for i in range(N)], "DRAM")
rh = ag.prep_xfer_dlist(peer, [(dst.data_ptr() + i * page, page, 0) for i in range(N)], "DRAM")
prep_s = time.perf_counter() - t0
li = np.arange(N); ri = perm

def prepped():
    t0 = time.perf_counter()
    h = ag.make_prepped_xfer("WRITE", lh, li, rh, ri, b"x")
    t1 = time.perf_counter(); ag.transfer(h); wait(h)
    return t1 - t0, time.perf_counter() - t0

for name, fn in (("listed", listed), ("prepped", prepped)):
    fn()
    r = [fn() for _ in range(5)]
    post = sorted(x[0] for x in r)[2]; total = sorted(x[1] for x in r)[2]
    print(f"{name:8s} {N} descriptors: building the transfer {1e3*post:.1f} ms ({1e6*post/N:.2f} us each), "
          f"posted and done {1e3*total:.1f} ms ({1e6*total/N:.2f} us each)")
print(f"prep once: {1e3*prep_s:.1f} ms for both lists")
