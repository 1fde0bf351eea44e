#!/usr/bin/env python3
"""The speed check's PyTorch side: the LLaMA-style byte-level model of a gpipe config
(bench/configs/llama_*_speed.yaml) written in plain PyTorch, trained for a few steps and
timed, as a PyTorch user would run it: eager, autocast bf16 (float32 weights, as gpipe's
bf16) or float32 with TF32 off (as gpipe's cuBLAS float32 products),
F.scaled_dot_product_attention (causal, grouped-query), fused AdamW, clip_grad_norm 1.0.

    torch_llama.py --config bench/configs/llama_95m_speed.yaml [--device cuda|cpu]
                   [--precision bf16|float32] [--steps 12] [--timed 8]
    torch_llama.py --device cpu --dim 64 --layers 2 --heads 4 --kv-heads 2 --hidden 176 \
                   --seq 32 --batch 2 --steps 3 --timed 2      (a smoke run, no config)

The model, from the config (anything else in it is refused, so that the two sides train
the same model): an embedding (vocab, dim, no positions), `repeat` x llama_block (RMSNorm,
q/k/v/o without bias, rotary embeddings with Hugging Face's rotate_half, grouped-query
attention, RMSNorm, SwiGLU down(silu(gate(x)) * up(x))), RMSNorm, a linear head without
bias, softmax cross-entropy. The optimizer's lr, betas, eps, weight decay and clipping are
the config's too. Flags given override the config's sizes. The tokens are random bytes,
drawn on the host each step and copied to the device (gpipe reads the GPL-3 text): the
speed does not depend on their values.

Prints one JSON line: the median step time of the last --timed steps (each step from the
batch's copy to the optimizer's step, the device waited for), all the step times, the
peak memory PyTorch's allocator handed out (and reserved) on a CUDA device, the model's
parameters and its FLOPs per step by model_flops() below.

PyTorch itself is not carried to a lent GPU machine: its wheels are far over a call's
64 MiB (torch 2.11.0's alone is 530 MB, 2.7 GB with its nvidia-* wheels), so the check
uses the machine's own python3 and torch (bench/RESULTS.md, "How to run the speed check").
This file imports torch only to run: the check's table imports it for model_flops() on a
machine without torch too.
"""
import argparse
import json
import math
import statistics
import sys
import time


# ---- the model's shapes, from a gpipe config or flags (no torch needed)

def shape_from_config(path):
    """The model and optimizer of a gpipe LLaMA config, checked to be what this file builds."""
    import yaml  # PyYAML: on the GPU machine's image; here only with --config
    with open(path) as f:
        c = yaml.safe_load(f)
    model = c["model"]
    layers = model["layers"]

    def refuse(what):
        raise SystemExit(f"torch_llama.py: {path}: {what}; this file builds embedding, repeat x llama_block, "
                         f"rmsnorm, linear (bias: false), softmax_cross_entropy")

    if len(layers) != 4 or layers[0].get("type") != "embedding" or "repeat" not in layers[1] or \
            layers[2].get("type") != "rmsnorm" or layers[3].get("type") != "linear":
        refuse("another layer list")
    emb, rep, norm, head = layers
    blocks = rep["layers"]
    if len(blocks) != 1 or blocks[0].get("type") != "llama_block":
        refuse("a repeat of other than one llama_block")
    blk = blocks[0]
    unknown = set(blk) - {"type", "heads", "kv_heads", "hidden", "rope_base", "eps", "dropout"}
    if unknown or blk.get("dropout", 0) != 0:
        refuse(f"llama_block options {sorted(unknown)} or dropout")
    if emb.get("positions", 0) != 0 or head.get("bias", True) or head.get("tied", False) or \
            head["out"] != emb["vocab"] or model["loss"]["type"] != "softmax_cross_entropy":
        refuse("learned positions, a head with bias, tied or not of the vocabulary's size, or another loss")
    if blk.get("eps", 1e-6) != norm.get("eps", 1e-6):
        refuse("the final rmsnorm's eps differs from the blocks'")
    opt = c["optimizer"]
    if opt["type"] != "adamw":
        refuse(f"optimizer {opt['type']}")
    return {
        "vocab": emb["vocab"], "dim": emb["dim"], "layers": rep["repeat"], "heads": blk["heads"],
        "kv_heads": blk.get("kv_heads", blk["heads"]), "hidden": blk["hidden"],
        "rope_base": float(blk.get("rope_base", 10000.0)), "eps": float(blk.get("eps", 1e-6)),
        "seq": model["input"][0], "batch": c["train"]["batch_size"],
        "precision": {"float32": "float32", "bf16": "bf16"}.get(model.get("dtype", "float32"), model.get("dtype")),
        "lr": float(opt["lr"]), "beta1": float(opt.get("beta1", 0.9)), "beta2": float(opt.get("beta2", 0.999)),
        "adam_eps": float(opt.get("eps", 1e-8)), "weight_decay": float(opt.get("weight_decay", 0.0)),
        "clip": float(opt.get("clip_grad_norm", 0.0)),
    }


