#!/usr/bin/env python3
"""Turns a sharded meshddp checkpoint (any DP x TP; docs/reference/checkpoints.md) into one full-model
safetensors file that a single-process PyTorch model loads with load_state_dict.

    meshddp-consolidate CKPT_DIR OUT.safetensors [--step N] [--optimizer] [--no-verify] [--torch-save OUT.pt]
    .venv/bin/python scripts/consolidate_checkpoint.py ...     (the same, without installing meshddp)

CKPT_DIR is a save directory (its `latest` complete step is taken, or step-N with --step) or a
step-<N> directory. Everything is checked first, as the C++ loader does (docs/reference/checkpoints.md, "What
is checked"): the manifest's checksum and every field, each file's size, header, save id and CRC32C,
and each piece's checksum (--no-verify skips the CRCs). CRC32C comes from the `crc32c` package (a
dependency of meshddp, installed by scripts/setup.sh: GB/s), else from a pure-Python fallback
(~10 MB/s; `pip install crc32c` makes it fast). A checkpoint that fails a check gives `error: <file>:
<what is wrong>` and exit 1, and no output is written; outputs are written under a temporary name
and renamed when complete. The output holds the model's params and buffers under their
module names ("blocks.0.attn.q.weight"), or with --optimizer every tensor under its checkpoint key
("model/...", "optim/exp_avg/..."). Also usable as a module: consolidate(), load_safetensors(),
save_safetensors() (no dependency beyond torch).
"""
import argparse
import json
import math
import os
import re
import stat
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


MAX_HEADER_BYTES = 100 << 20      # as the C++ reader
MAX_MANIFEST_BYTES = 1 << 30     # as kMaxManifestBytes
MAX_LATEST_BYTES = 4096           # as kMaxLatestBytes
MAX_ELEMENTS = 1 << 60
MAX_JSON_DEPTH = 64               # as kMaxJsonDepth
VERSION = 3
CHECKSUM_KEY = b'"manifest_crc32c"'


class CheckpointError(Exception):
    """A checkpoint that cannot be consolidated; the message names the file and what is wrong."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(path, max_bytes=None, what="file"):
    """(binary file object, size) of `path`, opened without blocking (a FIFO in its place would block
    open() forever) and refused unless it is a regular file of at most `max_bytes` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
            raise CheckpointError(f"'{path}' is {kind}, not a regular file: a checkpoint's files are plain files")
        if max_bytes is not None and st.st_size > max_bytes:
            raise CheckpointError(f"{what} '{path}' has {st.st_size} bytes; more than the {max_bytes} it may have: "
                                  f"not a {what}")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), st.st_size


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = []


try:
    import crc32c as _crc32c_package  # PyPI `crc32c`: hardware CRC32C (SSE 4.2 / ARMv8), GB/s
except ImportError:
    _crc32c_package = None


def crc32c(data, crc=0):
    """CRC32C of `data`, continuing from `crc` (as the C++ crc32c(data, n, crc))."""
    if _crc32c_package is not None:
        return _crc32c_package.crc32c(bytes(data), value=crc)
    if not _TABLE:
        _TABLE.extend(_crc32c_table())
    table = _TABLE
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def piece_checksum(data_crc, save_id, key, tensor, piece):
    """Note [Manifest and piece checksums] in checkpoint/manifest.h: covers the tensor's
    dtype, shape, dim and tp_size and the piece's tp_rank, begin and end."""
    shape = ",".join(str(d) for d in tensor["shape"])
    label = "\0".join([save_id, key, tensor["dtype"], shape, str(tensor["dim"]), str(tensor["tp_size"]),
                       str(piece["tp_rank"]), str(piece["begin"]), str(piece["end"])]).encode()
    return crc32c(label, data_crc)


