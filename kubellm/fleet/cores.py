"""Which cores a local vLLM CPU replica's OpenMP threads run on.

vLLM's CPU backend binds its OpenMP threads itself (`VLLM_CPU_OMP_THREADS_BIND=auto`): every
engine takes the same cores, all of the allowed ones but the last (kept for its scheduler).
That suits one engine per machine, as in a pod; a local fleet runs several on one machine,
and `auto` put them all on the same cores: on 2 cores both a stable replica and its canary
ran on core 0 (vLLM's log: "local_rank=0, core ids=[0]" in each) and the canary's engine
took 13 minutes to start beside the busy stable one.

So `kubellm up` gives each running vLLM replica a slot (the lowest free, fleet-wide) and
binds it to its own block of cores: with `slots` replicas on `cpus`, blocks of
max(1, (len(cpus) - 1) // slots) cores (one core left for the schedulers, as `auto` leaves
it), block k starting at core k x width, wrapping when there are more replicas than blocks.
One replica alone gets what `auto` gives it. A `VLLM_CPU_OMP_THREADS_BIND` already in the
environment is kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def omp_cores(slot: int, slots: int, cpus: Sequence[int]) -> list[int]:
    """The cores of replica `slot` of `slots` sharing `cpus` (the allowed cores, sorted)."""
    if not cpus:
        raise ValueError("no cores to bind to")
    if slot < 0 or slots < 1:
        raise ValueError(f"slot {slot} of {slots}: expected 0 <= slot and 1 <= slots")
    count = len(cpus)
    width = max(1, (count - 1) // slots) if count > 1 else 1
    start = slot * width
    return [cpus[(start + k) % count] for k in range(width)]


def omp_bind_env(
    slot: int,
    slots: int,
    cpus: Sequence[int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment a local vLLM replica in `slot` gets: its cores as vLLM's bind list
    (nothing when the environment already names one)."""
    environ = os.environ if environ is None else environ
    if environ.get(OMP_BIND_ENV):
        return {}
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    return {OMP_BIND_ENV: ",".join(str(c) for c in omp_cores(slot, slots, cpus))}


def free_slot(taken: Iterable[int]) -> int:
    """The lowest slot not in `taken`."""
    used = set(taken)
    return next(s for s in range(len(used) + 1) if s not in used)
