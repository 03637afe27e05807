"""The wheels bench/gpu_check.sh needs on a GPU machine that reaches no package registry.

    python bench/gpu_check_wheels.py prepare [DIR]         # here, where pip reaches PyPI
    python bench/gpu_check_wheels.py install DIR TARGET    # there, offline

prepare: downloads into DIR (default .whl) megatron-core at requirements.lock's version and
every distribution it needs (its Requires-Dist, markers judged for CPython 3.12 on x86-64 Linux,
followed recursively) that the device image lacks (bench/device_image_packages.txt), each at
requirements.lock's version where the lock pins it, and nothing else; then prints the device call.
A DIR holding other wheels is refused (two versions of one distribution stop the install there).

install: resolves the same root against what this Python already has, offline (pip's
`--dry-run --no-index --find-links DIR --report`), then installs just what the resolution picked
from DIR into TARGET (`--target --no-deps`; `--target` alone would ignore what is installed and
reinstall torch). Where DIR lacks something, one line naming it, exit 2.

Standard library only on the device side; prepare uses `packaging` (in every pip environment).
"""

from __future__ import annotations

import email.parser
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
DEVICE_IMAGE = REPO / "bench" / "device_image_packages.txt"
ROOT = "megatron-core"
# The device: CPython 3.12 on x86-64 Linux (torch 2.11, CUDA 13).
PLATFORM_FLAGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                  *[flag for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                     "manylinux2014_x86_64", "manylinux1_x86_64")
                    for flag in ("--platform", tag)]]
MARKER_ENVIRONMENT = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
}
DEVICE_CALL = ('run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)'
               "  # the device tool; the check itself stops starting steps at 330 s")


class WheelError(Exception):
    """One line for the user: what is wrong and what to do."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if found := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line):
            pins[canonical(found.group(1))] = found.group(2)
    return pins


def root_requirement() -> str:
    pins = lock_pins()
    if ROOT not in pins:
        raise WheelError(f"{LOCK.name} pins no {ROOT}")
    return f"{ROOT}=={pins[ROOT]}"


def device_image() -> set[str]:
    return {canonical(line.strip()) for line in DEVICE_IMAGE.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def requires(wheel: Path, extras: set[str]) -> list:
    """The wheel's Requires-Dist that apply on the device, with the extras asked for."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(name for name in archive.namelist()
                             if re.fullmatch(r"[^/]+\.dist-info/METADATA", name))
        metadata = email.parser.BytesParser().parsebytes(archive.read(metadata_name))
    applying = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or any(
                requirement.marker.evaluate({**MARKER_ENVIRONMENT, "extra": extra})
                for extra in {"", *extras}):
            applying.append(requirement)
    return applying


def download(spec: str, into: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=into) as fresh:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                               "--disable-pip-version-check", *PLATFORM_FLAGS, "-d", fresh,
                               spec], capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
            raise WheelError(f"pip download {spec} failed: "
                             f"{(errors or done.stderr.strip().splitlines() or ['?'])[-1]}")
        (wheel,) = Path(fresh).glob("*.whl")
        return Path(shutil.move(wheel, into / wheel.name))


def prepare(dest: Path) -> list[str]:
    """Downloads the device's missing wheels into dest; returns their file names."""
    from packaging.requirements import Requirement

    pins, present = lock_pins(), device_image()
    with tempfile.TemporaryDirectory(prefix="gpu_check_wheels_") as staging:
        staging = Path(staging)
        queue, wanted = [Requirement(root_requirement())], {}
        while queue:
            requirement = queue.pop(0)
            name = canonical(requirement.name)
            if name in present or name in wanted:
                continue
            spec = f"{name}=={pins[name]}" if name in pins else f"{name}{requirement.specifier}"
            wanted[name] = download(spec, staging)
            queue += requires(wanted[name], set(requirement.extras))
        names = sorted(wheel.name for wheel in wanted.values())
        others = sorted(path.name for path in dest.glob("*.whl")) if dest.is_dir() else []
        if strangers := [name for name in others if name not in names]:
            raise WheelError(f"{dest} holds wheels the check does not need "
                             f"({', '.join(strangers)}); remove them or prepare into an empty "
                             f"folder")
        dest.mkdir(parents=True, exist_ok=True)
        for wheel in wanted.values():
            shutil.copy2(wheel, dest / wheel.name)
    return names


def install(source: Path, target: Path) -> list[str]:
    """Installs into target what this Python lacks of the root, from source alone."""
    root = root_requirement()
    with tempfile.TemporaryDirectory(prefix="gpu_check_install_") as scratch:
        report = Path(scratch) / "report.json"
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q",
                               "--disable-pip-version-check", "--no-index", "--find-links",
                               str(source), "--report", str(report), root],
                              capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
            last = (errors or done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise WheelError(f"cannot install {root} offline from {source} (prepare it with "
                             f"`bash bench/gpu_check.sh --prepare` where PyPI is reachable): "
                             f"{last}")
        picked = [Path(unquote(urlparse(item["download_info"]["url"]).path))
                  for item in json.loads(report.read_text())["install"]]
    if picked:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--disable-pip-version-check",
                        "--upgrade", "--target", str(target), *map(str, picked)], check=True)
    return [wheel.name for wheel in picked]


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["prepare"] and len(argv) <= 2:
            dest = Path(argv[1] if len(argv) == 2 else REPO / ".whl")
            names = prepare(dest)
            print(f"gpu_check_wheels: {dest} holds {', '.join(names)} (what the device image "
                  f"lacks of {root_requirement()}); on the device:\n  {DEVICE_CALL}")
            return 0
        if argv[:1] == ["install"] and len(argv) == 3:
            names = install(Path(argv[1]), Path(argv[2]))
            print(f"gpu_check_wheels: installed {', '.join(names) or 'nothing'} into {argv[2]}")
            return 0
    except WheelError as error:
        print(f"gpu_check_wheels: error: {error}", file=sys.stderr)
        return 2
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
