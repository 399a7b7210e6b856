"""Priority queues of waiting actions, one min-heap per job, so fair share can pick across jobs
in O(jobs) while each job's order stays O(log n)."""

from __future__ import annotations

from heapq import heappop, heappush  # names, not ``heapq.x``: compiled, no module lookup a call
from typing import Callable

from ..core.action import Action


class JobQueues:
    """``_only`` is the heap of the one job while there is only one (jobs are never forgotten, so
    it stays None once a second job has queued here): ``pop`` then needs no fair-share look and
    no walk of ``heaps`` (py-spy put 2-3% of ``bench scheduler`` on unpacking ``heaps.values()``)."""

    __slots__ = ("heaps", "size", "_seq", "_cancelled", "_only")

    def __init__(self) -> None:
        self.heaps: dict[str, list[tuple[float, int, Action]]] = {}
        self.size = 0
        self._seq = 0  # ties in key keep submission order (an int: compiled, ``+= 1`` is native)
        self._cancelled: set[str] = set()
        self._only: list[tuple[float, int, Action]] | None = None

    def __len__(self) -> int:
        return self.size

    def push(self, action: Action, key: float) -> None:
        heap = self.heaps.get(action.job)
        if heap is None:
            heap = self.heaps[action.job] = []
            self._only = heap if len(self.heaps) == 1 else None
        self._seq += 1
        heappush(heap, (key, self._seq, action))
        self.size += 1

    def push_back(self, entries: list[tuple[float, int, Action]]) -> None:
        """Return popped entries unchanged (their original order is kept by their sequence)."""
        for entry in entries:
            heappush(self.heaps[entry[2].job], entry)
            self.size += 1

    def cancel(self, action: Action) -> None:
        """Lazy removal: the entry is dropped when it reaches the head."""
        self._cancelled.add(action.id)
        self.size -= 1

    def _clean_head(self, heap: list) -> None:
        cancelled = self._cancelled
        while heap and cancelled and heap[0][2].id in cancelled:
            cancelled.discard(heappop(heap)[2].id)

    def peek_key(self) -> float:
        """The smallest key waiting (inf when empty)."""
        best = float("inf")
        for heap in self.heaps.values():
            self._clean_head(heap)
            if heap and heap[0][0] < best:
                best = heap[0][0]
        return best

    def pop(self, favoured: Callable[[str], bool] | None = None) -> tuple[float, int, Action] | None:
        """The entry with the smallest key; among several jobs, the smallest key of the jobs that
        ``favoured`` accepts (those below their fair share) when there is one."""
        heap = self._only
        if heap is not None:  # one job: no fair share to weigh
            if self._cancelled:
                self._clean_head(heap)
            if not heap:
                return None
            self.size -= 1
            return heappop(heap)
        best = None
        best_fav = None
        for job, heap in self.heaps.items():
            self._clean_head(heap)
            if not heap:
                continue
            head = heap[0]
            if best is None or head < best[0]:
                best = (head, heap)
            if favoured is not None and (best_fav is None or head < best_fav[0]) and favoured(job):
                best_fav = (head, heap)
        if best is None:
            return None
        if best_fav is not None:
            best = best_fav
        self.size -= 1
        return heappop(best[1])
