"""Where the prefix cache holds a workload's shared prefixes: physical copies per cached page.

After a run (the engine idle, its cache as the run left it), `census` walks the engine's prefix
tree (`engine.scheduler.cache`, a PrefixCache: roots per cache_salt, a node per full page, its
`pages` dict device -> page id) along each shared prefix of the workload and counts, per page,
the devices holding a copy. tp: N (every device), dp/dop: one per owner that computed or
received it, cp: 1 (page j on device j % N). A page evicted meanwhile counts 0 copies.

The shared prefixes come from the arrivals' content blocks (benchmarks/workloads.py): for every
first block key that several open arrivals start with, the leading blocks they all have (the
multiturn system prompt, each grouped prompt, a Mooncake trace's common leading hash ids).
"""

from __future__ import annotations

import collections

from benchmarks import workloads as W


def shared_prefixes(arrivals: list[W.Arrival], vocab: int, seed: int) -> dict[int, list[int]]:
    """First block key -> the token ids of the leading blocks every open arrival starting with
    that key has (only keys at least two open arrivals start with)."""
    by_first: dict[int, list[tuple]] = collections.defaultdict(list)
    for a in arrivals:
        if a.follows < 0 and a.blocks:
            by_first[a.blocks[0][0]].append(a.blocks)
    out = {}
    for key, seqs in by_first.items():
        if len(seqs) < 2:
            continue
        common = []
        for blocks in zip(*seqs):
            if any(b != blocks[0] for b in blocks):
                break
            common.append(blocks[0])
        out[key] = [t for k, n in common for t in W.block_ids(k, n, vocab, seed)]
    return out


def page_copies(cache, ids: list[int], salt=None) -> list[int]:
    """Devices holding each full page of `ids` in `cache`'s tree (0 from the first page not cached)."""
    size = cache.page_size
    node, out = cache._roots.get(salt), []
    for j in range(len(ids) // size):
        node = node.children.get(tuple(ids[j * size : (j + 1) * size])) if node is not None else None
        out.append(len(node.pages) if node is not None else 0)
    return out


def tree_pages(cache) -> tuple[int, int]:
    """(nodes, device pages named) over the whole tree."""
    nodes = pages = 0
    todo = list(cache._roots.values())
    while todo:
        node = todo.pop()
        for child in node.children.values():
            nodes += 1
            pages += len(child.pages)
            todo.append(child)
    return nodes, pages


def census(engine, arrivals: list[W.Arrival], seed: int) -> dict | None:
    """Copies per shared page in `engine`'s prefix cache now; None without a cache."""
    cache = getattr(engine.scheduler, "cache", None)
    if cache is None:
        return None
    copies = [c for ids in shared_prefixes(arrivals, engine.model_config.vocab_size, seed).values()
              for c in page_copies(cache, ids)]
    nodes, named = tree_pages(cache)
    return {
        "layout": engine.layout.name, "num_devices": engine.n, "shared_pages": len(copies),
        "copies_per_shared_page": sum(copies) / len(copies) if copies else None,
        "copies_min": min(copies, default=None), "copies_max": max(copies, default=None),
        "copies_histogram": dict(sorted(collections.Counter(copies).items())),
        "tree_nodes": nodes, "tree_device_pages": named,
    }
