"""The engine's floors, checked on every #include: a file may include its own folder and the floors
below it, never a floor above it nor a sibling on its own floor (docs/design.md, CMakeLists.txt):

    plugin                      (4)  DistributedDataParallel, checkpoints of the whole training state
    tp, optimizer               (3)  tensor-parallel layers and plans; the ZeRO-1 optimizer
    common                      (2)  glob matching, the gradient norm over DP x TP
    checkpoint, grad_buffer     (1)  files on disk; flat buffers, buckets, hooks
    mesh                        (0)  DeviceMesh, groups, the checked collectives

Every top-level folder whose CMakeLists.txt builds a library (add_library) must be in FLOORS, so a new
folder is placed on a floor before it can be used. The public umbrella include/meshddp/meshddp.h sits
above all. Usage: check_layering.py <source dir>. Exit 1 listing each offending #include.
Seen failing: an `#include "optimizer/shard_layout.h"` added to tp/tp_layers.cpp (a sibling floor) and
a common/ folder missing from FLOORS were each reported.
"""

import os
import re
import sys

FLOORS = {"mesh": 0, "checkpoint": 1, "grad_buffer": 1, "common": 2, "tp": 3, "optimizer": 3, "plugin": 4}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def library_folders(src):
    found = []
    for name in sorted(os.listdir(src)):
        cmake = os.path.join(src, name, "CMakeLists.txt")
        if name in ("tests", "examples", "bench", "third_party") or not os.path.isfile(cmake):
            continue
        with open(cmake) as f:
            if re.search(r"^\s*add_library\(meshddp_", f.read(), re.M):
                found.append(name)
    return found


def folder_of(src, including_file, target):
    """The top-level folder the include resolves to (relative to the file, then to the source root)."""
    for base in (os.path.dirname(including_file), src):
        path = os.path.normpath(os.path.join(base, target))
        if os.path.isfile(path):
            rel = os.path.relpath(path, src)
            return rel.split(os.sep)[0]
    return None  # a generated header (meshddp/version.h) or a third-party one


def main(src):
    src = os.path.abspath(src)
    errors = []
    unplaced = [f for f in library_folders(src) if f not in FLOORS]
    for folder in unplaced:
        errors.append(f"{folder}/ builds a meshddp library but has no floor in FLOORS of {__file__}")
    checked = 0
    for folder, floor in FLOORS.items():
        for root, _, files in os.walk(os.path.join(src, folder)):
            for name in files:
                if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                    continue
                path = os.path.join(root, name)
                with open(path, errors="replace") as f:
                    text = f.read()
                for m in INCLUDE.finditer(text):
                    target = folder_of(src, path, m.group(1))
                    checked += 1
                    if target is None or target == folder:
                        continue
                    rel = os.path.relpath(path, src)
                    if target not in FLOORS:
                        errors.append(f'{rel}: #include "{m.group(1)}" reaches {target}/, which is not an engine floor')
                    elif FLOORS[target] >= floor:
                        where = "a sibling on" if FLOORS[target] == floor else "above"
                        errors.append(f'{rel}: #include "{m.group(1)}" reaches {target}/ (floor {FLOORS[target]}), '
                                      f"{where} {folder}/ (floor {floor})")
    if errors:
        print("include layering broken:\n  " + "\n  ".join(errors))
        return 1
    print(f"{checked} includes in {len(FLOORS)} folders point down only (floors: {FLOORS})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
