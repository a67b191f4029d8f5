"""What one device cannot answer: learned for good when the hardware says so, re-asked later when
the refusal is about rights or versions.

Why two kinds: ``NotSupported`` (no ECC on this board, no NVLink, pre-Hopper GPM) does not change
while the driver runs, so asking again would only cost calls. ``NoPermission`` (the agent lacks a
capability or runs as the wrong user), ``FunctionNotFound`` (the driver's library lacks an entry
point) and ``ArgumentVersionMismatch`` / pynvml's library mismatch (binding and driver disagree on a
struct version) are about the agent's setup, which an operator fixes without a pod restart
(profiling rights granted, a driver upgraded and NVML re-initialised). Learning those forever made a
fixed node look broken until restart, and let "the agent lacks rights" pass for "this GPU has no
such counter".

So a refused key is re-asked after ``retry_s`` (5 min by default), doubling up to ``retry_max_s``
while it stays refused; the back-off starts over once the call answers. A function missing from
the Python binding (``AttributeError``) is learned for good: that binding does not change while the
process runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

#: Refusals about the agent's rights or versions, not the hardware: re-asked with back-off.
RETRY_KINDS = frozenset({"NoPermission", "FunctionNotFound", "ArgumentVersionMismatch", "LibraryMismatch"})
RETRY_S = 300.0
RETRY_MAX_S = 3600.0
BINDING_MISSING = "BindingMissing"


def refusal_kind(reason: str) -> str:
    """The NVML error class of a learn reason without its prefix: ``"NVMLError_NoPermission: ..."``
    -> ``"NoPermission"``; ``BindingMissing`` for a function the Python binding does not have;
    ``NotSupported`` for a refusal NVML gave as a value (``isSupportedDevice=0``, a fabric state)."""
    if "missing from the NVML binding" in reason:
        return BINDING_MISSING
    head = reason.split(":", 1)[0].strip()
    if head == "NVMLLibraryMismatchError":
        return "LibraryMismatch"
    if head.startswith("NVMLError_"):
        return head.removeprefix("NVMLError_") or "unknown"
    return "NotSupported"


class Learned:
    """The learned call keys of one device context, with their refusal kind.

    ``key in learned`` is True while the key must not be asked; a retryable key stops being "in"
    once its retry time has come (the next call asks NVML again and, if refused again, learns it
    with a doubled back-off). Iteration yields the keys learned now.
    """

    __slots__ = ("_backoff", "_clock", "_keys", "_retry_at", "retry_max_s", "retry_s")

    def __init__(
        self, clock: Callable[[], float], retry_s: float = RETRY_S, retry_max_s: float = RETRY_MAX_S
    ) -> None:
        self._clock = clock
        self.retry_s = retry_s
        self.retry_max_s = max(retry_s, retry_max_s)
        self._keys: dict[str, str] = {}  # key -> refusal kind
        self._retry_at: dict[str, float] = {}  # retryable keys -> when to ask again
        self._backoff: dict[str, float] = {}  # retryable keys -> the back-off that applied last

    def __contains__(self, key: object) -> bool:
        if key not in self._keys:
            return False
        at = self._retry_at.get(key)  # type: ignore[call-overload]
        if at is not None and self._clock() >= at:
            del self._keys[key]  # type: ignore[arg-type]
            del self._retry_at[key]  # type: ignore[arg-type]
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter([k for k in list(self._keys) if k in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def add(self, key: str, kind: str) -> float | None:
        """Learn ``key`` refused with ``kind``; returns the seconds until it is asked again (None:
        never, a hardware answer)."""
        self._keys[key] = kind
        if kind not in RETRY_KINDS:
            self._retry_at.pop(key, None)
            return None
        prev = self._backoff.get(key)
        backoff = self.retry_s if prev is None else min(prev * 2, self.retry_max_s)
        self._backoff[key] = backoff
        self._retry_at[key] = self._clock() + backoff
        return backoff

    def answered(self, key: str) -> None:
        """``key`` answered: a later refusal starts the back-off over."""
        if self._backoff:
            self._backoff.pop(key, None)

    def permanent(self, key: str) -> bool:
        """Learned for good (a hardware answer), as opposed to refused for now."""
        return key in self and key not in self._retry_at

    def kinds(self) -> dict[str, str]:
        """{key: refusal kind} of the keys learned now. Changes nothing, so another thread (a
        metrics scrape) may call it while the polling thread uses the context."""
        now = self._clock()
        retry_at = dict(self._retry_at)
        return {k: v for k, v in dict(self._keys).items() if retry_at.get(k, now + 1) > now}

    def clear(self) -> None:
        self._keys.clear()
        self._retry_at.clear()
        self._backoff.clear()
