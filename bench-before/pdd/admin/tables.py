"""What `pdd admin` prints without --json: tables and short lines for people.

`render(command, result, args)` picks the command's formatter in FORMATTERS,
else `generic`: a list of maps as a table, a map as `key = value` lines (nested
keys dotted), anything else as it is. A new command reads well without a
formatter of its own; one that wants a better view adds a function here.
"""
from __future__ import annotations

import json
from argparse import Namespace
from collections.abc import Callable

SLOW_COLUMNS = ["request_id", "mode", "finish_reason", "duration_s", "ttft_s", "queued_s", "reserving_s",
                "prefilling_s", "decoding_s", "prefill_worker", "decode_worker", "fallbacks", "migrations"]
REQUEST_COLUMNS = ["request_id", "phase", "mode", "worker_id", "prefill_worker", "prompt_tokens", "output_tokens",
                   "buffered_tokens", "age_s", "migrations"]
WORKER_COLUMNS = ["worker_id", "role", "device", "accepting", "inflight", "running", "waiting", "free_blocks",
                  "num_blocks", "prefix_hit_rate", "last_seen_s_ago"]


def render(command: str, result, args: Namespace) -> str:
    if isinstance(result, dict) and isinstance(result.get("routers"), list):   # several routers (pdd.admin.fanout)
        return "\n\n".join(_router_section(command, r, args) for r in result["routers"])
    return FORMATTERS.get(command, generic)(result, args)


