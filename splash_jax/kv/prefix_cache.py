"""Automatic prefix caching: a radix tree over page-sized token blocks, pages per device.

A node stands for one full page of some prefix: its key is the page's exact tokens and its
parent the node of the page before, so a node identifies the whole prefix it ends (children are
found by a dict lookup on the token tuple: equal hashes with other tokens never match). Each
node records, per device, the global id of a page holding that prefix's latents there. Where a
request needs page j follows its layout's placement (tp: every device; dp/dop: its owner;
cp: device j % N), so one tree serves every layout, and a live switch leaves it valid: pages do
not change content when the layout changes, only which devices a request needs them on.

The allocator owns the pages (reference counts); this tree only names them. A request that
reuses a cached page takes a reference; a cached page no one references stays until the
allocator evicts it for room (it then calls `_evicted`). Roots are per `cache_salt`, so
tenants with different salts never share. A request computing blocks others could share marks
their nodes (`computing`), so an identical prompt arriving meanwhile waits for them instead of
computing them again (n > 1, GRPO groups, one system prompt arriving many times at once).
"""

from __future__ import annotations

import dataclasses

from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.placement import Placement


class Node:
    __slots__ = ("key", "parent", "children", "pages", "computing")

    def __init__(self, key: tuple, parent: "Node | None"):
        self.key, self.parent = key, parent
        self.children: dict[tuple, Node] = {}
        self.pages: dict[int, int] = {}  # device -> global page id holding this prefix there
        self.computing = None  # the running request that will fill this block, if none has yet

    def has(self, devices) -> bool:
        return all(d in self.pages for d in devices)

    @property
    def attached(self) -> bool:
        return self.parent is not None and self.parent.children.get(self.key) is self


@dataclasses.dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up at admission (cumulative)
    hits: int = 0  # of those, tokens found cached
    deferred: int = 0  # admissions postponed to share a block another request was computing
    copied_pages: int = 0  # cached pages copied on write (the page holding a fully cached prompt's last token)
    followed: int = 0  # admissions onto pages another running request computes in the same step

    def as_dict(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "hit_rate": self.hits / self.queries if self.queries else 0.0,
                "deferred": self.deferred, "copied_pages": self.copied_pages,
                "followed": self.followed}


