"""pdd.faults.when_armed: the request path's fault-injecting wrappers go in
only once a fault is set, so a process no fault was ever set in runs none.
In a fresh interpreter: whether this one has armed already depends on the
tests that ran in it before."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc

    from pdd import faults
    from pdd.kv.layout import KVLayout
    from pdd.transfer import make_sender
    from pdd.transfer.injected import HeldMessage
    from pdd.transfer.tcp import TcpMessage

    class Owner:
        pass

    faults.load_env({})
    layout = KVLayout(model_id="m", weights_hash="w", dtype="float32", block_size=4, num_layers=1,
                      num_kv_heads=1, head_dim=4)
    sender = make_sender("tcp", layout)
    installed = []
    kept, gone = Owner(), Owner()
    faults.when_armed(kept, installed.append)
    faults.when_armed(gone, installed.append)
    del gone
    gc.collect()
    assert sender.message_class is TcpMessage and installed == []   # nothing set: the plain path
    faults.apply({"transfer.send_delay_s": 0})
    assert sender.message_class is HeldMessage and installed == [kept]   # a seam gone is forgotten
    faults.apply({}, clear=True)
    late = Owner()
    faults.when_armed(late, installed.append)   # armed once: a new seam gets its wrapper at once
    assert sender.message_class is HeldMessage and installed == [kept, late]
    sender.close()
    print("ok")
""")


def test_wrappers_go_in_at_the_first_fault_set_and_stay():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"