def manifest_checksum(text):
    """(stored, computed) manifest_crc32c of a manifest's bytes, or None when it has none."""
    count = text.count(CHECKSUM_KEY)
    if count == 0:
        return None
    if count > 1:
        raise CheckpointError("manifest_crc32c appears more than once")
    m = re.search(rb'"manifest_crc32c"[ \t\r\n]*:[ \t\r\n]*"0x([0-9a-fA-F]{8})"', text)
    if not m:
        raise CheckpointError("manifest_crc32c is not a string of 0x and 8 hex digits")
    zeroed = text[:m.start(1)] + b"00000000" + text[m.end(1):]
    return int(m.group(1), 16), crc32c(zeroed)


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise CheckpointError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _int64(text):
    v = int(text)
    if not -(1 << 63) <= v < (1 << 63):
        raise CheckpointError(f"integer {text} out of range (not an int64)")
    return v


def _finite(text):
    v = float(text)
    if not math.isfinite(v):
        raise CheckpointError(f"number {text} out of range (not a finite double)")
    return v


def _no_constant(name):
    raise CheckpointError(f"{name} is not JSON")


def _check_strings_and_depth(value):
    """Note [Strict JSON] in checkpoint/json.h: no lone surrogate in a string (Python's json reads
    "\\ud800" as one), nesting at most MAX_JSON_DEPTH."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else None
        if items is not None:
            if depth + 1 > MAX_JSON_DEPTH:
                raise CheckpointError(f"nesting deeper than {MAX_JSON_DEPTH} levels")
            for k, child in items:
                todo.append((k, depth + 1))
                todo.append((child, depth + 1))
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise CheckpointError(f"a lone surrogate in the string {v!r}") from None


def _parse_json(data, what):
    """The same JSON the C++ reader takes (Note [Strict JSON] in checkpoint/json.h): no duplicate
    keys, integers within int64, finite numbers only (no NaN, Infinity, 1e999), no lone surrogates,
    nesting at most 64 deep; Python's json already refuses the rest (bad escapes, raw control
    characters, leading zeros, a byte-order mark, trailing bytes)."""
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_int=_int64,
                           parse_float=_finite, parse_constant=_no_constant)
        _check_strings_and_depth(value)
        return value
    except CheckpointError as e:
        raise CheckpointError(f"{what} is not valid: {e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not UTF-8 text ({e})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{what} is not valid JSON ({e})") from None


def _is_int(v):
    return type(v) is int  # noqa: E721 (bool is not an integer here)


def _int(v, field, lo, hi, fail):
    if not _is_int(v) or not lo <= v <= hi:
        fail(f"{field} is {json.dumps(v)}; expected an integer in [{lo}, {hi}]")
    return v


def read_header(path, size=None):
    """(header dict, data start) of a safetensors file, checked: bounded length, UTF-8 JSON, each
    tensor's dtype, shape and data_offsets (inside the file, not overlapping)."""
    f, actual = open_regular(path)
    size = actual if size is None else size
    with f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"'{path}' is shorter than 8 bytes: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"'{path}' declares a {n}-byte header but has {size} bytes: truncated or not safetensors")
        header = _parse_json(f.read(n), f"the header of '{path}'")
    if not isinstance(header, dict):
        raise CheckpointError(f"the header of '{path}' is not a JSON object")
    start, ranges = 8 + n, []

    def fail(what):
        raise CheckpointError(f"'{path}': {what}")
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                fail("__metadata__ is not an object of strings")
            continue
        if not isinstance(info, dict) or info.get("dtype") not in DTYPES or not isinstance(info.get("shape"), list) \
                or not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2:
            fail(f"tensor {name!r} has no valid dtype, shape and data_offsets")
        numel = 1
        for d in info["shape"]:
            numel *= _int(d, f"tensor {name!r} shape", 0, MAX_ELEMENTS, fail)
        begin, end = (_int(x, f"tensor {name!r} data_offsets", 0, size - start, fail) for x in info["data_offsets"])
        if end - begin != numel * DTYPES[info["dtype"]].itemsize:
            fail(f"tensor {name!r} has data_offsets [{begin}, {end}) but {info['dtype']} of shape {info['shape']} "
                 f"needs {numel * DTYPES[info['dtype']].itemsize} bytes")
        ranges.append((begin, end))
    ranges.sort()
    if any(ranges[i][0] < ranges[i - 1][1] for i in range(1, len(ranges))):
        fail("has overlapping tensors")
    return header, start


