"""In-process tests of a fix with the patch left out: megatron-core's own function where the
patch wrapped it, for one test (pytest's monkeypatch puts the patch back afterwards).

Launched runs leave a patch out with MEGATRON_PATCHES_DISABLE=<name> (megatron_patches/registry.py).
In a test process the patches are applied once for all tests, so there the patch's wrapper is
taken off the one megatron attribute it replaced instead: what runs is exactly what megatron
would run had the patch never been applied. It refuses where another wrapper sits on the same
attribute (taking the patch off would take that one off too), so nothing else changes.
"""

from __future__ import annotations


def apply_all() -> dict:
    """Every patch applied as pretrain_moe.py applies them (idempotent): name -> status."""
    from megatron_patches import registry

    registry.load_patches()
    return {s.name: s for s in registry.apply_patches(registry.current_context(cpu_backend=True))}


def _wrappers(function) -> list:
    chain = []
    while getattr(function, "__wrapped__", None) is not None:
        chain.append(function)
        function = function.__wrapped__
    return chain


def leave_out(monkeypatch, patch: str, owner, attribute: str) -> None:
    """Puts megatron's own `owner.attribute` back for this test, under patch `patch`'s wrapper,
    which must be applied and be the only wrapper there."""
    statuses = apply_all()
    assert statuses[patch].applied, statuses[patch].line()
    wrappers = _wrappers(getattr(owner, attribute))
    owners = {getattr(w, "__wrapped_by__", None) for w in wrappers}
    assert wrappers and owners == {patch}, (
        f"{owner.__name__}.{attribute} is wrapped by {owners}, not by {patch!r} alone")
    monkeypatch.setattr(owner, attribute, wrappers[-1].__wrapped__)
