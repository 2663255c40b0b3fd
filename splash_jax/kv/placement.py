"""Where a request's latent pages live under a layout: one object per rule, no string compares.

A request holds `device_pages[d]`: global page ids on device d, in position order. Page index
j of a request (positions [j*S, (j+1)*S)) lives on:
  Replicated (tp)    every device (a replica each);
  Owner (dp, dop)    its owner device only;
  Striped (cp)       device j % N.
The planner, the scheduler, the step packer, capacity and the policy ask these objects; a new
placement is a new subclass, not a new branch in each of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from splash_jax.kv.allocator import pages_for_tokens


@dataclasses.dataclass(frozen=True)
class Placement:
    name: str

    def devices_of_page(self, j: int, owner: int, n: int) -> tuple[int, ...]:
        """Devices that must hold page index j of a request owned by `owner`."""
        raise NotImplementedError

    def devices_of_every_page(self, owner: int, n: int) -> tuple[int, ...] | None:
        """The devices that hold every page of a request owned by `owner`, when they are the same for
        all its pages (devices_of_page without the page index), else None. Loops over a long
        prefix's pages use it to look up the devices once (a 32K-token prompt has 512 pages)."""
        return None

    def page_mask(self, js: np.ndarray, owner, n: int) -> np.ndarray:
        """[len(js), n] bool: which devices must hold each page index in `js` (devices_of_page for
        many pages at once; `owner`: one, or one per page index)."""
        mask = np.zeros((len(js), n), bool)
        owners = np.broadcast_to(owner, len(js)).tolist()
        for i, j in enumerate(np.asarray(js).tolist()):
            mask[i, list(self.devices_of_page(j, owners[i], n))] = True
        return mask

    def page_index(self, device: int, entry: int, n: int) -> int:
        """Page index of entry `entry` in `device_pages[device]` (lists are in position order);
        elementwise over arrays of devices and entries (a handoff's page-table rebuild)."""
        return entry

    def pages_held(self, device: int, owner: int, n: int, num_pages: int) -> int:
        """How many of a request's first `num_pages` pages `device` holds."""
        raise NotImplementedError

    def entry_of(self, j: int, n: int) -> int:
        """Entry of page index j in the list of a device that holds it."""
        return j

    @property
    def owner_bound(self) -> bool:
        """Whether where a page lives depends on the request's owner (so the owner decides which
        cached copies a request can use)."""
        return False

    def entries_below(self, device, j, n: int):
        """How many entries of `device_pages[device]` hold a page index below j, if the device holds
        the request's pages at all (where a planner starts reading its list for index j on);
        elementwise over arrays of devices and indices."""
        return np.vectorize(lambda d, jj: self.pages_held(d, d, n, jj), otypes=[np.int64])(device, j)

    def pages_needed(self, n: int, owner: int, device_pages: list[list[int]], upto: int, page_size: int) -> list[int]:
        """New pages each device needs so the request holds `upto` tokens."""
        g = pages_for_tokens(upto, page_size)
        return [max(0, self.pages_held(d, owner, n, g) - len(device_pages[d])) for d in range(n)]

    def per_device_need(self, n: int, owner: int, num_pages: int) -> list[int]:
        return [self.pages_held(d, owner, n, num_pages) for d in range(n)]

    def distinct_copies(self, n: int) -> int:
        """How many devices store each token (capacity counts a replicated token once)."""
        return 1

    def cached_bytes_read(self, cached_tokens: float, requests: int, n: int) -> float:
        """Tokens of cache the busiest device reads per decode step (for the cost model)."""
        raise NotImplementedError


class Replicated(Placement):
    def devices_of_page(self, j, owner, n):
        return tuple(range(n))

    def devices_of_every_page(self, owner, n):
        return tuple(range(n))

    def page_mask(self, js, owner, n):
        return np.ones((len(js), n), bool)

    def pages_held(self, device, owner, n, num_pages):
        return num_pages

    def entries_below(self, device, j, n):
        return np.broadcast_to(j, np.broadcast(device, j).shape)

    def distinct_copies(self, n):
        return n

    def cached_bytes_read(self, cached_tokens, requests, n):
        return cached_tokens  # every device reads every request's cache (for its heads)


class Owner(Placement):
    def devices_of_page(self, j, owner, n):
        return (owner,)

    def devices_of_every_page(self, owner, n):
        return (owner,)

    @property
    def owner_bound(self):
        return True

    def page_mask(self, js, owner, n):
        mask = np.zeros((len(js), n), bool)
        mask[np.arange(len(js)), owner] = True
        return mask

    def pages_held(self, device, owner, n, num_pages):
        return num_pages if device == owner else 0

    def entries_below(self, device, j, n):
        return np.broadcast_to(j, np.broadcast(device, j).shape)

    def cached_bytes_read(self, cached_tokens, requests, n):
        per_owner = -(-requests // n)  # the busiest owner's requests
        return per_owner * cached_tokens / max(requests, 1)


class Striped(Placement):
    def devices_of_page(self, j, owner, n):
        return (j % n,)

    def devices_of_every_page(self, owner, n):
        return (0,) if n == 1 else None

    def page_mask(self, js, owner, n):
        js = np.asarray(js)
        mask = np.zeros((len(js), n), bool)
        mask[np.arange(len(js)), js % n] = True
        return mask

    def page_index(self, device, entry, n):
        return device + entry * n

    def entry_of(self, j, n):
        return j // n

    def pages_held(self, device, owner, n, num_pages):
        return len(range(device, num_pages, n))

    def entries_below(self, device, j, n):
        return np.maximum(0, -(-(np.asarray(j) - device) // n))  # len(range(device, j, n))

    def cached_bytes_read(self, cached_tokens, requests, n):
        return cached_tokens / n


def copies_per_page(src: Placement, dst: Placement, n: int) -> float:
    """Average page copies a switch from `src` to `dst` makes per page of cache (owner kept)."""
    moves = sum(len(set(dst.devices_of_page(j, 0, n)) - set(src.devices_of_page(j, 0, n))) for j in range(n))
    return moves / n


REPLICATED, OWNER, STRIPED = Replicated("replicated"), Owner("owner"), Striped("striped")
