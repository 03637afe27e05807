"""The patch registry (idempotent, reports every patch, honours MEGATRON_PATCHES_DISABLE) and
the platform defaults the launcher adds."""

from pathlib import Path

import pytest
from packaging.version import Version

from megatron_patches import registry
from moe_launcher.platform_defaults import (
    set_environment_defaults, with_logging_defaults, with_platform_defaults)


def test_every_patch_reports_and_applying_twice_changes_nothing():
    patches = registry.load_patches()
    assert {p.name for p in patches} >= {"dataset-helpers-prebuilt", "distopt-torch-adam-resume",
                                         "local-norm-sequence-parallel", "layer-layout-validation"}
    context = registry.current_context(cpu_backend=True)
    first = registry.apply_patches(context)
    from megatron.core.optimizer import distrib_optimizer
    patched_load = distrib_optimizer.DistributedOptimizer.load_state_dict
    second = registry.apply_patches(context)
    assert first == second and len(first) == len(patches)
    assert distrib_optimizer.DistributedOptimizer.load_state_dict is patched_load
    for status in first:
        assert status.line().startswith(f"[megatron_patches] {status.name}: ")
        assert status.reason


def test_patch_outside_its_versions_is_skipped_with_the_reason():
    patch = registry.Patch(name="probe-version-range", upstream="test", versions="~=0.15.0",
                           summary="", not_needed_because=lambda context: None,
                           apply=lambda: pytest.fail("must not apply"))
    registry.register(patch)
    try:
        statuses = registry.apply_patches(registry.PatchContext(Version("0.19.2"), True))
        status = next(s for s in statuses if s.name == "probe-version-range")
        assert not status.applied and "targets megatron-core ~=0.15.0" in status.reason
    finally:
        registry._REGISTRY.pop("probe-version-range")
        registry._APPLIED.pop("probe-version-range")


def test_patch_hooking_a_package_not_installed_is_skipped_before_its_probe():
    # megatron-core 0.15.x wheels ship no megatron.training; the patches that hook it declare it.
    patch = registry.Patch(name="probe-missing-package", upstream="test", versions=">=0.15",
                           summary="", packages=("megatron.no_such_package",),
                           not_needed_because=lambda context: pytest.fail("must not probe"),
                           apply=lambda: pytest.fail("must not apply"))
    registry.register(patch)
    try:
        statuses = registry.apply_patches(registry.PatchContext(Version("0.19.2"), True))
        status = next(s for s in statuses if s.name == "probe-missing-package")
        assert not status.applied
        assert status.reason == ("megatron.no_such_package is not installed "
                                 "(megatron-core 0.19.2 ships without it)")
    finally:
        registry._REGISTRY.pop("probe-missing-package")
        registry._APPLIED.pop("probe-missing-package")


def test_unknown_disabled_patch_is_refused(monkeypatch):
    registry.load_patches()
    monkeypatch.setenv(registry.DISABLE_ENV, "no-such-patch")
    with pytest.raises(ValueError, match="unknown patches \\['no-such-patch'\\]"):
        registry.current_context(cpu_backend=True)


def test_cpu_defaults_are_added_unless_the_user_decided():
    argv, lines = with_platform_defaults(["--num-layers", "2", "--transformer-impl", "local"],
                                         on_cpu=True, have_te=False)
    assert argv.count("--transformer-impl") == 1
    assert argv[argv.index("--distributed-backend") + 1] == "gloo"
    assert "--use-cpu-initialization" in argv and "--no-rope-fusion" in argv
    assert all(line.startswith("[pretrain_moe] default ") for line in lines)
    assert not any("--transformer-impl" in line for line in lines)


def test_gpu_with_transformer_engine_gets_grouped_gemm_only():
    argv, _ = with_platform_defaults(["--num-layers", "2"], on_cpu=False, have_te=True)
    assert argv == ["--num-layers", "2", "--moe-grouped-gemm"]


def test_wandb_brings_tensorboard_writer_and_throughput_logging():
    argv, lines = with_logging_defaults(["--wandb-project", "p", "--save", "/ckpt"])
    assert argv[argv.index("--tensorboard-dir") + 1] == "/ckpt/tensorboard"
    assert "--log-throughput" in argv and "--log-timers-to-tensorboard" in argv
    assert with_logging_defaults(["--save", "/ckpt"]) == (["--save", "/ckpt"], [])


def test_cuda_device_max_connections_not_forced_under_megatron_fsdp():
    environ = {}
    assert set_environment_defaults(["--use-megatron-fsdp"], environ) == [] and environ == {}
    set_environment_defaults(["--tensor-model-parallel-size", "2"], environ)
    assert environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_readme_documents_every_patch():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for patch in registry.load_patches():
        assert f"| `{patch.name}` |" in readme, f"README's patch table lacks {patch.name}"
