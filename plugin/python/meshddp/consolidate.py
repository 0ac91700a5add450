"""Turns a sharded meshddp checkpoint (any DP x TP x PP) into one full-model safetensors file that a
single-process PyTorch model loads with load_state_dict.

    meshddp-consolidate CKPT_DIR OUT.safetensors [--step N] [--optimizer] [--torch-save OUT.pt]

CKPT_DIR is a save directory (its live run's newest complete step is taken, or step-N with --step) or
a step-<N> directory. The checkpoint is read by the engine's own reader (meshddp._C, the one a
load uses), so everything a load checks is checked here: the manifest's checksum and fields, each
file's size, header, save id and CRC32C, each piece's checksum. A checkpoint that fails a check gives
`error: <what is wrong>` and exit 1, and no output is written; outputs are written under a temporary
name and renamed when complete. The output holds the model's params and buffers under their module
names ("blocks.0.attn.q.weight"), or with --optimizer every tensor under its checkpoint key
("model/...", "optim/exp_avg/..."). Also usable as a module: consolidate(), load_safetensors(),
save_safetensors().
"""
import argparse
import json
import os
import re
import struct
import sys
import warnings

import torch

from . import _C

_DTYPE_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}


class CheckpointError(Exception):
    """A checkpoint that cannot be consolidated; the message names the file and what is wrong."""


def _split_step_dir(directory, step):
    """(save directory, step) of CKPT_DIR: a step-<N> directory (one with manifest.json) is its parent's step N."""
    if step is not None and not 0 <= step < 2**63:
        raise CheckpointError(f"--step {step}: a step is a whole number from 0 to 2^63-1")
    directory = os.fspath(directory)
    try:
        directory.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(f"{directory!r} is not UTF-8, which the checkpoint reader takes: rename the directory "
                              f"(or link to it under a UTF-8 name)") from None
    if not os.path.isdir(directory):
        raise CheckpointError(f"'{directory}' is not a directory")
    if not os.path.lexists(os.path.join(directory, "manifest.json")):
        return directory, step
    if step is not None:
        raise CheckpointError(f"'{directory}' is a step directory; --step {step} picks a step of a save directory: "
                              f"pass the save directory with --step, or the step directory alone")
    path = os.path.abspath(directory)
    name = os.path.basename(path)
    if not re.fullmatch(r"step-(0|[1-9][0-9]{0,18})", name):
        raise CheckpointError(f"'{directory}' holds a manifest.json but is not named step-<N>: rename it to the step "
                              f"it holds, or pass its save directory")
    return os.path.dirname(path), int(name[5:])


def _as_command_error(message):
    """The reader's error as this command's: without the load's framing (one rank here, nothing loaded
    anywhere) and with this command's flag for picking a step."""
    message = re.sub(r"^checkpoint load from '.*?' failed; nothing was loaded on any rank:\s*rank 0: ", "",
                     message.strip(), flags=re.S)
    return message.replace("(load_checkpoint(..., step); the examples: --resume-step N)", "(--step N)")


def consolidate(directory, step=None, optimizer=False, check_crc=None):
    """(key -> whole tensor, {"step", "values", "optimizer"}): keys are module names, or checkpoint keys
    with optimizer=True. Raises CheckpointError naming what is wrong."""
    if check_crc is not None:
        warnings.warn("consolidate(check_crc=...) is deprecated and ignored: the engine's reader always checks "
                      "CRC32C (at GB/s)", FutureWarning, stacklevel=2)
    save_dir, step = _split_step_dir(directory, step)
    try:
        _, saved_step, values, optimizer_json, tensors = _C._read_whole_checkpoint(save_dir, step, optimizer)
    except RuntimeError as e:
        raise CheckpointError(_as_command_error(str(e))) from None
    out = {key if optimizer else key[len("model/"):]: tensor for key, tensor in tensors}
    return out, {"step": saved_step, "values": values, "optimizer": json.loads(optimizer_json)}


def load_safetensors(path):
    """name -> tensor, for every tensor of a safetensors file (read by the engine's reader)."""
    try:
        return _C._load_safetensors(path)[0]
    except RuntimeError as e:
        raise CheckpointError(str(e).strip()) from None


def save_safetensors(tensors, path, metadata=None):
    """Writes name -> tensor as a safetensors file (8-aligned data, like the safetensors package),
    via a temporary file renamed at the end: `path` is either complete or untouched."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in _DTYPE_NAMES:
            raise CheckpointError(f"'{name}' is {t.dtype}, which safetensors (as written here) does not hold")
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
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


def _check_outputs(checkpoint, step, outputs):
    """Refuses outputs that would overwrite the checkpoint being read (a file of one of its step
    directories, or its `latest`) or each other, before anything is read or written."""
    root = os.path.realpath(_split_step_dir(checkpoint, step)[0])
    for flag, path in outputs:
        relative = os.path.relpath(os.path.realpath(path), root)
        if relative == "latest" or (relative != os.pardir and not relative.startswith(os.pardir + os.sep)
                                    and os.sep in relative):
            raise CheckpointError(f"{flag} '{path}' is a file of the checkpoint being read, or inside one of its "
                                  f"directories ('{root}'): writing it would alter the checkpoint; write the output "
                                  f"outside the checkpoint's step directories")
    if len(outputs) == 2 and os.path.realpath(outputs[0][1]) == os.path.realpath(outputs[1][1]):
        raise CheckpointError(f"the output and --torch-save name the same file '{outputs[0][1]}' (the torch.save file "
                              f"would replace the safetensors one): give them different paths")


def main(argv=None):
    """The `meshddp-consolidate` command (argv: the arguments, default sys.argv[1:])."""
    parser = argparse.ArgumentParser(prog="meshddp-consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("output")
    parser.add_argument("--step", type=int)
    parser.add_argument("--optimizer", action="store_true", help="also the optimizer state, under checkpoint keys")
    parser.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)  # deprecated: always verified
    parser.add_argument("--torch-save", help="also write a torch.save() state dict here")
    args = parser.parse_args(argv)
    if args.no_verify:
        print("meshddp-consolidate: --no-verify is deprecated and ignored (every checksum is checked, at GB/s)",
              file=sys.stderr)
    written = []  # outputs this run wrote: all removed if a later one fails
    try:
        _check_outputs(args.checkpoint, args.step,
                       [("the output", args.output)] + ([("--torch-save", args.torch_save)] if args.torch_save else []))
        tensors, saved = consolidate(args.checkpoint, args.step, args.optimizer)
        metadata = {"format": "meshddp-consolidated", "step": str(saved["step"]),
                    "values": json.dumps(saved["values"]), "optimizer": json.dumps(saved["optimizer"])}
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
    print(f"{args.output}: {len(tensors)} tensors, {total} elements, step {saved['step']}", file=sys.stderr)


if __name__ == "__main__":
    main()
