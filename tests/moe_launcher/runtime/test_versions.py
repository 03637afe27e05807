"""The launcher refuses an unsupported megatron-core at startup, naming the version."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_launcher.runtime.versions import UnsupportedMegatronVersion, check_megatron_version

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("version,track", [("0.19.2", "default"), ("0.15.0", "legacy"),
                                           ("0.15.3", "legacy")])
def test_supported_versions(version, track):
    assert check_megatron_version(version) == track


@pytest.mark.parametrize("version", ["0.14.0", "0.16.0", "0.19.1", "0.20.0"])
def test_unsupported_versions_are_refused(version):
    with pytest.raises(UnsupportedMegatronVersion, match=rf"megatron-core {version} is not supported"):
        check_megatron_version(version)


def test_launcher_refuses_unsupported_install_before_any_work(tmp_path):
    # A site directory whose megatron-core distribution reports 0.18.0, first on the path.
    dist_info = tmp_path / "megatron_core-0.18.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.18.0\n")
    done = subprocess.run(
        [sys.executable, str(REPO / "pretrain_moe.py"), "--num-layers", "2"],
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "megatron-core 0.18.0 is not supported" in done.stderr
    assert "0.19.2" in done.stderr and "MCORE=legacy bash scripts/setup.sh" in done.stderr
    assert "initializing torch distributed" not in done.stdout