# The 95M config's values: the defaults of a run without --config.
DEFAULTS = {"vocab": 256, "dim": 1024, "layers": 8, "heads": 16, "kv_heads": 8, "hidden": 2816,
            "rope_base": 10000.0, "eps": 1e-6, "seq": 1024, "batch": 16, "precision": "bf16",
            "lr": 3e-4, "beta1": 0.9, "beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.1, "clip": 1.0}


def parameter_counts(s):
    """(all parameters, those of matrix products: every block's q, k, v, o, gate, up,
    down and the head; the embedding table and the norms' scales do no product)."""
    d, kv = s["dim"], s["kv_heads"] * (s["dim"] // s["heads"])
    block_matmul = d * d * 2 + d * kv * 2 + 3 * d * s["hidden"]
    matmul = s["layers"] * block_matmul + d * s["vocab"]
    return matmul + s["vocab"] * d + (2 * s["layers"] + 1) * d, matmul


def model_flops(s):
    """Model FLOPs of one training step (forward and backward), the PaLM paper's count
    (appendix B): tokens x (6 N + 12 L T d), N the parameters of matrix products, L the
    blocks, T the sequence, d the model width; attention's two products counted whole,
    not halved for causality, and no recomputation."""
    tokens = s["batch"] * s["seq"]
    return tokens * (6 * parameter_counts(s)[1] + 12 * s["layers"] * s["seq"] * s["dim"])


# ---- the model in PyTorch

def build(s, device):
    import torch
    import torch.nn.functional as F
    from torch import nn

    head_dim = s["dim"] // s["heads"]
    group = s["heads"] // s["kv_heads"]
    gqa_fused = group > 1 and sdpa_fuses_gqa(device, torch.bfloat16 if s["precision"] == "bf16" else torch.float32,
                                             s["heads"], s["kv_heads"], head_dim)

    def rms_norm(x, weight):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), weight, s["eps"])
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + s["eps"]).to(x.dtype) * weight

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d, kv = s["dim"], s["kv_heads"] * head_dim
            self.norm1 = nn.Parameter(torch.ones(d))
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, kv, bias=False)
            self.v = nn.Linear(d, kv, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.norm2 = nn.Parameter(torch.ones(d))
            self.gate = nn.Linear(d, s["hidden"], bias=False)
            self.up = nn.Linear(d, s["hidden"], bias=False)
            self.down = nn.Linear(s["hidden"], d, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = rms_norm(x, self.norm1)
            q = self.q(h).view(B, T, s["heads"], head_dim).transpose(1, 2)
            k = self.k(h).view(B, T, s["kv_heads"], head_dim).transpose(1, 2)
            v = self.v(h).view(B, T, s["kv_heads"], head_dim).transpose(1, 2)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if group > 1 and not gqa_fused:  # Hugging Face's repeat_kv
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, **({"enable_gqa": True} if gqa_fused else {}))
            x = x + self.o(a.transpose(1, 2).reshape(B, T, s["dim"]))
            h = rms_norm(x, self.norm2)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.token = nn.Embedding(s["vocab"], s["dim"])
            self.blocks = nn.ModuleList(Block() for _ in range(s["layers"]))
            self.norm = nn.Parameter(torch.ones(s["dim"]))
            self.head = nn.Linear(s["dim"], s["vocab"], bias=False)
            inv = s["rope_base"] ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            angles = torch.outer(torch.arange(s["seq"], dtype=torch.float32), inv)
            angles = torch.cat((angles, angles), dim=-1)  # (T, head_dim), rotate_half's layout
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, ids):
            x = self.token(ids)
            for b in self.blocks:
                x = b(x, self.cos, self.sin)
            return self.head(rms_norm(x, self.norm))

    model = Llama().to(device)
    model.attention = "enable_gqa" if gqa_fused else "keys and values repeated per group" if group > 1 else "none"
    return model


