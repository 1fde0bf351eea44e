#!/usr/bin/env python3
"""Recomputes a tiny gpipe LLaMA-style model from its checkpoint alone and checks gpipe's
logits and loss, with an implementation of LLaMA written here from the definitions
(Hugging Face's modeling_llama: RMSNorm, rotary embeddings with rotate_half, grouped-query
attention with repeat_kv, SwiGLU), independent of gpipe's code.

    python3 bench/llama_reference.py CHECKPOINT_STEP_DIR EXPECTED_JSON

EXPECTED_JSON is written by //pipeline/checkpoint:llama_reference_fixture. The
safetensors files are read with the standard library (an 8-byte header length, a JSON
header, then the raw little-endian tensors), each weight is found by its checkpoint name
and its shape checked against the model's sizes (as a loader of the files would), and the
model runs in plain Python floats (IEEE double, like gpipe's float64 model), so neither
torch nor numpy is needed (python3 >= 3.6). Exits 1 on any mismatch.
"""
import json
import math
import os
import struct
import sys

def load_safetensors(path):
    """{name: (shape, [values])} of a safetensors file of F64 tensors."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F64":
            raise ValueError(f"{path}: '{name}' is {info['dtype']}; this check reads the float64 model only")
        begin, end = info["data_offsets"]
        count = (end - begin) // 8
        out[name] = (info["shape"], list(struct.unpack(f"<{count}d", data[begin:end])))
    return out


def load_model(step_dir):
    with open(os.path.join(step_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_safetensors(os.path.join(step_dir, file)))
    return tensors


def linear(x, w, out_features):
    """x: a vector (in); w: (out, in) row-major, as torch.nn.Linear's weight."""
    n = len(x)
    return [sum(w[o * n + i] * x[i] for i in range(n)) for o in range(out_features)]


def rms_norm(x, g, eps):
    inv = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [v * inv * gi for v, gi in zip(x, g)]


def rotary(x, heads, head_dim, position, base):
    """HF LLaMA: q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x2, x1)."""
    half = head_dim // 2
    y = list(x)
    for h in range(heads):
        o = h * head_dim
        for i in range(half):
            angle = position * base ** (-2.0 * i / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            x1, x2 = x[o + i], x[o + i + half]
            y[o + i] = x1 * c - x2 * s
            y[o + i + half] = x2 * c + x1 * s
    return y


def attention(xs, p, cfg):
    """Causal grouped-query attention over one sequence xs (T vectors of dim)."""
    dim, heads, kv_heads = cfg["dim"], cfg["heads"], cfg["kv_heads"]
    d = dim // heads
    group = heads // kv_heads  # repeat_kv's n_rep
    q = [rotary(linear(x, p["q"], dim), heads, d, t, cfg["rope_base"]) for t, x in enumerate(xs)]
    k = [rotary(linear(x, p["k"], kv_heads * d), kv_heads, d, t, cfg["rope_base"]) for t, x in enumerate(xs)]
    v = [linear(x, p["v"], kv_heads * d) for x in xs]
    out = []
    for t in range(len(xs)):
        row = []
        for h in range(heads):
            j = h // group
            scores = [sum(q[t][h * d + e] * k[s][j * d + e] for e in range(d)) / math.sqrt(d) for s in range(t + 1)]
            m = max(scores)
            w = [math.exp(sc - m) for sc in scores]
            z = sum(w)
            row += [sum(w[s] / z * v[s][j * d + e] for s in range(t + 1)) for e in range(d)]
        out.append(linear(row, p["o"], dim))
    return out


def swiglu(x, p, cfg):
    a = linear(x, p["gate"], cfg["hidden"])
    b = linear(x, p["up"], cfg["hidden"])
    g = [ai / (1.0 + math.exp(-ai)) * bi for ai, bi in zip(a, b)]
    return linear(g, p["down"], cfg["dim"])


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    step_dir, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        expected = json.load(f)
    cfg = expected["model"]
    tensors = load_model(step_dir)
    names = cfg["names"]
    if sorted(tensors) != sorted(names):
        print(f"llama_reference: the checkpoint holds {sorted(tensors)}, gpipe's model {sorted(names)}", file=sys.stderr)
        return 1
    dim, vocab, seq, eps = cfg["dim"], cfg["vocab"], cfg["seq_len"], cfg["eps"]
    kv_dim, hidden = cfg["kv_heads"] * (dim // cfg["heads"]), cfg["hidden"]

    # Each weight by its checkpoint name (layer i of the model: layers.<i>.<parameter>),
    # in PyTorch's (out, in) layout, its shape checked.
    def weight(name, shape):
        if name not in tensors:
            raise KeyError(f"no tensor '{name}' in the checkpoint")
        got, values = tensors[name]
        if list(got) != list(shape):
            raise ValueError(f"'{name}' has shape {got}, a LLaMA of these sizes needs {shape}")
        return values

    try:
        table = weight("layers.0.token", [vocab, dim])
        blocks = []
        for b in range(cfg["blocks"]):
            pre = f"layers.{b + 1}."
            blocks.append({
                "norm1": weight(pre + "norm1.weight", [dim]),
                "q": weight(pre + "attn.q.weight", [dim, dim]),
                "k": weight(pre + "attn.k.weight", [kv_dim, dim]),
                "v": weight(pre + "attn.v.weight", [kv_dim, dim]),
                "o": weight(pre + "attn.o.weight", [dim, dim]),
                "norm2": weight(pre + "norm2.weight", [dim]),
                "gate": weight(pre + "ffn.gate.weight", [hidden, dim]),
                "up": weight(pre + "ffn.up.weight", [hidden, dim]),
                "down": weight(pre + "ffn.down.weight", [dim, hidden]),
            })
        final_norm = weight(f"layers.{cfg['blocks'] + 1}.weight", [dim])
        head = weight(f"layers.{cfg['blocks'] + 2}.weight", [vocab, dim])
    except (KeyError, ValueError) as e:
        print(f"llama_reference: {e}", file=sys.stderr)
        return 1

    ids, targets = expected["ids"], expected["targets"]
    logits, loss = [], 0.0
    for s in range(len(ids) // seq):
        xs = [table[i * dim:(i + 1) * dim] for i in ids[s * seq:(s + 1) * seq]]
        for p in blocks:
            a = attention([rms_norm(x, p["norm1"], eps) for x in xs], p, cfg)
            hs = [[xi + ai for xi, ai in zip(x, y)] for x, y in zip(xs, a)]
            xs = [[hi + fi for hi, fi in zip(h, swiglu(rms_norm(h, p["norm2"], eps), p, cfg))] for h in hs]
        for t, x in enumerate(xs):
            row = linear(rms_norm(x, final_norm, eps), head, vocab)
            logits += row
            m = max(row)
            loss += m + math.log(sum(math.exp(r - m) for r in row)) - row[targets[s * seq + t]]
    loss /= len(ids)

    errors = []
    want = expected["logits"]
    worst = max(abs(a - b) for a, b in zip(logits, want)) if len(logits) == len(want) else float("inf")
    if not worst <= 1e-10:
        errors.append(f"logits differ from gpipe's by up to {worst} (allowed 1e-10)")
    if not abs(loss - expected["loss"]) <= 1e-12 * max(1.0, abs(loss)):
        errors.append(f"loss {loss!r}, gpipe computed {expected['loss']!r}")
    for e in errors:
        print(f"llama_reference: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"llama_reference: ok: {len(logits) // vocab} positions' logits within {worst:.3g} of gpipe's, "
          f"loss {loss:.12f} (gpipe {expected['loss']:.12f}), from {step_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