class PrefixCache:
    def __init__(self, allocator: PageAllocator, stats: CacheStats | None = None):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.n = allocator.num_devices
        self._roots: dict[str | None, Node] = {}
        self._node_of: dict[int, Node] = {}  # cached page -> its node
        self.stats = stats or CacheStats()  # the scheduler's: counters survive turning caching off and on
        allocator.on_evict = self._evicted

    # --- lookups ----------------------------------------------------------------------------
    def chain(self, request, max_pages: int) -> list[Node]:
        """The existing nodes along `request`'s first `max_pages` full pages of known tokens."""
        node = self._roots.get(request.cache_salt)
        out: list[Node] = []
        size = self.page_size
        limit = min(max_pages, request.num_known // size)
        while node is not None and len(out) < limit:
            j = len(out)
            node = node.children.get(tuple(request.token_slice(j * size, (j + 1) * size)))
            if node is not None:
                out.append(node)
        return out

    def hits(self, chain: list[Node], placement: Placement, owner: int) -> int:
        """Leading nodes of `chain` cached on every device `placement` needs them on."""
        devices = placement.devices_of_every_page(owner, self.n)
        if devices is None:
            for j, node in enumerate(chain):
                if not node.has(placement.devices_of_page(j, owner, self.n)):
                    return j
            return len(chain)
        for j, node in enumerate(chain):
            pages = node.pages
            for d in devices:
                if d not in pages:
                    return j
        return len(chain)

    def waits_for(self, chain: list[Node], hit: int, request) -> bool:
        """Whether the block after the hit is being computed by another running request (which
        will cache it within a few steps: sharing beats computing it again)."""
        if hit >= len(chain):
            return False
        leader = chain[hit].computing
        return leader is not None and leader is not request and not leader.is_finished and leader.slot >= 0

    # --- a request's pages ----------------------------------------------------------------------
    def take(self, request, chain: list[Node], hit: int, placement: Placement) -> list[list[int]]:
        """Reference the first `hit` nodes' pages for `request` (owner set): its device lists."""
        lists: list[list[int]] = [[] for _ in range(self.n)]
        devices = placement.devices_of_every_page(request.owner, self.n)
        if devices is None:
            for j, node in enumerate(chain[:hit]):
                for d in placement.devices_of_page(j, request.owner, self.n):
                    lists[d].append(node.pages[d])
        else:
            for d in devices:
                lists[d] = [node.pages[d] for node in chain[:hit]]
        self.allocator.ref([p for pages in lists for p in pages])
        request.cache_nodes = list(chain[:hit])
        return lists

    def mark_computing(self, request, chain: list[Node], hit: int, prompt_pages: int) -> None:
        """`request` will compute its prompt's full pages from `hit` on: create their nodes (no
        pages yet) so an identical prompt arriving meanwhile waits for them."""
        parent = chain[hit - 1] if hit else self._root(request.cache_salt)
        size = self.page_size
        marked = []
        for j in range(hit, prompt_pages):
            key = tuple(request.token_slice(j * size, (j + 1) * size))
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = Node(key, parent)
            if node.computing is None and not node.pages:
                node.computing = request
                marked.append(node)
            parent = node
        request.cache_computing = marked

    def insert(self, request, placement: Placement, upto_pages: int) -> None:
        """Cache `request`'s full pages below `upto_pages` not yet cached (their tokens known and
        their latents written by dispatched steps): each page index j gets its node, and each
        device that holds page j names its page there unless the node has one already."""
        nodes = request.cache_nodes
        if len(nodes) >= upto_pages:
            return
        parent = nodes[-1] if nodes else self._root(request.cache_salt)
        if nodes and not parent.attached:
            return  # its prefix was evicted meanwhile: nothing below it is reachable
        size = self.page_size
        for j in range(len(nodes), upto_pages):
            key = tuple(request.token_slice(j * size, (j + 1) * size))
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = Node(key, parent)
            if node.computing is request:
                node.computing = None
            self._name(node, request, j, placement)
            nodes.append(node)
            parent = node

    def register(self, request, placement: Placement) -> None:
        """After a switch moved `request`: name its pages on devices where its nodes have none."""
        for j, node in enumerate(request.cache_nodes):
            self._name(node, request, j, placement)

    def _name(self, node: Node, request, j: int, placement: Placement) -> None:
        """Record `request`'s page j on each device that holds it, where `node` names none yet."""
        entry = placement.entry_of(j, self.n)
        for d in placement.devices_of_page(j, request.owner, self.n):
            if d not in node.pages:
                page = request.device_pages[d][entry]
                node.pages[d] = page
                self._node_of[page] = node
                self.allocator.mark_cached(page)

    def release(self, request) -> None:
        """`request` stops running (finished, preempted): its computing marks go (their empty
        nodes with them); its pages stay cached in the tree (the allocator decides when to drop)."""
        for node in request.cache_computing:
            if node.computing is request:
                node.computing = None
                self._prune(node)
        request.cache_computing = []
        request.cache_nodes = []

    # --- upkeep -----------------------------------------------------------------------------------
    def _root(self, salt) -> Node:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = Node((), None)
        return root

    def _evicted(self, page: int) -> None:
        node = self._node_of.pop(page, None)
        if node is None:
            return
        for d, p in list(node.pages.items()):
            if p == page:
                del node.pages[d]
        self._prune(node)

    def _prune(self, node: Node) -> None:
        """Remove empty leaves (no pages, no children, nobody computing them) up the tree."""
        while node.parent is not None and not node.pages and not node.children and node.computing is None:
            parent = node.parent
            if parent.children.get(node.key) is node:
                del parent.children[node.key]
            node = parent

    def clear(self) -> None:
        """Forget every cached page (the pool's contents were lost, or caching was turned off)."""
        for page in list(self._node_of):
            self.allocator.uncache(page)
        self._node_of.clear()
        self._roots.clear()

    def num_nodes(self) -> int:
        count, todo = 0, list(self._roots.values())
        while todo:
            node = todo.pop()
            count += len(node.children)
            todo.extend(node.children.values())
        return count

    def summary(self) -> dict:
        return {**self.stats.as_dict(), "cached_pages": self.allocator.num_cached(),
                "evictions": self.allocator.num_evictions, "nodes": self.num_nodes()}
