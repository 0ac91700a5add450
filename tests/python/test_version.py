"""meshddp.__version__ (CMake's project version), the torch it was built against and the check at
import (a copy of the built package whose recorded torch is faked, imported in a subprocess), and the
`meshddp-consolidate` command, which reads through the engine's checkpoint reader.

What the cases check:
- meshddp.__version__ is CMakeLists.txt's project version read with pyproject.toml's own regex;
  built_with_torch is the running torch; a copy of the package whose recorded torch is faked (2.10.0, 3.11.0)
  refuses to import in a subprocess with the message above, a faked 2.11.9 of the running flavour imports, and
  a CUDA build refuses a faked +cpu, +cu999 or flavourless torch of the same version (a CPU build accepts
  them); meshddp-consolidate is meshddp.consolidate:main in pyproject.toml, there is no second reader in
  scripts/, and main(argv) consolidates a checkpoint saved from Python into the model's state dict
  (bit-exact); a step directory reads alike, with --optimizer the optimizer state too, and a flipped byte is
  refused naming CRC32C.
"""

import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch

import meshddp
from meshddp import consolidate

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_version_is_cmakes_project_version_read_the_way_pyproject_reads_it():
    settings = pyproject()["tool"]["scikit-build"]["metadata"]["version"]
    assert settings["input"] == "CMakeLists.txt" and "version" in pyproject()["project"]["dynamic"]
    with open(os.path.join(ROOT, settings["input"])) as f:
        version = re.search(settings["regex"], f.read(), re.MULTILINE).group("value")
    assert meshddp.__version__ == version, (meshddp.__version__, version)


def test_the_recorded_torch_is_the_one_this_build_compiled_against():
    assert meshddp.built_with_torch == torch.__version__


def import_with_recorded_torch(tmp_path, built):
    """`import meshddp` in a subprocess, from a copy of this package whose _version.py says it was
    built against torch `built`."""
    package = os.path.dirname(meshddp.__file__)
    copy = tmp_path / "meshddp"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / "_version.py").read_text()
    (copy / "_version.py").write_text(re.sub(r'built_with_torch = "[^"]*"', f'built_with_torch = "{built}"', text))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, "-c", "import meshddp; print(meshddp.__version__)"], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("built", ["2.10.0+cu130", "3.11.0"])
def test_a_torch_of_another_major_minor_is_refused_at_import_saying_how_to_rebuild(tmp_path, built):
    r = import_with_recorded_torch(tmp_path, built)
    assert r.returncode != 0, r.stdout
    running = torch.__version__
    assert (f"ImportError: meshddp {meshddp.__version__} was built against torch {built}, but torch {running} is "
            f"running") in r.stderr, r.stderr
    assert "pip install --no-build-isolation --force-reinstall --no-deps ." in r.stderr, r.stderr
    assert "undefined symbol" not in r.stderr


@pytest.mark.parametrize("flavour", ["cpu", "cu999", None])
def test_a_cuda_build_refuses_a_torch_of_another_cuda_flavour_at_import(tmp_path, flavour):
    """A CUDA build links libtorch_cuda and a CUDA runtime: on a +cpu torch (no libtorch_cuda) or another
    +cuXYZ it fails to load with the loader's words, or loads beside a second CUDA runtime. A CPU build
    links neither, so it runs on any flavour (as the CMake package decides: meshddpConfig.cmake)."""
    running = torch.__version__
    built = running.split("+")[0] + (f"+{flavour}" if flavour else "")
    r = import_with_recorded_torch(tmp_path, built)
    if built == running or not meshddp.built_with_cuda:
        assert r.returncode == 0 and r.stdout.strip() == meshddp.__version__, r.stderr
        return
    assert r.returncode != 0, r.stdout
    assert (f"ImportError: meshddp {meshddp.__version__} was built against torch {built}, but torch {running} is "
            f"running") in r.stderr, r.stderr
    assert "a CUDA build of meshddp needs the same CUDA flavour" in r.stderr, r.stderr


def test_another_patch_release_of_the_same_minor_is_accepted(tmp_path):
    major, minor = torch.__version__.split(".")[:2]
    local = torch.__version__.partition("+")[1:]  # the same flavour: "+cu130"
    r = import_with_recorded_torch(tmp_path, f"{major}.{minor}.9" + "".join(local))
    assert r.returncode == 0 and r.stdout.strip() == meshddp.__version__, r.stderr


def test_meshddp_consolidate_reads_through_the_engines_checkpoint_reader(mesh, tmp_path):
    assert pyproject()["project"]["scripts"]["meshddp-consolidate"] == "meshddp.consolidate:main"
    assert not os.path.exists(os.path.join(ROOT, "scripts", "consolidate_checkpoint.py")), "one checkpoint reader"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    opt = meshddp.DistributedOptimizer(ddp)
    opt.save_checkpoint(tmp_path / "ckpt")
    consolidate.main([str(tmp_path / "ckpt"), str(tmp_path / "full.safetensors")])
    full = consolidate.load_safetensors(str(tmp_path / "full.safetensors"))
    assert sorted(full) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(full[name], value), name
    # The step directory itself, and a damaged file: the engine's reader names it, nothing is written.
    step_dir = tmp_path / "ckpt" / "step-0"
    again, saved = consolidate.consolidate(str(step_dir), optimizer=True)
    assert saved["step"] == 0 and saved["optimizer"]["kind"] == "adamw" and any(k.startswith("optim/") for k in again)
    rank0 = step_dir / "rank00000.safetensors"
    data = bytearray(rank0.read_bytes())
    data[-1] ^= 1
    rank0.write_bytes(bytes(data))
    with pytest.raises(consolidate.CheckpointError, match="CRC32C"):
        consolidate.consolidate(str(tmp_path / "ckpt"))