def load_safetensors(path):
    """name -> tensor, for every tensor of a safetensors file."""
    header, start = read_header(path)
    out = {}
    f, _ = open_regular(path)
    with f:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            f.seek(start + begin)
            data = f.read(end - begin)  # read_header checked the range lies inside the file
            t = torch.frombuffer(bytearray(data), dtype=DTYPES[info["dtype"]]) if end > begin else \
                torch.empty(0, dtype=DTYPES[info["dtype"]])
            out[name] = t.reshape(info["shape"])
    return out


def save_safetensors(tensors, path, metadata=None):
    """Writes name -> tensor as a safetensors file (8-aligned data, like the safetensors package),
    via a temporary file renamed at the end: `path` is either complete or untouched."""
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        if name == "__metadata__":
            raise CheckpointError("a tensor named '__metadata__' cannot be stored: safetensors reserves the name for "
                                  "its metadata")
        t = tensors[name].detach().contiguous().cpu()
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)
    _write_atomically(path, write)


def _write_atomically(path, write):
    """`path` via `path.tmp`: a leftover temp file (or a symlink planted there) is unlinked first and
    the new one created exclusively, never followed."""
    tmp = path + ".tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def resolve(directory, step=None):
    """The step directory to read: step-N, `latest`, or the highest complete step; never an incomplete one."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"'{directory}' is not a directory")
    if os.path.lexists(os.path.join(directory, "manifest.json")):
        if step is not None:
            raise CheckpointError(f"'{directory}' is a step directory; --step {step} picks a step of a save directory: "
                                  f"pass the save directory with --step, or the step directory alone")
        return directory
    if step is not None:
        name = f"step-{step}"
    elif os.path.lexists(os.path.join(directory, "latest")):
        path = os.path.join(directory, "latest")
        f, _ = open_regular(path, MAX_LATEST_BYTES, "`latest` pointer")
        with f:
            text = f.read()
        text = text[:-1] if text.endswith(b"\n") else text
        if not re.fullmatch(rb"step-(0|[1-9][0-9]{0,18})", text):
            raise CheckpointError(f"'{path}' holds {text!r}, which is not a step directory name (a save writes "
                                  f"exactly \"step-<N>\" and a newline): the file is damaged; pass --step N")
        name = text.decode()
    else:
        complete = [d for d in os.listdir(directory)
                    if re.fullmatch(r"step-[0-9]+", d) and os.path.exists(os.path.join(directory, d, "manifest.json"))]
        if not complete and os.path.lexists(os.path.join(directory, ".metadata")):
            raise CheckpointError(f"'{directory}' is a torch.distributed.checkpoint (DCP) directory (it has .metadata), "
                                  f"not meshddp's format; this command reads meshddp's (save_checkpoint). Read a DCP "
                                  f"checkpoint with torch: torch.distributed.checkpoint.format_utils.dcp_to_torch_save("
                                  f"'{directory}', 'full.pt') (the optimizer's state as flattened params)")
        if not complete:
            raise CheckpointError(f"'{directory}' holds no complete checkpoint")
        name = max(complete, key=lambda d: int(d[5:]))
    path = os.path.join(directory, name)
    if not os.path.exists(os.path.join(path, "manifest.json")):
        raise CheckpointError(f"'{path}' is incomplete or missing (no manifest.json)")
    return path


def load_manifest(step_dir):
    """The manifest of `step_dir`, with every field checked as checkpoint/manifest.cpp does."""
    path = os.path.join(step_dir, "manifest.json")

    def fail(what):
        raise CheckpointError(f"manifest '{path}': {what} (the manifest is damaged or was edited)")
    f, _ = open_regular(path, MAX_MANIFEST_BYTES, "manifest")
    with f:
        text = f.read()
    try:
        checksum = manifest_checksum(text)
    except CheckpointError as e:
        fail(str(e))
    if checksum is not None and checksum[0] != checksum[1]:
        fail(f"manifest_crc32c is 0x{checksum[0]:08x} but the manifest's content has CRC32C 0x{checksum[1]:08x}")
    try:
        m = _parse_json(text, f"manifest '{path}'")
    except CheckpointError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(m, dict):
        fail("is not a JSON object")
    if m.get("format") != "meshddp-checkpoint" or m.get("version") != VERSION:
        raise CheckpointError(f"'{path}' is format {m.get('format')!r} version {m.get('version')!r}; this script reads "
                              f"'meshddp-checkpoint' version {VERSION}")
    if checksum is None:
        fail("has no manifest_crc32c")

    def get(obj, field, key, kind):
        if not isinstance(obj, dict) or key not in obj:
            fail(f"{field} has no member '{key}'")
        v = obj[key]
        if kind is not None and not isinstance(v, kind):
            fail(f"{field}.{key} is {json.dumps(v)}; expected {kind.__name__}")
        return v
    if not re.fullmatch(r"[0-9a-fA-F]{16}", str(get(m, "the manifest", "save_id", str))):
        fail("save_id is not 16 hex digits")
    step = _int(get(m, "the manifest", "step", None), "step", 0, 2**63 - 1, fail)
    dir_name = os.path.basename(os.path.normpath(step_dir))
    if re.fullmatch(r"step-[0-9]+", dir_name) and dir_name != f"step-{step}":
        fail(f"holds step {step} but its directory is named '{dir_name}' (a step directory renamed or copied under "
             f"another name?)")
    mesh = get(m, "the manifest", "mesh", dict)
    world = _int(get(mesh, "mesh", "world_size", None), "mesh.world_size", 1, 1 << 24, fail)
    dp = _int(get(mesh, "mesh", "dp_size", None), "mesh.dp_size", 1, world, fail)
    tp = _int(get(mesh, "mesh", "tp_size", None), "mesh.tp_size", 1, world, fail)
    pp = _int(mesh["pp_size"], "mesh.pp_size", 1, world, fail) if "pp_size" in mesh else 1  # pipeline stages
    if dp * tp * pp != world:
        fail(f"mesh has dp_size {dp} x tp_size {tp}{f' x pp_size {pp}' if pp > 1 else ''} != world_size {world}")
    for k, v in get(m, "the manifest", "values", dict).items():
        if not isinstance(v, (int, float, str)) or isinstance(v, bool):
            fail(f"values[{k!r}] is {json.dumps(v)}; expected an integer, a number or a string")
    opt = get(m, "the manifest", "optimizer", None)
    if opt is not None:
        kind = get(opt, "optimizer", "kind", str)
        if kind not in ("adamw", "sgd", "muon"):
            fail(f"optimizer.kind is {kind!r}; expected 'adamw', 'sgd' or 'muon' (as checkpoint/manifest.cpp)")
        _int(get(opt, "optimizer", "step", None), "optimizer.step", 0, 2**63 - 1, fail)
    files = get(m, "the manifest", "files", dict)
    for name, f in files.items():
        field = f"files[{name!r}]"
        rank = _int(get(f, field, "rank", None), field + ".rank", 0, world - 1, fail)
        if name != f"rank{rank:05d}.safetensors":
            fail(f"{field} is rank {rank}'s file, whose name is rank{rank:05d}.safetensors")
        _int(get(f, field, "dp_rank", None), field + ".dp_rank", 0, dp - 1, fail)
        _int(get(f, field, "tp_rank", None), field + ".tp_rank", 0, tp - 1, fail)
        _int(get(f, field, "bytes", None), field + ".bytes", 8, MAX_ELEMENTS, fail)
        if not re.fullmatch(r"0x[0-9a-f]{8}", str(get(f, field, "crc32c", str))):
            fail(f"{field}.crc32c is not 0x and 8 lowercase hex digits")
    if len(files) != world:
        fail(f"files lists {len(files)} files; a checkpoint of world_size {world} has one per rank")
    for key, t in get(m, "the manifest", "tensors", dict).items():
        field = f"tensors[{key!r}]"
        if key == "__metadata__":
            fail(f"{field}: '__metadata__' is not a tensor name (safetensors reserves it for metadata)")
        if get(t, field, "dtype", str) not in DTYPES:
            fail(f"{field}.dtype is {t['dtype']!r}, not a dtype this script reads")
        shape = get(t, field, "shape", list)
        numel = 1
        for d in shape:
            numel *= _int(d, field + ".shape", 0, MAX_ELEMENTS, fail)
        if numel * DTYPES[t["dtype"]].itemsize > MAX_ELEMENTS:
            fail(f"{field}.shape has more than 2^60 bytes")
        dim = _int(get(t, field, "dim", None), field + ".dim", -1, len(shape) - 1, fail)
        tps = _int(get(t, field, "tp_size", None), field + ".tp_size", 1, tp, fail)
        if (dim < 0) != (tps == 1) or (dim >= 0 and shape[dim] % tps):
            fail(f"{field} has dim {dim} and tp_size {tps}, which do not shard its shape {shape}")
        chunk = numel // tps
        used, spans = set(), []
        for i, piece in enumerate(get(t, field, "pieces", list)):
            pf = f"{field}.pieces[{i}]"
            if get(piece, pf, "file", str) not in files:
                fail(f"{pf}.file is {piece['file']!r}, which is not one of the checkpoint's files")
            if piece["file"] in used:
                fail(f"{pf}.file names {piece['file']} for a second piece of this tensor")
            used.add(piece["file"])
            r = _int(get(piece, pf, "tp_rank", None), pf + ".tp_rank", 0, tps - 1, fail)
            b = _int(get(piece, pf, "begin", None), pf + ".begin", 0, chunk, fail)
            e = _int(get(piece, pf, "end", None), pf + ".end", b, chunk, fail)
            if not re.fullmatch(r"0x[0-9a-f]{8}", str(get(piece, pf, "crc32c", str))):
                fail(f"{pf}.crc32c is not 0x and 8 lowercase hex digits")
            spans.append((r, b, e))
        for r in range(tps):
            covered = 0
            for _, b, e in sorted(x for x in spans if x[0] == r):
                if b != covered:
                    fail(f"{field}.pieces {'overlap' if b < covered else 'leave a gap'} in TP chunk {r}")
                covered = e
            if covered != chunk:
                fail(f"{field}.pieces cover {covered} of the {chunk} elements of TP chunk {r}")
    return m


def verify(step_dir, manifest, check_crc=True):
    """Each file against the manifest: size, header (save id, rank, step; every piece's dtype and
    shape; rank 0's values and optimizer), and with check_crc its CRC32C and every piece's checksum."""
    pieces_in = {}
    for key, t in manifest["tensors"].items():
        for p in t["pieces"]:
            pieces_in.setdefault(p["file"], []).append((key, t, p))
    for name, f in sorted(manifest["files"].items()):
        path = os.path.join(step_dir, name)
        who = f"file '{path}' (written by rank {f['rank']})"
        if not os.path.lexists(path):
            raise CheckpointError(f"{who} is missing")
        fh, size = open_regular(path)
        fh.close()
        if size != f["bytes"]:
            raise CheckpointError(f"{who} has {size} bytes but the manifest says {f['bytes']}")
        header, start = read_header(path, size)
        data_end = start + max((i["data_offsets"][1] for k, i in header.items() if k != "__metadata__"), default=0)
        if size != data_end:  # before any CRC pass: a huge (sparse) tail would take hours
            raise CheckpointError(f"{who} has {size} bytes but its header ends its data at byte {data_end} "
                                  f"(bytes appended, or not a file a save wrote)")
        meta = header.get("__metadata__", {})
        if meta.get("save_id") != manifest["save_id"]:
            raise CheckpointError(f"{who} is from another save (save id {meta.get('save_id')}, not {manifest['save_id']})")
        if meta.get("rank") != str(f["rank"]) or meta.get("step") != str(manifest["step"]):
            raise CheckpointError(f"{who} says it is rank {meta.get('rank')}'s file of step {meta.get('step')}")
        if f["rank"] == 0:
            for key in ("values", "optimizer"):
                try:
                    recorded = json.loads(meta.get(key, "null"))
                except ValueError:
                    recorded = None
                if recorded != manifest[key]:
                    raise CheckpointError(f"{who} records {key} {meta.get(key)} but the manifest says {json.dumps(manifest[key])}")
        listed = pieces_in.get(name, [])
        if len(listed) != len(header) - ("__metadata__" in header):
            raise CheckpointError(f"{who} holds other tensors than the manifest lists in it")
        if check_crc:
            crc = 0
            fh, _ = open_regular(path)
            with fh:
                while chunk := fh.read(8 << 20):
                    crc = crc32c(chunk, crc)
            if f"0x{crc:08x}" != f["crc32c"]:
                raise CheckpointError(f"{who} has CRC32C 0x{crc:08x} but the manifest says {f['crc32c']}")
        for key, t, p in listed:
            info = header.get(key)
            if info is None:
                raise CheckpointError(f"{who} has no tensor {key!r} though the manifest puts a piece of it there")
            if info["dtype"] != t["dtype"] or info["shape"] != [p["end"] - p["begin"]]:
                raise CheckpointError(f"{who} holds {key!r} as {info['dtype']} {info['shape']} but the manifest says "
                                      f"{t['dtype']} [{p['end'] - p['begin']}]")
            if check_crc:
                b, e = info["data_offsets"]
                fh, _ = open_regular(path)
                with fh:
                    fh.seek(start + b)
                    got = piece_checksum(crc32c(fh.read(e - b)), manifest["save_id"], key, t, p)
                if f"0x{got:08x}" != p["crc32c"]:
                    raise CheckpointError(f"{who}: its bytes of {key!r} do not have the checksum the manifest gives for "
                                          f"elements [{p['begin']}, {p['end']}) of TP chunk {p['tp_rank']}")


def consolidate(directory, step=None, optimizer=False, check_crc=True):
    """key -> full (TP-unsharded) tensor; keys are module names, or checkpoint keys with optimizer=True."""
    step_dir = resolve(directory, step)
    manifest = load_manifest(step_dir)
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
            assert covered == local.numel(), "load_manifest checked the coverage"
            if sharded:
                full.view(outer, shape[dim], inner)[:, t * chunk:(t + 1) * chunk, :] = local.view(outer, chunk, inner)
            else:
                full.view(-1)[:] = local
        out[key if optimizer else key[len("model/"):]] = full
    return out, manifest


def main(argv=None):
    """The `meshddp-consolidate` command (argv: the arguments, default sys.argv[1:])."""
    parser = argparse.ArgumentParser(prog="meshddp-consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("output")
    parser.add_argument("--step", type=int)
    parser.add_argument("--optimizer", action="store_true", help="also the optimizer state, under checkpoint keys")
    parser.add_argument("--no-verify", action="store_true", help="skip the CRC32C check (sizes and save ids are still checked)")
    parser.add_argument("--torch-save", help="also write a torch.save() state dict here")
    args = parser.parse_args(argv)
    written = []  # outputs this run wrote: all removed if a later one fails
    try:
        tensors, manifest = consolidate(args.checkpoint, args.step, args.optimizer, not args.no_verify)
        metadata = {"format": "meshddp-consolidated", "step": str(manifest["step"]),
                    "values": json.dumps(manifest["values"]), "optimizer": json.dumps(manifest["optimizer"])}
        save_safetensors(tensors, args.output, metadata)
        written.append(args.output)
        if args.torch_save:
            _write_atomically(args.torch_save, lambda f: torch.save(tensors, f))
            written.append(args.torch_save)
    except (CheckpointError, OSError) as e:
        for path in written:
            os.remove(path)
        kept = f" (removed what this run wrote: {', '.join(written)})" if written else ""
        sys.exit(f"error: {e}{kept}")
    total = sum(t.numel() for t in tensors.values())
    print(f"{args.output}: {len(tensors)} tensors, {total} elements, step {manifest['step']}", file=sys.stderr)


if __name__ == "__main__":
    main()
