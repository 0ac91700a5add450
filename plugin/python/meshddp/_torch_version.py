"""Whether the running torch can load meshddp's C++ engine: checked at import, before meshddp._C
is loaded, so a mismatch is a clear ImportError instead of an undefined symbol or a crash.

The rule: the same major.minor as the torch meshddp was built against (2.11.x for 2.11.0). meshddp._C
links LibTorch's C++ API (at::Tensor, c10d::ProcessGroup, autograd nodes), which has no stable ABI
across minor releases: their symbols and class layouts change, so a build for 2.11 against 2.12 fails
to load or, worse, loads and misreads memory. Patch releases of one minor are bug-fix cherry-picks on
its release branch, which keep the C++ ABI in practice; refusing them would force a rebuild for every
patch release, so 2.11.1 runs a build for 2.11.0. The local tag (+cu130, +cpu) is compared for a CUDA
build only (it links libtorch_cuda and a CUDA runtime; a CPU build links neither), as the CMake
package's configure-time check does (cmake/meshddpConfig.cmake.in).
"""

import re

REBUILD = ("pip install --no-build-isolation --force-reinstall --no-deps .  (in meshddp's source tree, with the "
           "running torch installed; or scripts/install_python.sh, which reuses build/)")


def major_minor(version):
    """(major, minor) of a torch version string such as '2.11.0+cu130' or '2.12.0a0+git1234'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"meshddp: cannot read a torch version from '{version}'")
    return int(m.group(1)), int(m.group(2))


def flavour(version):
    """The local tag of a torch version: 'cu130' for '2.11.0+cu130', '' for '2.11.0'."""
    return version.partition("+")[2]


def check(built, running, meshddp_version, with_cuda=False):
    """Raises ImportError when a meshddp built against torch `built` cannot run on torch `running`."""
    if major_minor(built) != major_minor(running):
        raise ImportError(
            f"meshddp {meshddp_version} was built against torch {built}, but torch {running} is running: its "
            f"C++ engine links LibTorch, whose C++ ABI changes between minor releases (the major.minor must "
            f"match). Rebuild meshddp against the running torch: {REBUILD}; or install torch "
            f"{'.'.join(map(str, major_minor(built)))}.x")
    if with_cuda and flavour(built) != flavour(running):
        raise ImportError(
            f"meshddp {meshddp_version} was built against torch {built}, but torch {running} is running: a CUDA "
            f"build of meshddp needs the same CUDA flavour of torch (+{flavour(built)}): its C++ engine links "
            f"libtorch_cuda and a CUDA runtime, which a +cpu torch lacks and another +cuXYZ torch replaces. "
            f"Rebuild meshddp against the running torch: {REBUILD}; or install torch {built}")
