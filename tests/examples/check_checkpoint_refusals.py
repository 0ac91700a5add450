"""Checkpoints are untrusted input, through the tools a user runs: a 2-rank checkpoint of
examples/02_dp_x_tp_gpt, damaged or edited, is refused with `error: <file>: <what is wrong>` and exit
1 by meshddp-consolidate (the engine's reader; no traceback, no output file) and by `--resume` (exit 1, the
value named; torchrun adds its own traceback of the child's exit). The edits a tool could make consistently (a re-signed manifest, a rewritten header)
are made here with the helpers below (the `crc32c` package), which also checks that the manifest
checksum is the documented one (docs: the checkpoint format). Usage: check_checkpoint_refusals.py <gpt_example>."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

import crc32c as crc32c_package

binary = sys.argv[1]
CONSOLIDATE = [sys.executable, "-m", "meshddp.consolidate"]
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
ARGS = ["--seed", "1", "--global-batch", "8", "--dp", "2", "--tp", "1"]
failures = []


def expect(name, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(f"{name}\n{detail}")


def gpt(steps, save_dir, *extra):
    cmd = [torchrun, "--standalone", "--nproc-per-node=2", "--no-python", binary, "--steps", str(steps), *ARGS,
           "--save-dir", save_dir, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


class cc:
    """The format's checksums and header, written out here to craft consistent edits."""

    @staticmethod
    def crc32c(data, crc=0):
        return crc32c_package.crc32c(data, value=crc)

    @staticmethod
    def manifest_checksum(text):
        """(stored, computed) manifest_crc32c: the CRC32C of the text with its 8 hex digits zeroed."""
        m = re.search(rb'"manifest_crc32c"[ \t\r\n]*:[ \t\r\n]*"0x([0-9a-fA-F]{8})"', text)
        zeroed = text[:m.start(1)] + b"00000000" + text[m.end(1):]
        return int(m.group(1), 16), cc.crc32c(zeroed)

    @staticmethod
    def read_header(path):
        """(header dict, data start) of a safetensors file."""
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(n)), 8 + n


