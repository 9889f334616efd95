"""`pdd admin` on a cluster of several routers: each command goes to every router.

Each router places its own requests and keeps its own view of the workers, so a
command that changes the cluster (drain, breaker, cache flush, log level,
faults) must reach all of them, and one that reads (status, workers, requests,
...) shows what each one sees. The answer is one entry per router, in the
config's order:

    {"routers": [{"router": "router-0", "addr": ..., "result": ...},
                 {"router": "router-1", "addr": ..., "error": ..., "kind": ..., "exit_code": 3}]}

A router that does not answer does not stop the others from being asked; the
exit code is the worst of the errors. `abort ID` is done where the request is:
the routers that do not hold it say so, which is no error while one did.
`drain --wait` waits until no router has a request on the worker.
"""
from __future__ import annotations

from pdd.admin.client import AdminError, call, follow, wait_idle
from pdd.admin.commands import BY_NAME


def ask_every_router(args, command, wire: list, targets: list) -> dict:
    answers = []
    for name, addr, token, keys in targets:
        def ask(cmd: str, *cmd_args, addr=addr, token=token, keys=keys):
            return call(addr, token, cmd, *cmd_args, security=keys, timeout_s=BY_NAME[cmd].timeout_s)
        entry = {"router": name, "addr": addr}
        try:
            result = ask(command.name, *wire)
            entry["result"] = result if args.admin_command == "drain" else follow(args, result, ask)
        except AdminError as e:
            entry.update(error=str(e), kind=e.kind, exit_code=e.exit_code)
        answers.append(entry)
    if command.name == "abort" and any("result" in a for a in answers):
        # Not held by a router is that router's "no such request": only where none held it is it an error.
        answers = [a for a in answers if "result" in a or a["kind"] != "refused"]
    if args.admin_command == "drain" and getattr(args, "wait", False):
        held = {a["addr"] for a in answers if "result" in a}
        asks = [lambda t=t: call(t[1], t[2], "workers", security=t[3], timeout_s=BY_NAME["workers"].timeout_s)
                for t in targets if t[1] in held]
        waited = wait_idle(args.worker, args.timeout, lambda: _workers_of_all(asks), {})
        for a in answers:
            if "result" in a:
                a["result"] = {**a["result"], "waited_s": waited["waited_s"]}
    return {"routers": answers}


def _workers_of_all(asks) -> list[dict]:
    """Every worker as the routers see it together: requests in flight summed
    over the routers (each counts its own), the rest from the first that has it."""
    merged: dict[str, dict] = {}
    for ask in asks:
        for w in ask():
            seen = merged.get(w["worker_id"])
            if seen is None:
                merged[w["worker_id"]] = dict(w)
            else:
                seen["inflight"] += w["inflight"]
    return list(merged.values())
