"""CPU threads for the runners, chosen on purpose rather than left to each library.

NumPy's BLAS and torch each start a thread per logical CPU by default. On a machine shared
with other work, or one with hyper-threads, those threads wait on each other and a step can
take ten times longer than with one thread. The rule here:

1. ``--threads N`` on the command line;
2. else ``OMP_NUM_THREADS`` if the user set it;
3. else the physical cores this process may run on, at most ``DEFAULT_CAP``.

``use(n)`` applies it to every BLAS / OpenMP pool loaded so far (through threadpoolctl) and
to torch's intra-op pool if torch is imported; it never imports torch itself. It also exports
the count as OMP_NUM_THREADS, which libraries loaded later (torch imported afterwards) and
processes started from here (tensor-parallel ranks, subprocesses in tests) start from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_CAP = 8  # the models here are small: more threads mostly wait on each other
ENV = "OMP_NUM_THREADS"


def usable_cpus() -> set[int]:
    """Logical CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


SYSFS_CPUS = Path("/sys/devices/system/cpu")


def physical_cores(cpus: set[int] | None = None, sysfs: Path = SYSFS_CPUS) -> int:
    """Physical cores among ``cpus`` (hyper-thread siblings count once), where Linux tells."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        siblings = sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            return len(cpus)  # topology unknown: count logical CPUs
    return max(1, len(cores))


def default_threads() -> int:
    """OMP_NUM_THREADS if set to a whole number >= 1, else physical cores capped at DEFAULT_CAP."""
    value = os.environ.get(ENV, "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value)
    return min(physical_cores(), DEFAULT_CAP)


def use(threads: int | None = None) -> int:
    """Set torch's (if imported) and every loaded BLAS / OpenMP pool's threads; returns the count."""
    import numpy  # noqa: F401  (loads the BLAS that threadpoolctl is to limit)
    from threadpoolctl import threadpool_limits

    count = threads or default_threads()
    os.environ[ENV] = str(count)
    threadpool_limits(limits=count)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(count)
    return count


def report() -> dict[str, Any]:
    """The thread counts in force, read back from the libraries: for tables and JSON."""
    from threadpoolctl import threadpool_info

    blas = sorted({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"})
    torch = sys.modules.get("torch")
    return {"blas": blas[0] if len(blas) == 1 else blas,
            "torch": torch.get_num_threads() if torch is not None else None}


def describe(counts: dict[str, Any] | None = None) -> str:
    """One line for a table header, e.g. 'threads: BLAS 4, torch 4'."""
    counts = report() if counts is None else counts
    parts = [f"BLAS {counts['blas']}"]
    if counts["torch"] is not None:
        parts.append(f"torch {counts['torch']}")
    return "threads: " + ", ".join(parts)