def sign(manifest):
    """The manifest's text with a matching manifest_crc32c (what a consistent tool would write)."""
    m = dict(manifest)
    m["manifest_crc32c"] = "0x00000000"
    text = (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()
    stored, computed = cc.manifest_checksum(text)
    return text.replace(b'"0x00000000"', f'"0x{computed:08x}"'.encode(), 1)


def load(step_dir):
    with open(os.path.join(step_dir, "manifest.json"), "rb") as f:
        return json.loads(f.read())


def rewrite_rank0_metadata(step_dir, manifest, **meta):
    """Rewrites rank 0's header metadata (data unchanged) and its size and CRC in `manifest`."""
    path = os.path.join(step_dir, "rank00000.safetensors")
    header, start = cc.read_header(path)
    with open(path, "rb") as f:
        data = f.read()[start:]
    header["__metadata__"].update(meta)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    blob = struct.pack("<Q", len(text)) + text + data
    with open(path, "wb") as f:
        f.write(blob)
    manifest["files"]["rank00000.safetensors"].update(bytes=len(blob), crc32c=f"0x{cc.crc32c(blob):08x}")


def with_values(step_dir, **values):
    """A checkpoint another program wrote consistently, with these user values."""
    m = load(step_dir)
    m["values"].update(values)
    rewrite_rank0_metadata(step_dir, m, values=json.dumps(m["values"], sort_keys=True, separators=(",", ":")))
    with open(os.path.join(step_dir, "manifest.json"), "wb") as f:
        f.write(sign(m))


root = tempfile.mkdtemp(prefix="meshddp-refusals-")
try:
    save = os.path.join(root, "ckpt")
    out = gpt(2, save)
    assert out.returncode == 0, out.stderr
    step_dir = os.path.join(save, "step-2")
    pristine = os.path.join(root, "pristine")
    shutil.copytree(step_dir, pristine)
    target = os.path.join(root, "out.safetensors")

    def restore():
        shutil.rmtree(step_dir)
        shutil.copytree(pristine, step_dir)

    # The intact checkpoint consolidates; a Python-signed copy of its manifest is still accepted.
    run = subprocess.run([*CONSOLIDATE, save, target], capture_output=True, text=True, timeout=240)
    expect("the intact checkpoint consolidates", run.returncode == 0 and os.path.exists(target), run.stderr)
    if os.path.exists(target):
        os.remove(target)

    def manifest_edit(edit, resign=True):
        def damage():
            m = load(step_dir)
            edit(m)
            text = sign(m) if resign else json.dumps(m, indent=1).encode()
            with open(os.path.join(step_dir, "manifest.json"), "wb") as f:
                f.write(text)
        return damage

    def raw(name, change):
        def damage():
            path = os.path.join(step_dir, name)
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(change(data))
        return damage

    def first_two_piece_tensor(m):
        return next(k for k, t in sorted(m["tensors"].items()) if len(t["pieces"]) == 2)

    def negative_duplicate(m):
        t = m["tensors"][first_two_piece_tensor(m)]
        n = t["pieces"][0]["end"] - t["pieces"][0]["begin"]
        t["pieces"][0].update(begin=-n, end=0)

    def relabel_dtype(m):
        m["tensors"][first_two_piece_tensor(m)]["dtype"] = "F16"

    cases = [
        ("the step edited by hand", manifest_edit(lambda m: m.update(step=1), resign=False), "manifest_crc32c is 0x"),
        ("data_position edited by hand", manifest_edit(lambda m: m["values"].update(data_position=99), resign=False),
         "manifest_crc32c is 0x"),
        ("a piece's file reaching out of the directory", manifest_edit(
            lambda m: m["tensors"][first_two_piece_tensor(m)]["pieces"][0].update(file="../../x/rank00000.safetensors")),
         "which is not one of the checkpoint's files"),
        ("a duplicated piece at a negative begin", manifest_edit(negative_duplicate), ".begin is -"),
        ("the manifest's dtype not the header's", manifest_edit(relabel_dtype), "but the manifest says F16"),
        ("a manifest that is not JSON", raw("manifest.json", lambda d: b"\x00" + d[1:]), "manifest"),
        ("a manifest that is not UTF-8", raw("manifest.json", lambda d: d.replace(b'"format"', b'"form\xff\xfe"')),
         "manifest"),
        ("a header length of 2^64-1", raw("rank00001.safetensors", lambda d: b"\xff" * 8 + d[8:]),
         "declares a 18446744073709551615-byte header"),
        ("a truncated file", raw("rank00001.safetensors", lambda d: d[:-5]), "bytes but the manifest says"),
        ("a flipped data byte", raw("rank00001.safetensors", lambda d: d[:-3] + bytes([d[-3] ^ 4]) + d[-2:]),
         "has CRC32C 0x"),
        ("wrong JSON types", manifest_edit(lambda m: m["mesh"].update(world_size="2")), 'mesh.world_size is string "2"'),
    ]
    RESUMED = {"data_position edited by hand", "a piece's file reaching out of the directory",
               "a duplicated piece at a negative begin", "a header length of 2^64-1", "wrong JSON types"}
    for name, damage, message in cases:
        restore()
        damage()
        if os.path.exists(target):
            os.remove(target)
        run = subprocess.run([*CONSOLIDATE, save, target], capture_output=True, text=True, timeout=240)
        expect(f"consolidate refuses {name}", run.returncode == 1 and run.stderr.startswith("error: ")
               and message in run.stderr and "Traceback" not in run.stderr and not os.path.exists(target),
               f"exit {run.returncode}\n{run.stderr[-3000:]}")
        if name not in RESUMED:
            continue  # the C++ tests cover the rest; each torchrun costs seconds
        resume = gpt(3, save, "--resume")
        expect(f"--resume refuses {name}", resume.returncode == 1 and "nothing was loaded" in resume.stderr
               and "terminate" not in resume.stderr,
               f"exit {resume.returncode}\n{resume.stderr[-3000:]}")

    # Issue 20's second attack, against the script (the C++ side: checkpoint_test.cpp,
    # checkpoint_resume_test.cpp). A hang or an out-of-memory read before the fix shows as a timeout.
    def consolidate(*extra, timeout=60, clean=True):
        for leftover in (target, target + ".tmp") if clean else ():  # from an earlier case: each case stands alone
            if os.path.lexists(leftover):
                os.remove(leftover)
        try:
            return subprocess.run([*CONSOLIDATE, *extra], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess([], -1, "", f"(no answer in {timeout} s)")

    def refuses(name, run, message, outputs=(target,)):
        expect(f"consolidate refuses {name}", run.returncode == 1 and run.stderr.startswith("error: ")
               and message in run.stderr and "Traceback" not in run.stderr
               and not any(os.path.exists(o) for o in outputs), f"exit {run.returncode}\n{run.stderr[-3000:]}")

    def resign_text(text):
        stored, computed = cc.manifest_checksum(text)
        return text.replace(f'"0x{stored:08x}"'.encode(), f'"0x{computed:08x}"'.encode(), 1)

    manifest_path = os.path.join(step_dir, "manifest.json")
    latest = os.path.join(save, "latest")
    rank1 = os.path.join(step_dir, "rank00001.safetensors")
    for where in (manifest_path, latest, rank1):
        restore()
        os.remove(where) if os.path.exists(where) else None
        os.mkfifo(where)
        refuses(f"a FIFO as {os.path.basename(where)}", consolidate(save, target, timeout=30),
                f"'{where}' is a FIFO, not a regular file")
        os.remove(where)
    with open(latest, "w") as f:
        f.write("step-2\n")
    restore()
    os.remove(rank1)
    os.symlink("/dev/zero", rank1)
    refuses("/dev/zero as a rank file", consolidate(save, target, timeout=30), "is a character device, not a regular file")
    restore()

    def grown(extra):
        def damage():
            with open(rank1, "r+b") as f:
                f.truncate(os.path.getsize(rank1) + extra)  # sparse: no disk used
            m = load(step_dir)
            m["files"]["rank00001.safetensors"]["bytes"] = os.path.getsize(rank1)
            if extra < (1 << 20):
                with open(rank1, "rb") as f:
                    m["files"]["rank00001.safetensors"]["crc32c"] = f"0x{cc.crc32c(f.read()):08x}"
            with open(manifest_path, "wb") as f:
                f.write(sign(m))
        return damage

    def flattened(m):
        key = next(k for k, t in sorted(m["tensors"].items()) if len(t["shape"]) >= 2)
        shape = m["tensors"][key]["shape"]
        m["tensors"][key]["shape"] = [shape[0] * shape[1], *shape[2:]]

    def with_duplicate_key():
        with open(manifest_path, "rb") as f:
            text = f.read()
        text = text.replace(b'"format":', b'"format": "meshddp-checkpoint", "format":', 1)
        with open(manifest_path, "wb") as f:
            f.write(resign_text(text))

    def with_member(text):  # a member nlohmann-json alone would read (Note [Strict JSON]), re-signed
        def damage():
            with open(manifest_path, "rb") as f:
                data = f.read()
            with open(manifest_path, "wb") as f:
                f.write(resign_text(data.replace(b"{", b'{"zz": ' + text.encode() + b",", 1)))
        return damage

    for name, damage, message in (
        ("a number past the double range (re-signed)", with_member("1e999"), "number overflow parsing '1e999'"),
        ("NaN (re-signed)", with_member("NaN"), "invalid literal"),
        ("an integer past int64 (re-signed)", with_member("18446744073709551616"), "out of range (not an int64)"),
        ("a lone surrogate (re-signed)", with_member('"\\ud800"'), "surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF"),
        ("nesting 65 deep (re-signed)", with_member("[" * 65 + "]" * 65), "nesting deeper than 64 levels"),
        ("8 bytes appended to a rank file (re-signed)", grown(8), "but its header ends its data at byte"),
        ("a 1 TiB sparse tail on a rank file (re-signed)", grown(1 << 40), "but its header ends its data at byte"),
        ("a tensor's shape edited (re-signed)", manifest_edit(flattened), "do not have the checksum the manifest gives"),
        ("a tensor named __metadata__", manifest_edit(lambda m: m["tensors"].update(__metadata__=m["tensors"][
            first_two_piece_tensor(m)])), 'tensors["__metadata__"] is not a tensor name'),
        ("a duplicate key", with_duplicate_key, f"duplicate key \"format\" in manifest '{manifest_path}'"),
        ("`latest` naming ../x/step-2", lambda: open(latest, "w").write("../x/step-2\n"), "holds '../x/step-2', which is not a step directory name"),
        ("`latest` with a NUL", lambda: open(latest, "w").write("step-2\0"), "holds 'step-2\\x00', which is not a step directory name"),
        ("`latest` empty", lambda: open(latest, "w").close(), "holds '', which is not a step directory name"),
    ):
        restore()
        with open(latest, "w") as f:
            f.write("step-2\n")
        damage()
        refuses(name, consolidate(save, target, timeout=30), message)
    with open(latest, "w") as f:
        f.write("step-2\n")
    restore()

    # A symlink planted at the output's temp name: replaced, never written through.
    victim = os.path.join(root, "victim")
    with open(victim, "w") as f:
        f.write("precious\n")
    if os.path.exists(target):
        os.remove(target)
    os.symlink(victim, target + ".tmp")
    run = consolidate(save, target, clean=False)
    with open(victim, "rb") as f:
        expect("consolidate never writes through a link at its temp file",
               run.returncode == 0 and f.read() == b"precious\n" and not os.path.lexists(target + ".tmp"), run.stderr)
    # --torch-save failing after the safetensors output was written: both gone.
    refuses("a --torch-save it cannot write", consolidate(save, target, "--torch-save", os.path.join(root, "no", "x.pt")),
            "removed what this run wrote: " + target)
    refuses("--step with a step directory", consolidate(step_dir, target, "--step", "2"),
            "is a step directory; --step 2 picks a step of a save directory")
    shutil.copytree(step_dir, os.path.join(save, "step-3"))
    refuses("step-3 holding step 2", consolidate(save, target, "--step", "3"),
            "holds step 2 but its directory is named 'step-3'")
    shutil.rmtree(os.path.join(save, "step-3"))

    # Values of the wrong type, written consistently by another program: named, exit 1.
    for values, message in (
        ({"seed": "0"}, "value 'seed' is a string; expected an integer"),
        ({"data_position": 2.5}, "value 'data_position' is a number; expected an integer"),
        ({"lr_schedule/lr_scheduler.steps": "two"}, "value 'lr_schedule/lr_scheduler.steps' is 'two'; expected a step count"),
        ({"lr_schedule/lr_scheduler.steps": 2}, "value 'lr_schedule/lr_scheduler.steps' is an integer; expected a string"),
    ):
        restore()
        with_values(step_dir, **values)
        resume = gpt(3, save, "--resume")
        expect(f"--resume names {values}", resume.returncode == 1 and message in resume.stderr
               and "terminate" not in resume.stderr, f"exit {resume.returncode}\n{resume.stderr[-3000:]}")
    # The same rewrite with the right types loads (the rewrite itself is sound).
    restore()
    with_values(step_dir, seed=1)
    resume = gpt(3, save, "--resume")
    expect("--resume loads a consistent rewrite", resume.returncode == 0, resume.stderr[-3000:])
finally:
    shutil.rmtree(root, ignore_errors=True)

if failures:
    sys.exit("FAILED:\n" + "\n".join(failures))
print("all passed")