def sdpa_fuses_gqa(device, dtype, heads, kv_heads, head_dim):
    """Whether F.scaled_dot_product_attention runs grouped-query attention (enable_gqa,
    PyTorch 2.5 on) in one of its fused kernels (flash, memory-efficient, cuDNN) at this
    dtype and head size, forward and backward. Where it would fall back to the unfused
    math kernel (on some versions float32 GQA does), the keys and values are repeated per
    group instead, as Hugging Face's repeat_kv does, so that a fused kernel runs."""
    import torch
    import torch.nn.functional as F
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return False
    fused = [getattr(SDPBackend, n) for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
             if hasattr(SDPBackend, n)]
    q = torch.randn(1, heads, 64, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, 64, head_dim, device=device, dtype=dtype, requires_grad=True)
    try:
        with sdpa_kernel(fused):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).sum().backward()
        return True
    except (RuntimeError, TypeError):
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a gpipe LLaMA config (bench/configs/llama_*_speed.yaml); needs PyYAML")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--precision", choices=["bf16", "float32"], help="default: the config's model.dtype")
    for name in ("dim", "layers", "heads", "kv-heads", "hidden", "seq", "batch", "vocab"):
        p.add_argument("--" + name, type=int, help="overrides the config's (or the 95M model's)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timed", type=int, default=8, help="the median of the last N steps (default 8)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: PyTorch's)")
    a = p.parse_args()
    s = shape_from_config(a.config) if a.config else dict(DEFAULTS)
    for name in ("dim", "layers", "heads", "kv_heads", "hidden", "seq", "batch", "vocab"):
        if getattr(a, name) is not None:
            s[name] = getattr(a, name)
    if a.precision:
        s["precision"] = a.precision
    if s["precision"] not in ("bf16", "float32"):
        raise SystemExit(f"torch_llama.py: precision {s['precision']}: bf16 or float32 only")
    if s["dim"] % s["heads"] or s["heads"] % s["kv_heads"] or (s["dim"] // s["heads"]) % 2:
        raise SystemExit("torch_llama.py: dim must split into heads of an even size, heads into kv_heads")
    if not 1 <= a.timed <= a.steps:
        raise SystemExit("torch_llama.py: --timed must be between 1 and --steps")

    import torch
    import torch.nn.functional as F
    device = torch.device(a.device)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    # float32 is float32: no TF32 rounding of the products, as gpipe's cuBLAS handle.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    model = build(s, device)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["adam_eps"],
                            weight_decay=s["weight_decay"], fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=s["precision"] == "bf16")
    gen = torch.Generator().manual_seed(1)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        batch = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen).to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, s["vocab"]), y.reshape(-1))
        loss.backward()
        if s["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())  # after the clock: the step itself does not wait for the host
    if not all(math.isfinite(v) for v in losses):
        raise SystemExit(f"torch_llama.py: a loss is not finite: {losses}")
    total, matmul = parameter_counts(s)
    out = {"bench": "torch_llama", "torch": torch.__version__, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "precision": s["precision"], "config": a.config, "shape": s, "parameters": total,
           "matmul_parameters": matmul, "model_flops": model_flops(s), "steps": a.steps, "timed": a.timed,
           "step_ms": statistics.median(times[-a.timed:]), "step_ms_all": [round(t, 3) for t in times],
           "loss_first": losses[0], "loss_last": losses[-1], "attention": model.attention,
           "optimizer": "AdamW(fused=True)"}
    if device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
