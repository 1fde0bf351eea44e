#!/usr/bin/python3
"""PyTorch's own GPipe (torch.distributed.pipeline.sync.Pipe) on the benchmark's MLP, for
comparison with bench/pipeline_bench: the same layers, batch, micro-batches and
checkpoint modes on the CPU, one JSON line per run with the median step time.

  K = 1: a plain nn.Sequential step on the whole batch (or Pipe with one partition
         and `chunks` micro-batches, --k1-pipe).
  K = 2: Pipe over two nn.Sequential partitions, chunks = M. On the CPU, Pipe gives
         every CPU partition the same worker thread (worker.py normalises cpu:N to
         cpu), and autograd runs all CPU backward work on the calling thread, so the
         two partitions never run at the same time.

Needs Debian's python3-torch (1.13): run with /usr/bin/python3.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time


def _blas_threads_from_argv():
    # torch.set_num_threads sets OpenMP's threads but not OpenBLAS's (Debian's torch
    # calls the system OpenBLAS), so the BLAS limit must be in the environment before
    # torch loads it.
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return "1"


os.environ.setdefault("OPENBLAS_NUM_THREADS", _blas_threads_from_argv())
os.environ.setdefault("OMP_NUM_THREADS", _blas_threads_from_argv())

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--m", type=int, default=8, help="micro-batches (Pipe's chunks)")
    p.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--input", type=int, default=-1, help="input features (default: width)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (intra-op threads)")
    p.add_argument("--balance", default="", help="modules per partition, e.g. 16,17 (default: even)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--k1-pipe", action="store_true", help="K = 1 through Pipe with chunks = M")
    a = p.parse_args()
    if a.input < 0:
        a.input = a.width
    return a


def mlp_modules(a):
    """depth x [Linear(width) + ReLU], then Linear(width -> classes): the C++ bench's model."""
    mods, features = [], a.input
    for _ in range(a.depth):
        mods += [nn.Linear(features, a.width), nn.ReLU()]
        features = a.width
    mods.append(nn.Linear(features, a.classes))
    return mods


def even_balance(n, k):
    return [n // k + (1 if i >= k - n % k else 0) for i in range(k)]  # extra modules go last


def cpu_sample():
    """(machine busy CPU seconds from /proc/stat, this process's CPU seconds, wall time)."""
    busy = 0.0
    try:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
        busy = (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    return busy, t.user + t.system, time.perf_counter()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    mods = mlp_modules(a)
    use_pipe = a.k > 1 or a.k1_pipe
    balance = [int(b) for b in a.balance.split(",")] if a.balance else even_balance(len(mods), a.k)
    if sum(balance) != len(mods) or len(balance) != a.k:
        sys.exit(f"torch_gpipe: --balance {balance} must give {a.k} partitions summing to {len(mods)} modules")

    if use_pipe:
        from torch.distributed import rpc
        from torch.distributed.pipeline.sync import Pipe

        # Pipe insists on an RPC agent even in one process; a single local worker will do.
        rpc.init_rpc("worker", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         init_method=f"tcp://127.0.0.1:{free_port()}"))
        parts, i = [], 0
        for b in balance:
            parts.append(nn.Sequential(*mods[i:i + b]))
            i += b
        model = Pipe(nn.Sequential(*parts), chunks=a.m, checkpoint=a.checkpoint)
        forward = lambda x: model(x).local_value()
    else:
        model = nn.Sequential(*mods)
        forward = model

    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(a.seed * 7919 + 1)
    x = torch.randn(a.batch, a.input, generator=g)
    y = torch.randint(0, a.classes, (a.batch,), generator=g)

    times, loss = [], float("nan")
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            cpu0 = cpu_sample()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        out = forward(x)
        l = F.cross_entropy(out, y)
        l.backward()
        opt.step()
        dt = (time.perf_counter() - t0) * 1000.0
        loss = l.item()
        if s >= a.warmup:
            times.append(dt)

    cpu1 = cpu_sample()
    # Cores' worth of CPU other programs used while the steps were timed (as in pipeline_bench).
    foreign = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / (cpu1[2] - cpu0[2])
    if use_pipe:
        rpc.shutdown()
    print(json.dumps({
        "impl": "torch", "torch": torch.__version__, "k": a.k, "m": a.m if use_pipe else 1,
        "pipe": use_pipe, "checkpoint": a.checkpoint if use_pipe else "n/a", "width": a.width,
        "depth": a.depth, "batch": a.batch, "threads": a.threads, "balance": balance,
        "warmup": a.warmup, "steps": a.steps, "loss": loss,
        "step_ms": statistics.median(times), "step_ms_min": min(times), "step_ms_max": max(times),
        "foreign_cores": foreign,
    }), flush=True)


if __name__ == "__main__":
    main()
