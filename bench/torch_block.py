"""The same transformer block as bench/block_bench.cc in PyTorch: pre-LayerNorm
(norm_first), causal self-attention, GELU MLP of width 4C, no dropout; forward and
backward timed on CPU (one thread, like a gpipe CPU device) or CUDA.

    torch_block.py [--device cpu|cuda] [--hidden 256] [--heads 4] [--seq 128] [--batch 32]
                   [--blocks 1] [--steps 20] [--warmup 3]
Prints one JSON line.
"""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import torch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--blocks", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[
        torch.nn.TransformerEncoderLayer(a.hidden, a.heads, dim_feedforward=4 * a.hidden, dropout=0.0,
                                         activation="gelu", batch_first=True, norm_first=True)
        for _ in range(a.blocks)]).to(dev)
    mask = torch.triu(torch.full((a.seq, a.seq), float("-inf"), device=dev), diagonal=1)
    x = torch.randn(a.batch, a.seq, a.hidden, device=dev, requires_grad=True)
    dy = torch.randn(a.batch, a.seq, a.hidden, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    fwd, bwd = [], []
    for s in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        h = x
        for blk in blocks:
            h = blk(h, src_mask=mask)
        sync()
        t1 = time.perf_counter()
        h.backward(dy)
        sync()
        t2 = time.perf_counter()
        if s >= a.warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    print(json.dumps({"bench": "torch_block", "device": a.device, "torch": torch.__version__,
                      "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "batch": a.batch,
                      "blocks": a.blocks, "forward_ms": statistics.median(fwd),
                      "backward_ms": statistics.median(bwd),
                      "step_ms": statistics.median(fwd) + statistics.median(bwd)}))


if __name__ == "__main__":
    main()
