"""meshddp-consolidate's arguments are refused with `error: ...` (exit 1, no traceback, no output): a step
out of range, a checkpoint path the engine's reader cannot take (not UTF-8), and outputs that would
damage the checkpoint or each other. An output that is a file of the checkpoint being read (its
manifest, a shard, `latest`) would overwrite the checkpoint, and --torch-save naming the same file as
the safetensors output would leave a torch.save file under the safetensors name; both are refused with
`error: ...` (exit 1) before anything is written, and the checkpoint still consolidates afterwards."""
import os

import pytest
import torch

import meshddp
from meshddp import consolidate


@pytest.fixture
def checkpoint(mesh, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ddp = meshddp.DistributedDataParallel(model, mesh, config=meshddp.DdpConfig(use_distributed_optimizer=True))
    meshddp.DistributedOptimizer(ddp).save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def refused(argv):
    with pytest.raises(SystemExit) as e:
        consolidate.main([str(a) for a in argv])
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: "), e.value.code
    return e.value.code


@pytest.mark.parametrize("inside", ["step-0/manifest.json", "step-0/rank00000.safetensors", "latest"])
def test_an_output_that_is_a_file_of_the_checkpoint_is_refused_and_the_checkpoint_kept(checkpoint, inside):
    target = checkpoint / inside
    before = target.read_bytes()
    assert "is a file of the checkpoint being read" in refused([checkpoint, target])
    assert "is a file of the checkpoint being read" in refused([checkpoint / "step-0", checkpoint / "out.st",
                                                                "--torch-save", target])
    assert target.read_bytes() == before and not os.path.exists(checkpoint / "out.st")
    consolidate.consolidate(str(checkpoint))  # still whole


def test_torch_save_to_the_safetensors_output_is_refused(checkpoint, tmp_path):
    out = tmp_path / "full.st"
    assert "name the same file" in refused([checkpoint, out, "--torch-save", out])
    assert not os.path.exists(out)
    consolidate.main([str(checkpoint), str(out)])  # alone it is fine
    assert sorted(consolidate.load_safetensors(str(out))) == ["0.bias", "0.weight", "1.bias", "1.weight"]


@pytest.mark.parametrize("step", ["-1", str(2**64)])
def test_a_step_out_of_range_is_refused_by_name(checkpoint, tmp_path, step):
    message = refused([checkpoint, tmp_path / "o.st", "--step", step])
    assert f"--step {step}: a step is a whole number from 0 to 2^63-1" in message


def test_a_checkpoint_path_that_is_not_utf8_is_refused_by_name(checkpoint, tmp_path):
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/ck\xff")
    os.rename(checkpoint, odd)
    assert "is not UTF-8" in refused([odd, tmp_path / "o.st"])
    assert not os.path.exists(tmp_path / "o.st")