def _router_section(command: str, answer: dict, args: Namespace) -> str:
    head = f"== {answer['router']} ({answer['addr']})"
    if "error" in answer:
        return f"{head}\nerror: {answer['error']}"
    return f"{head}\n{FORMATTERS.get(command, generic)(answer['result'], args)}"


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def table(rows: list[dict], cols: list[str]) -> str:
    """`rows` under a header of `cols`, columns left-aligned to their widest cell."""
    cells = [[cell(r.get(c)) if c in r else "" for c in cols] for r in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(cols, widths))]
    lines += ["  ".join(v.ljust(wd) for v, wd in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def generic(result, args: Namespace | None = None) -> str:
    if isinstance(result, list):
        if not result:
            return "none"
        if all(isinstance(r, dict) for r in result):
            return table(result, list(dict.fromkeys(k for r in result for k in r)))
        return "\n".join(cell(r) for r in result)
    if isinstance(result, dict):
        lines = [f"{key} = {cell(value)}" for key, value in _flat(result)]
        return "\n".join(lines) or "none"
    return cell(result)


def _flat(d: dict, prefix: str = ""):
    for key, value in d.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def workers(rows: list[dict], args: Namespace | None = None) -> str:
    """The workers, then each prefill -> decode pair's KV transfer backend and why."""
    out = table(rows, WORKER_COLUMNS)
    pairs = [{"prefill": w["worker_id"], "decode": d, "backend": t["backend"] or "none", "why": t["reason"]}
             for w in rows for d, t in sorted(w.get("transfer_to", {}).items())]
    return out + ("\n\n" + table(pairs, ["prefill", "decode", "backend", "why"]) if pairs else "")


def placement(p: dict) -> str:
    """The policy and its settings, its decisions so far, and what it reads of each worker."""
    settings = "  ".join(f"{k}={v}" for k, v in p.get("settings", {}).items())
    decisions = "  ".join(f"{kind}/{reason}={n}" for kind, reasons in sorted(p.get("decisions", {}).items())
                          for reason, n in sorted(reasons.items()))
    lines = [f"placement: policy={p.get('policy')}" + (f"  {settings}" if settings else ""),
             f"decisions: {decisions or 'none yet'}"]
    if p.get("prefill_leaning"):
        lines.append(f"leaning to prefill: {', '.join(p['prefill_leaning'])}  "
                     f"demand={p.get('prefill_demand_tokens_s')} prompt tokens/s")
    estimates = p.get("estimates", {})
    cols = list(dict.fromkeys(k for e in estimates.values() for k in e))
    if cols:
        lines.append(table([{"worker_id": wid, **e} for wid, e in sorted(estimates.items())], ["worker_id", *cols]))
    return "\n".join(lines)


def status(r: dict, args: Namespace | None = None) -> str:
    served = ", ".join(r.get("served_model_names") or []) or r["model"]
    lines = [f"model {served}  ready={r['ready']}  accepting={r['accepting']}  "
             f"in flight={r['requests_in_flight']}  uptime={r['uptime_s']}s", workers(r["workers"])]
    if "placement" in r:
        lines.append(placement(r["placement"]))
    lines += [f"departed {d['worker_id']}: gone {d['gone_s']}s, forgotten in {d['forget_in_s']}s "
              "unless it registers again" for d in r.get("departed", [])]
    return "\n".join(lines)


def requests(rows: list[dict], args: Namespace) -> str:
    if getattr(args, "slow", False):
        return table(rows, SLOW_COLUMNS) if rows else "no finished request kept yet"
    return table(rows, REQUEST_COLUMNS) if rows else "no request in flight"


def trace(timelines: list[dict], args: Namespace | None = None) -> str:
    return "\n\n".join(_timeline(t) for t in timelines)


def _timeline(t: dict) -> str:
    """One request's timeline: its figures, the time in each phase, then each event."""
    ttft = f"{t['ttft_s']:.3f}s" if t.get("ttft_s") is not None else "-"
    head = (f"request {t['request_id']}  mode={t['mode']}  finish={t['finish_reason'] or '-'}"
            f"{'  (in flight)' if t.get('in_flight') else ''}  started {t['started_at']}\n"
            f"prompt={t['prompt_tokens']} cached={t['cached_tokens']} output={t['output_tokens']}  "
            f"ttft={ttft}  total={t['duration_s']:.3f}s  migrations={t['migrations']}\n"
            "time in phase: " + "  ".join(f"{p}={t[p + '_s']:.3f}s"
                                          for p in ("queued", "reserving", "prefilling", "decoding")))
    events = [{**e, "t_s": f"+{e['t_s']:.3f}", "prefill": e["prefill"] or "-", "decode": e["decode"] or "-"}
              for e in t["events"]]
    return head + "\n" + table(events, ["t_s", "event", "epoch", "prefill", "decode", "note"])


def log_level(r: dict, args: Namespace | None = None) -> str:
    parts = [f"router: {r['router']}"] if "router" in r else []
    if r.get("sent_to"):
        parts.append(f"{r['level']} sent to {', '.join(r['sent_to'])}")
    return "; ".join(parts) or "no worker to send it to"


def drain(r: dict, args: Namespace) -> str:
    kept = (f"kept in {r['kept_in']}" if r.get("kept_in")
            else r.get("warning") or "not kept across a router restart: no router.state_dir")
    line = f"worker {r['worker_id']} drained: no new requests ({kept})"
    if "waited_s" in r:
        line += f"\nworker {r['worker_id']} has no request in flight (waited {r['waited_s']:.1f}s)"
    return line


def undrain(r: dict, args: Namespace | None = None) -> str:
    return f"worker {r['worker_id']} takes new requests again" + (f"\n{r['warning']}" if r.get("warning") else "")


def abort(r: dict, args: Namespace | None = None) -> str:
    return f"aborted {', '.join(r['aborted'])}: its client gets an error, its workers free its blocks"


def version(r: dict, args: Namespace | None = None) -> str:
    rows = [{"process": "admin client", **r.get("client", {})}, {"process": "router", **r["router"]}]
    rows += [{"process": wid, **(build or {"version": "unknown (a worker too old to say)"})}
             for wid, build in r["workers"].items()]
    return table(rows, list(dict.fromkeys(k for row in rows for k in row)))


def breaker(rows: list[dict], args: Namespace | None = None) -> str:
    return table(rows, list(dict.fromkeys(k for r in rows for k in r))) if rows else "no breaker yet (no pair placed)"


def cache_flush(result: dict, args: Namespace) -> str:
    reset = ", ".join(f"{wid} ({n} blocks)" for wid, n in sorted(result["reset"].items())) or "no worker"
    lines = [f"prefix cache flushed on {reset}"]
    if result["no_answer"]:
        lines.append(f"no answer within {result['timeout_s']:g}s from {', '.join(result['no_answer'])}")
    return "\n".join(lines)


FORMATTERS: dict[str, Callable[[object, Namespace], str]] = {
    "status": status, "workers": workers, "requests": requests, "trace": trace, "log-level": log_level,
    "cache": cache_flush,
    "drain": drain, "undrain": undrain, "abort": abort, "version": version, "breaker": breaker,
}
