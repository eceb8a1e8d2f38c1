"""Which machine keeps which blocks, for contexts spread over machines (issue #15).

Each machine keeps the blocks it answers from in its own `$STARQA_HOME`; no shared file
system is assumed. The rule: machine j of H keeps blocks `split_contiguous(n, H, j)` (one
contiguous range), and Phase 2 splits that range between the machine's ranks
(`dist.split_by_host`), so a later `ask` on the same machines loads what each one has.

    ingest (workers)   `shared_folder`: does every machine see node 0's cache? (a marker
                       file with a random token, not an assumption) → encode (each method's
                       own assignment) → `place_ingest`: blocks move to the machine that
                       keeps them, the plan's checksums are gathered, each launcher commits
                       its own manifest (`Placement`); on a shared cache node 0 commits all
    ask (workers)      `ensure_blocks`: a block a machine should load but lacks (the group
                       has other machines than the ingest) is fetched from a machine of the
                       group that keeps it, checksummed, and the manifest records it; a
                       block no machine of the group keeps is an error naming its machines
    ask (launcher)     `check_here`: on one machine, the blocks kept elsewhere are named

Runs in the workers (every function taking a `DistInfo` is a collective: every rank calls
it) except `check_here`. torch is imported through `starqa.runtime.dist`, inside the functions.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from pathlib import Path

from starqa.core.errors import ShardError, StarqaError
from starqa.cache.manifest import Manifest, block_file, write_manifest
from starqa.core.blocks import split_contiguous
from starqa.cache.shards import sha256_file


def kept_by(n_blocks: int, nodes: int, node: int) -> list[int]:
    """The blocks machine `node` of `nodes` keeps (and Phase 2 loads there)."""
    return list(split_contiguous(n_blocks, nodes, node))


def shared_folder(info, root: Path) -> bool:
    """Whether every machine of the group sees the same cache folder `root` (a shared file
    system): node 0's lead writes a marker with a random name, every lead looks for it."""
    from starqa.runtime import dist

    token = dist.broadcast_object(info, secrets.token_hex(8) if info.rank == 0 else None, src=0)
    marker = root / f".host-check-{token}"
    if info.rank == 0:
        marker.write_text(token)
    dist.barrier(info)
    seen = dist.all_gather_object(info, (not info.lead) or marker.exists())
    dist.barrier(info)  # every lead has looked before the marker goes
    if info.rank == 0:
        marker.unlink(missing_ok=True)
    return all(seen)


def place_ingest(info, folder: Path, blocks, shared: bool) -> dict | None:
    """After Phase 1 (every rank wrote its blocks into its machine's `folder`): each block
    moves to the machine that keeps it (`kept_by`; on a shared cache node 0 keeps all), the
    blocks no machine keeps are removed, and every lead returns what its launcher commits:
    {"shared", "held", "homes", "hosts", "sums": per block [bytes, sha256]}. None elsewhere."""
    from starqa.runtime import dist

    n = len(blocks)
    nodes = info.nodes
    have = {}
    if info.lead:
        for i in range(n):
            if (path := folder / block_file(i)).exists():
                have[path.name] = sha256_file(path)
    homes = [0] * n if shared else [nodes[j] for j in range(len(nodes))
                                    for _ in kept_by(n, len(nodes), j)]
    held = [i for i in range(n) if homes[i] == info.node]
    holders = dist.move_files(info, folder, have, [block_file(i) for i in held], shared)
    if missing := [i for i in range(n) if block_file(i) not in holders]:
        raise ShardError(f"No worker wrote block(s) {missing}; nothing was cached.")
    sums = dist.all_gather_object(info, {
        i: [(folder / block_file(i)).stat().st_size, sha256_file(folder / block_file(i))]
        for i in held} if info.lead else {})
    if not info.lead:
        return None
    for i in range(n):  # what another machine keeps goes (it was moved there)
        if i not in held:
            (folder / block_file(i)).unlink(missing_ok=True)
    merged = {int(i): s for part in sums for i, s in part.items()}
    return {"shared": shared, "held": held, "homes": homes, "hosts": _hosts(info),
            "sums": [merged[i] for i in range(n)]}


def _hosts(info) -> list[str]:
    """Per node, "host, address" as the group saw it."""
    found = {}
    for peer in info.roster:
        found.setdefault(peer.node, f"{peer.host}, {peer.address}")
    return [found.get(node, "?") for node in range(max(found, default=0) + 1)]


def ensure_blocks(info, manifest: Manifest) -> Manifest:
    """Before Phase 2 loads: this machine holds the blocks its ranks load (those of
    `kept_by` for this group's machines). Missing ones come from a machine of the
    group that holds them (checksummed, written whole) and are recorded in this machine's
    manifest; a block no machine of the group holds is a StarqaError naming the machines of
    the ingest that keep it, raised on every rank alike. Every rank calls it together."""
    from starqa.runtime import dist

    keys = dist.all_gather_object(info, manifest.key)
    if len(set(keys)) > 1:
        nodes = ", ".join(f"{info.roster[r].describe()}: {k}" for r, k in enumerate(keys))
        raise StarqaError(f"The machines of the group chose different contexts ({nodes}).",
                          hint="name the same context on every machine: --context NAME")
    n = len(manifest.blocks)
    host = kept_by(n, len(info.nodes), info.nodes.index(info.node))
    have = {block_file(i): manifest.blocks[i].sha256 for i in manifest.local_blocks
            if (manifest.folder / block_file(i)).exists()}
    lacking = [i for i in host if block_file(i) not in have]
    holders = dist.move_files(info, manifest.folder, have, [block_file(i) for i in lacking])
    if nowhere := [i for i in range(n) if block_file(i) not in holders]:
        raise StarqaError(_nowhere_message(manifest, nowhere, len(info.nodes)),
                          hint=_nowhere_hint(manifest))
    if lacking and info.lead and manifest.placement is not None:
        held = tuple(sorted({*manifest.placement.held, *lacking}))
        manifest = write_manifest(manifest.folder,
                                  replace(manifest, placement=replace(manifest.placement,
                                                                      held=held)))
    dist.barrier(info)  # every fetched file is in place before any rank loads
    return manifest


def _nowhere_message(manifest: Manifest, blocks: list[int], nodes: int) -> str:
    if manifest.placement is None:
        return (f"No machine of this group of {nodes} holds blocks {blocks} of "
                f"{manifest.name!r}.")
    return (f"Context {manifest.name!r} was encoded across {manifest.placement.nodes} "
            f"machines, and no machine of this group of {nodes} keeps all of it: "
            f"{manifest.placement.where(blocks)}.")


def _nowhere_hint(manifest: Manifest) -> str:
    nodes = manifest.placement.nodes if manifest.placement else 2
    return (f"ask on the machines of the ingest (each: starqa ask QUESTION --nnodes {nodes} "
            f"--node-rank N --rdzv-endpoint HOST:PORT), or re-ingest across these machines: "
            f"{manifest.rerun}")


def check_here(manifest: Manifest) -> None:
    """On one machine (no group to fetch from): every block must be here. A context kept
    across machines names where the others are."""
    if manifest.placement is None:
        return
    missing = [i for i in range(len(manifest.blocks)) if i not in set(manifest.local_blocks)]
    if missing:
        raise StarqaError(
            f"This machine (node {manifest.placement.node} of the ingest) keeps "
            f"{len(manifest.local_blocks)} of the {len(manifest.blocks)} blocks of "
            f"{manifest.name!r}; the others are elsewhere: "
            f"{manifest.placement.where(missing)}.", hint=_nowhere_hint(manifest))
