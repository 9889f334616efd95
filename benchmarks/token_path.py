"""What a streamed token's pure Python costs the router, in this process, in
two parts (no sockets, no HTTP, no writes):

- control plane: a step's TokenBatch decoded from its bytes and handled by the
  ControlPlane (the request looked up and checked, its tokens and timings kept,
  the metrics, the event posted), for --streams requests decoding on one worker;
- text: what the relay's flush makes of one token besides the write, its text
  (TextStream: detokenized, looked at for stop strings) and its chunk's bytes
  (StreamChunks), over a stream of the tiny tokenizer's plain words;
- and the codec alone: a decode step's TokenBatch (a token an item) decoded, as
  the router does, and encoded, as the worker does, per item, with its bytes.

    python -m benchmarks.token_path --streams 256 --steps 200

A before/after: run it with an older commit's pdd first on the path
(PYTHONPATH=DIR:$PWD python -P -m benchmarks.token_path), alternately, in one sitting.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.cli import run_as_main

from pdd.api import SamplingParams
from pdd.config import RouterConfig
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.http.responses import StreamChunks
from pdd.http.text_stream import TextStream
from pdd.model.make_model import make_model
from pdd.model.tokenizer import Tokenizer
from pdd.protocol.codec import decode, encode
from pdd.router.control import ControlPlane
from pdd.router.metrics import RouterMetrics
from pdd.router.registry import WorkerRegistry


def add_args(p) -> None:
    p.add_argument("--streams", type=int, default=256, help="requests decoding at once")
    p.add_argument("--steps", type=int, default=200, help="TokenBatches handled")
    p.add_argument("--repeat", type=int, default=5, help="timed runs (the best is printed with the median)")


def one_run(streams: int, steps: int) -> float:
    """Microseconds per item of a run."""
    sent: list[m.Message] = []
    cfg = RouterConfig(mode="colocated")
    control = ControlPlane(cfg, WorkerRegistry(cfg.heartbeat_interval_s, cfg.heartbeat_misses,
                                               cfg.liveness_grace_s), RouterMetrics(),
                           lambda peer, msg: sent.append(msg))
    layout = KVLayout("bench", "0", "float32", 16, 2, 1, 8)
    control.handle("w0", m.Register("w0", "colocated", "host", 1, "cpu", layout.to_dict(), 1 << 20, 1 << 16,
                                    1 << 16, incarnation="bench"))
    states = [control.submit(list(range(1, 25)), SamplingParams(max_tokens=1 << 20), f"r{i}")
              for i in range(streams)]
    for state in states:
        state.listener = lambda _state: None   # the relay's place: what it would flush stays posted
    admits = [msg for msg in sent if isinstance(msg, m.Admit)]
    assert len(admits) == streams, f"{len(admits)} of {streams} requests placed"
    batches = [encode(m.TokenBatch("w0", [m.TokenItem(a.request_id, a.epoch, k, [1000 + k % 50]) for a in admits]))
               for k in range(steps)]
    t0 = time.perf_counter()
    for data in batches:
        control.handle("w0", decode(data))
        for state in states:   # as the relay takes them
            state.take_now()
    return (time.perf_counter() - t0) / (steps * streams) * 1e6


def codec_run(streams: int, reps: int = 500) -> tuple[float, float, int]:
    """(decode, encode) microseconds per item of a decode step's TokenBatch, and its bytes."""
    batch = m.TokenBatch("w0", [m.TokenItem(f"cmpl-{i:032x}", 1, 100 + i, [1234]) for i in range(streams)])
    data = encode(batch)
    t0 = time.perf_counter()
    for _ in range(reps):
        decode(data)
    t1 = time.perf_counter()
    for _ in range(reps):
        encode(batch)
    t2 = time.perf_counter()
    return (t1 - t0) / (reps * streams) * 1e6, (t2 - t1) / (reps * streams) * 1e6, len(data)


def text_run(tokenizer: Tokenizer, ids: list[int], rounds: int = 20) -> float:
    """Microseconds per token of a stream's text and chunk."""
    req = SimpleNamespace(kind="completion", request_id="cmpl-bench", created=0, model="tiny", include_usage=False)
    chunks = StreamChunks(req)
    plain = getattr(chunks, "plain", None) or (lambda i, text: chunks.chunk(i, text))   # (an older pdd's)
    t0 = time.perf_counter()
    for _ in range(rounds):
        text = TextStream(tokenizer, stop_token_ids={0})
        for token in ids:
            delta = text.add([token])
            if delta:
                plain(0, delta)
    return (time.perf_counter() - t0) / (rounds * len(ids)) * 1e6


def main(a) -> int:
    control = sorted(one_run(a.streams, a.steps) for _ in range(a.repeat))
    codec = [codec_run(a.streams) for _ in range(a.repeat)]
    decodes, encodes = sorted(c[0] for c in codec), sorted(c[1] for c in codec)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        make_model(model)
        tokenizer = Tokenizer(model)
        ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 50, add_special_tokens=False)
        text = sorted(text_run(tokenizer, ids) for _ in range(a.repeat))
    print(json.dumps({"streams": a.streams, "steps": a.steps,
                      "control_plane_us_per_item": {"best": round(control[0], 2),
                                                    "median": round(control[len(control) // 2], 2)},
                      "text_and_chunk_us_per_token": {"best": round(text[0], 2),
                                                      "median": round(text[len(text) // 2], 2)},
                      "token_batch_decode_us_per_item": {"best": round(decodes[0], 3),
                                                         "median": round(decodes[len(decodes) // 2], 3)},
                      "token_batch_encode_us_per_item": {"best": round(encodes[0], 3),
                                                         "median": round(encodes[len(encodes) // 2], 3)},
                      "token_batch_bytes": codec[0][2]}))
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
