"""Exits 1, naming each, when a requirement of the named installed distributions (or of their
requirements, recursively) is missing or at a version they do not accept: what
`pip install --no-deps` leaves unchecked. The Docker build runs it on the packages it installs
on top of the NGC image, whose own packages it keeps.

    python scripts/check_requirements.py transformers tokenizers pyarrow tqdm
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def unmet_requirements(names: list[str]) -> list[str]:
    problems, seen, pending = [], set(), list(names)
    while pending:
        name = pending.pop()
        if canonicalize_name(name) in seen:
            continue
        seen.add(canonicalize_name(name))
        for line in distribution(name).requires or []:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra, or another platform's
            try:
                installed = distribution(requirement.name).version
            except PackageNotFoundError:
                problems.append(f"{name} needs {requirement}: not installed")
                continue
            if not requirement.specifier.contains(installed, prereleases=True):
                problems.append(f"{name} needs {requirement}: {installed} is installed")
            pending.append(requirement.name)
    return problems


def main(names: list[str]) -> int:
    problems = unmet_requirements(names)
    for problem in problems:
        print(f"check_requirements: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
