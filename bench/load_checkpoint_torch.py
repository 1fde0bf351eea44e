#!/usr/bin/env python3
"""Loads a gpipe checkpoint with the `safetensors` package, as a PyTorch user would, and
checks it against what gpipe saved.

    python3 bench/load_checkpoint_torch.py CHECKPOINT_STEP_DIR [EXPECTED_JSON]

Reads model.safetensors.index.json and optimizer.safetensors.index.json, loads every shard
with safetensors.torch.load_file (or safetensors.numpy.load_file where PyTorch is not
installed), and checks that the names, dtypes and shapes match the index and, with
EXPECTED_JSON (written by //pipeline/checkpoint:checkpoint_torch_fixture), the names, dtypes, shapes,
first values and sums gpipe wrote. Without the safetensors package it prints a
GPIPE_TEST_SKIPPED line and exits 0. Exits 1 on any mismatch.
"""
import json
import os
import sys


def skip(why):
    print(f"GPIPE_TEST_SKIPPED: {why}")
    sys.exit(0)


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    step_dir = sys.argv[1]
    expected = None
    if len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            expected = json.load(f)

    # What to install, where: `./gpipe test` installs safetensors and numpy for its tests
    # (Debian's python3-numpy, safetensors from PyPI into ~/.cache/gpipe/python).
    how = "./gpipe test installs them, or: pip install safetensors numpy"
    try:
        import safetensors  # noqa: F401
    except ImportError:
        skip(f"the Python package 'safetensors' is not installed for {sys.executable} ({how})")
    try:
        import torch
        from safetensors.torch import load_file

        flavour = f"torch {torch.__version__}"
        dtypes = {"F32": torch.float32, "F64": torch.float64, "I32": torch.int32}

        def nbytes(t):
            return t.numel() * t.element_size()
    except ImportError:
        try:
            import numpy as np
            from safetensors.numpy import load_file
        except ImportError:
            skip(f"neither torch nor numpy is installed for {sys.executable}, for safetensors to load into ({how})")
        flavour = f"numpy {np.__version__} (torch not installed)"
        dtypes = {"F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "I32": np.dtype(np.int32)}

        def nbytes(t):
            return t.nbytes

    def values(t):
        return [float(x) for x in t.flatten().tolist()]

    errors = []
    loaded_count = 0
    for kind in ("model", "optimizer"):
        with open(os.path.join(step_dir, f"{kind}.safetensors.index.json")) as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        tensors = {}
        total = 0
        for file in sorted(set(weight_map.values())):
            shard = load_file(os.path.join(step_dir, file))
            for name, t in shard.items():
                if weight_map.get(name) != file:
                    errors.append(f"{file}: '{name}' is not mapped to this file by the index")
                tensors[name] = t
                total += nbytes(t)
        if set(tensors) != set(weight_map):
            errors.append(f"{kind}: the shards hold {sorted(tensors)} but the index lists {sorted(weight_map)}")
        if total != index["metadata"]["total_size"]:
            errors.append(f"{kind}: total_size {index['metadata']['total_size']} but the tensors hold {total} bytes")
        loaded_count += len(tensors)
        if expected is None:
            continue
        want = expected[kind]
        if set(want) != set(tensors):
            errors.append(f"{kind}: names {sorted(tensors)} differ from gpipe's {sorted(want)}")
        for name, w in want.items():
            t = tensors.get(name)
            if t is None:
                continue
            if t.dtype != dtypes[w["dtype"]]:
                errors.append(f"{kind} '{name}': dtype {t.dtype}, gpipe wrote {w['dtype']}")
            if list(t.shape) != w["shape"]:
                errors.append(f"{kind} '{name}': shape {list(t.shape)}, gpipe wrote {w['shape']}")
            v = values(t)
            if v[: len(w["first"])] != w["first"]:
                errors.append(f"{kind} '{name}': first values {v[:len(w['first'])]}, gpipe wrote {w['first']}")
            s = sum(v)
            if abs(s - w["sum"]) > 1e-9 * max(1.0, abs(w["sum"])):
                errors.append(f"{kind} '{name}': sum {s}, gpipe wrote {w['sum']}")

    for e in errors:
        print(f"load_checkpoint_torch: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"load_checkpoint_torch: ok: {loaded_count} tensors of {step_dir} loaded with safetensors ({flavour})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
