#!/usr/bin/python3
"""A hand-written GPipe in PyTorch with one thread per stage, the comparison issue 21 names: the
same models as gpipe's issue-21 runs, K stages each on its own Python thread (PyTorch's kernels
and autograd release the GIL), M micro-batches, GPipe's order (every forward, then every
backward in reverse), no recompute, activations and gradients handed between the threads by
queues (no copy, as gpipe's in-process transport), one optimizer step per mini-batch. With
--stages 1 it is the plain unpipelined step on the whole batch, where --threads sets PyTorch's
and OpenBLAS's threads.

  torch_thread_gpipe.py --model mlp|gpt [--stages 2] [--micro-batches 8] [--threads 1]
                        [--steps 12] [--warmup 2]

mlp: 16 x (Linear(1024), ReLU), Linear(10), batch 256, SGD (lr 0.01), as /tmp/m21/mlp16.yaml.
gpt: configs/gpt.yaml's model (embedding 256 x 256 with learned positions, 8 pre-LayerNorm
blocks of 4 heads with a GELU MLP of 4C and dropout 0.1, LayerNorm, a 256-way head), batch 32 of
128 tokens, AdamW (lr 0.002, weight decay 0.01) with clipping at 1.0. PyTorch's block is
nn.TransformerEncoderLayer(norm_first=True), whose dropouts sit where gpipe's do plus two more (on
the attention probabilities and after the GELU), a little more work than gpipe's block. Stage 0 takes the first half of the layers, the last stage the rest.
Prints one JSON line: the median step time of the timed steps and the useful FLOPs per second.
Needs Debian's python3-torch (1.13): run with /usr/bin/python3.
"""
import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time


def _threads_from_argv():
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return "1"


# OpenBLAS (Debian's torch calls the system's) reads its thread count when it loads.
os.environ["OPENBLAS_NUM_THREADS"] = _threads_from_argv()
os.environ["OMP_NUM_THREADS"] = _threads_from_argv()
import torch  # noqa: E402


class Embed(torch.nn.Module):
    def __init__(self, vocab, dim, seq):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))

    def forward(self, x):
        return self.tok(x) + self.pos


class CausalBlock(torch.nn.Module):
    def __init__(self, dim, heads, seq, dropout):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=dropout,
                                                      activation="gelu", batch_first=True, norm_first=True)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, x):
        return self.layer(x, src_mask=self.mask)


def build(model):
    torch.manual_seed(0)
    if model == "mlp":
        layers = []
        for _ in range(16):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(1024, 10))
        return layers, 256, (lambda n: torch.randn(n, 1024)), (lambda n: torch.randint(0, 10, (n,)))
    seq = 128
    layers = [Embed(256, 256, seq)] + [CausalBlock(256, 4, seq, 0.1) for _ in range(8)]
    layers += [torch.nn.LayerNorm(256), torch.nn.Linear(256, 256)]
    return layers, 32, (lambda n: torch.randint(0, 256, (n, seq))), (lambda n: torch.randint(0, 256, (n, seq)))


def split(layers, stages):
    """Contiguous, by layer count: stage 0 the first share, the last stage the rest."""
    per = len(layers) // stages
    cuts = [per * k for k in range(stages)] + [len(layers)]
    return [torch.nn.Sequential(*layers[cuts[k]:cuts[k + 1]]) for k in range(stages)]


def loss_of(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "gpt"], required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--flops", type=float, default=0.0, help="useful FLOPs per step, for FLOP/s (gpipe's count)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    layers, batch, make_x, make_y = build(a.model)
    K, M = a.stages, a.micro_batches if a.stages > 1 else 1
    parts = split(layers, K)
    params = [list(part.parameters()) for part in parts]
    if a.model == "mlp":
        opts = [torch.optim.SGD(ps, lr=0.01) for ps in params]
    else:
        opts = [torch.optim.AdamW(ps, lr=0.002, weight_decay=0.01) for ps in params]
    clip = a.model == "gpt"
    x, y = make_x(batch), make_y(batch)
    xs, ys = x.chunk(M), y.chunk(M)
    acts = [queue.SimpleQueue() for _ in range(K)]   # acts[k]: what stage k receives
    grads = [queue.SimpleQueue() for _ in range(K)]  # grads[k]: the gradient of stage k's output
    norms = [queue.SimpleQueue() for _ in range(K)]  # clipping: each stage's squared norm, to every stage

    def stage_step(k):
        ins, outs = [], []
        for m in range(M):
            if k == 0:
                inp = xs[m]
            else:
                inp = acts[k].get().requires_grad_()
            out = parts[k](inp)
            if k == K - 1:
                outs.append(loss_of(out, ys[m]) * (ys[m].numel() / y.numel()))
            else:
                acts[k + 1].put(out.detach())
                outs.append(out)
            ins.append(inp)
        for m in reversed(range(M)):
            if k == K - 1:
                outs[m].backward()
            else:
                outs[m].backward(grads[k].get())
            if k > 0:
                grads[k - 1].put(ins[m].grad)
        if clip:  # the global norm over every stage, as gpipe's NORM
            mine = sum(float(q.grad.pow(2).sum()) for q in params[k] if q.grad is not None)
            for j in range(K):
                norms[j].put(mine)
            total = sum(norms[k].get() for _ in range(K)) ** 0.5
            coef = 1.0 / (total + 1e-6)
            if coef < 1.0:
                for q in params[k]:
                    q.grad.mul_(coef)
        opts[k].step()
        opts[k].zero_grad(set_to_none=False)

    start = [threading.Barrier(K + 1) for _ in range(2)]

    def worker(k):
        torch.set_num_threads(a.threads)
        for _ in range(a.warmup + a.steps):
            start[0].wait()
            stage_step(k)
            start[1].wait()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(K)]
    for t in threads:
        t.start()
    times = []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        start[0].wait()
        start[1].wait()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    for t in threads:
        t.join()
    step = statistics.median(times)
    print(json.dumps({"impl": "pytorch-threads", "torch": torch.__version__, "model": a.model, "stages": K,
                      "micro_batches": M, "threads": a.threads, "batch": batch, "steps": a.steps,
                      "step_ms": round(step, 2), "step_ms_all": [round(t, 1) for t in times],
                      "gflops": round(a.flops / step / 1e6, 2) if a.flops else None}))


if __name__ == "__main__":
    main()
