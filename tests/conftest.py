import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Test helper modules (tests/_*.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

# In-process tests build real megatron models; without CUDA that needs the CPU backend, which
# must be active before anything imports megatron (collection included).
if not torch.cuda.is_available():
    from moe_launcher import cpu_backend

    # Strict device mode for this process and every process a test launches (they inherit the
    # environment): a host tensor on a group that is NCCL on a GPU is refused, as NCCL would.
    os.environ[cpu_backend.STRICT_DEVICE_ENV] = "1"
    cpu_backend.activate()

from _megatron_cpu import environment_kept  # noqa: E402  (after the CPU backend: see above)


# In-process tests build megatron models and parse its arguments, and both write to os.environ
# (megatron's attention backend sets NVTE_*_ATTN, torch sets TORCHINDUCTOR_CACHE_DIR, a gloo world
# MASTER_*). Left there, every later launch would inherit them, and tests/_launch.py gives a
# launch whose import-time environment differs from the rank server's a launcher of its own that
# imports torch and megatron again: every launched test after the first in-process one took ~1.5x
# its time. Put back after each module's fixtures and after each test (and after each model
# tests/_megatron_cpu.py builds, for a test that launches after building one).
@pytest.fixture(scope="module", autouse=True)
def _environment_kept_per_module():
    with environment_kept():
        yield


@pytest.fixture(autouse=True)
def _environment_kept_per_test():
    with environment_kept():
        yield


@pytest.fixture(scope="session")
def node_shim(tmp_path_factory) -> Path:
    """tests/native/other_node_shim.c, built: LD_PRELOAD it (with NODE_SHIM_HOSTNAME) for a
    process that sees itself on another node. Without a C compiler the test is skipped, or
    fails under CI=true (.ci/run installs one)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        missing = "no C compiler for tests/native/other_node_shim.c"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing} (CI installs it)")
        pytest.skip(missing)
    library = tmp_path_factory.mktemp("shim") / "other_node_shim.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library),
                    str(Path(__file__).parent / "native" / "other_node_shim.c"), "-ldl"],
                   check=True)
    return library


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures launch anything."""
    import _launch

    _launch.fatal_reports.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test (or fixture) whose launches a signal killed gets what each printed before
    its faulthandler report (tests/_launch.py: fatal_reports) as a section of its report."""
    import _launch

    report = (yield).get_result()
    if report.failed and _launch.fatal_reports:
        report.sections.append(("ranks killed by a signal: what they printed first",
                                "\n[...]\n".join(_launch.fatal_reports)))


def pytest_terminal_summary(terminalreporter):
    """How many launches the rank server forked, and which it could not (tests/_launch.py)."""
    import _launch

    if report := _launch.rank_server_report():
        terminalreporter.write_line(report)
