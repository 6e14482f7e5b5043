"""What crossing a process boundary costs, for the remote-learner design (docs/remote.md).

    python benchmarks/remote_boundary.py --out benchmarks/results/remote_boundary.json

Times, between two CPU processes, each way a candidate backend moves weights (learner -> collectors) and batches
(collectors -> learner), medians of interleaved repetitions: ``shared`` (a copy into a shared-memory buffer the
peer maps, then a one-byte notification: torchrl's shared-memory weight sync), ``pipe`` (the bytes pickled through
a pipe, as an RPC without shared memory), ``torch_mp`` (a fresh tensor through ``torch.multiprocessing``: its
storage moved to shared memory, a handle sent) and ``gloo`` (``send``/``recv`` on a gloo group). Payloads: the
21M-parameter policy's weights (84 MB) and a PPO batch of 2048 MuJoCo-like frames.
"""
from __future__ import annotations

import statistics
import time
from datetime import timedelta

import harness
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAYLOADS = {"weights_21M": 21_000_000, "ppo_batch_2048": 2048 * (2 * 17 + 6 + 1 + 1 + 1 + 1 + 1)}
REPS = 9


def _peer(conn, port: int, shared: dict[str, torch.Tensor]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=timedelta(seconds=120))
    buffers = {k: torch.empty(n) for k, n in PAYLOADS.items()}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        how, name = msg
        if how == "shared":
            value = float(shared[name][0])  # read through the mapping: the bytes are already here
        elif how in ("pipe", "torch_mp"):
            value = float(conn.recv()[0])
        else:
            dist.recv(buffers[name], src=0)
            value = float(buffers[name][0])
        conn.send(value)
    dist.destroy_process_group()


def parser():
    return harness.parser(__doc__)


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    port = harness.free_port()
    shared = {k: torch.zeros(n).share_memory_() for k, n in PAYLOADS.items()}
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(there, port, shared), daemon=True)
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                            timeout=timedelta(seconds=120))
    data = {k: torch.randn(n) for k, n in PAYLOADS.items()}
    times: dict[str, list[float]] = {}
    try:
        for rep in range(REPS):
            order = harness.rotation(rep, ["shared", "pipe", "torch_mp", "gloo"])
            for name, tensor in data.items():
                for how in order:
                    tensor[0] = float(rep)
                    start = time.perf_counter()
                    if how == "shared":
                        shared[name].copy_(tensor)
                        here.send((how, name))
                    elif how == "pipe":
                        here.send((how, name))
                        here.send(tensor.numpy())  # bytes through the pipe, as a plain RPC would send them
                    elif how == "torch_mp":
                        here.send((how, name))
                        here.send(tensor.clone())  # torch's reducer moves the storage to shared memory, sends a handle
                    else:
                        here.send((how, name))
                        dist.send(tensor, dst=1)
                    assert here.recv() == float(rep)  # the peer holds this repetition's payload
                    times.setdefault(f"{name}/{how}", []).append(time.perf_counter() - start)
    finally:
        here.send(None)
        peer.join(timeout=60)
        dist.destroy_process_group()
    result = {}
    for key, ts in times.items():
        name = key.split("/")[0]
        ms = statistics.median(ts[1:]) * 1e3  # the first repetition warms up
        result[key] = {"median_ms": round(ms, 2), "MB_per_s": round(PAYLOADS[name] * 4 / 1e6 / (ms / 1e3))}
        print(f"{key:28s} {ms:9.2f} ms  {result[key]['MB_per_s']:7d} MB/s", flush=True)
    if args.out:
        harness.write_result(args.out, {"reps": REPS, "payload_floats": PAYLOADS, "results": result})
    return result


if __name__ == "__main__":
    main()
