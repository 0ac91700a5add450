#!/usr/bin/env python3
"""Turns a sharded meshddp checkpoint (any DP x TP; docs/checkpoints.md) into one full-model
safetensors file that a single-process PyTorch model loads with load_state_dict.

    .venv/bin/python scripts/consolidate_checkpoint.py CKPT_DIR OUT.safetensors [--step N]
        [--optimizer] [--no-verify] [--torch-save OUT.pt]

CKPT_DIR is a save directory (its `latest` complete step is taken, or step-N with --step) or a
step-<N> directory. Every file's size, save id and CRC32C are checked against the manifest first
(--no-verify skips the CRC: pure-Python CRC32C runs at ~10 MB/s unless the `crc32c` or
`google-crc32c` package is installed). The output holds the model's params and buffers under their
module names ("blocks.0.attn.q.weight"), or with --optimizer every tensor under its checkpoint key
("model/...", "optim/exp_avg/..."). Also usable as a module: consolidate(), load_safetensors(),
save_safetensors() (no dependency beyond torch).
"""
import argparse
import json
import os
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


def crc32c(data):
    try:
        import google_crc32c  # noqa: PLC0415
        return google_crc32c.value(data)
    except ImportError:
        pass
    try:
        import crc32c as fast  # noqa: PLC0415
        return fast.crc32c(data)
    except ImportError:
        pass
    table = _crc32c_table()
    crc = 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def read_header(path):
    """(header dict, data start) of a safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: shorter than 8 bytes, not safetensors")
        (n,) = struct.unpack("<Q", head)
        header = json.loads(f.read(n))
    return header, 8 + n


def load_safetensors(path):
    """name -> tensor, for every tensor of a safetensors file."""
    header, start = read_header(path)
    with open(path, "rb") as f:
        data = f.read()[start:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[info["dtype"]]) if end > begin else \
            torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def save_safetensors(tensors, path, metadata=None):
    """Writes name -> tensor as a safetensors file (8-aligned data, like the safetensors package)."""
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def resolve(directory, step=None):
    """The step directory to read: step-N, `latest`, or the highest complete step; never an incomplete one."""
    if os.path.exists(os.path.join(directory, "manifest.json")):
        return directory
    if step is not None:
        name = f"step-{step}"
    elif os.path.exists(os.path.join(directory, "latest")):
        name = open(os.path.join(directory, "latest")).read().strip()
    else:
        complete = [d for d in os.listdir(directory)
                    if d.startswith("step-") and d[5:].isdigit() and os.path.exists(os.path.join(directory, d, "manifest.json"))]
        if not complete:
            raise SystemExit(f"error: {directory} holds no complete checkpoint")
        name = max(complete, key=lambda d: int(d[5:]))
    path = os.path.join(directory, name)
    if not os.path.exists(os.path.join(path, "manifest.json")):
        raise SystemExit(f"error: {path} is incomplete (no manifest.json: a save that did not finish)")
    return path


def verify(step_dir, manifest, check_crc=True):
    for name, f in sorted(manifest["files"].items()):
        path = os.path.join(step_dir, name)
        who = f"file '{path}' (written by rank {f['rank']})"
        if not os.path.exists(path):
            raise SystemExit(f"error: {who} is missing")
        size = os.path.getsize(path)
        if size != f["bytes"]:
            raise SystemExit(f"error: {who} has {size} bytes but the manifest says {f['bytes']}")
        header, _ = read_header(path)
        save_id = header.get("__metadata__", {}).get("save_id")
        if save_id != manifest["save_id"]:
            raise SystemExit(f"error: {who} is from another save (save id {save_id}, not {manifest['save_id']})")
        if check_crc:
            with open(path, "rb") as fh:
                crc = f"0x{crc32c(fh.read()):08x}"
            if crc != f["crc32c"]:
                raise SystemExit(f"error: {who} has CRC32C {crc} but the manifest says {f['crc32c']}")


def consolidate(directory, step=None, optimizer=False, check_crc=True):
    """key -> full (TP-unsharded) tensor; keys are module names, or checkpoint keys with optimizer=True."""
    step_dir = resolve(directory, step)
    manifest = json.load(open(os.path.join(step_dir, "manifest.json")))
    if manifest.get("format") != "meshddp-checkpoint" or manifest.get("version") != 2:
        raise SystemExit(f"error: {step_dir} is not a meshddp checkpoint of version 2")
    verify(step_dir, manifest, check_crc)
    files = {}
    out = {}
    for key, entry in sorted(manifest["tensors"].items()):
        if not optimizer and not key.startswith("model/"):
            continue
        dtype, shape, dim, tp = DTYPES[entry["dtype"]], entry["shape"], entry["dim"], entry["tp_size"]
        full = torch.empty(shape, dtype=dtype)
        sharded = dim >= 0 and tp > 1
        outer = 1 if not sharded else int(torch.tensor(shape[:dim], dtype=torch.int64).prod())
        inner = 1 if not sharded else int(torch.tensor(shape[dim + 1:], dtype=torch.int64).prod())
        chunk = shape[dim] // tp if sharded else 0
        numel = full.numel()
        for t in range(tp if sharded else 1):
            local = torch.empty(numel // (tp if sharded else 1), dtype=dtype)
            covered = 0
            for piece in entry["pieces"]:
                if piece["tp_rank"] != t:
                    continue
                if piece["file"] not in files:
                    files[piece["file"]] = load_safetensors(os.path.join(step_dir, piece["file"]))
                local[piece["begin"]:piece["end"]] = files[piece["file"]][key].reshape(-1)
                covered += piece["end"] - piece["begin"]
            if covered != local.numel():
                raise SystemExit(f"error: {key}: TP rank {t}'s pieces cover {covered} of {local.numel()} elements")
            if sharded:
                full.view(outer, shape[dim], inner)[:, t * chunk:(t + 1) * chunk, :] = local.view(outer, chunk, inner)
            else:
                full.view(-1)[:] = local
        out[key if optimizer else key[len("model/"):]] = full
    return out, manifest


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("output")
    parser.add_argument("--step", type=int)
    parser.add_argument("--optimizer", action="store_true", help="also the optimizer state, under checkpoint keys")
    parser.add_argument("--no-verify", action="store_true", help="skip the CRC32C check (sizes and save ids are still checked)")
    parser.add_argument("--torch-save", help="also write a torch.save() state dict here")
    args = parser.parse_args()
    tensors, manifest = consolidate(args.checkpoint, args.step, args.optimizer, not args.no_verify)
    metadata = {"format": "meshddp-consolidated", "step": str(manifest["step"]),
                "values": json.dumps(manifest["values"]), "optimizer": json.dumps(manifest["optimizer"])}
    save_safetensors(tensors, args.output, metadata)
    if args.torch_save:
        torch.save(tensors, args.torch_save)
    total = sum(t.numel() for t in tensors.values())
    print(f"{args.output}: {len(tensors)} tensors, {total} elements, step {manifest['step']}", file=sys.stderr)


if __name__ == "__main__":
    main()
