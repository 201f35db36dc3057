"""Devices and threads: the device a run uses, the CPU threads it takes, memory it may use, flush-to-zero for
subnormal floats, and the C allocator's reuse of freed memory."""

from __future__ import annotations

import contextlib
import os
import re

from fedhead.infra.errors import FedheadError


def resolve_device(device: str):
    """``auto`` picks CUDA when available; ``cuda`` without a GPU, or ``cuda:N`` beyond the GPUs there are, is a
    one-line error."""
    import torch

    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise FedheadError(f"The '--device' parameter must be one of 'auto', 'cpu', 'cuda'. Got {device!r} instead.")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FedheadError(f"The '--device' parameter is {device!r} but no CUDA device is available. Use --device cpu.")
    if device.startswith("cuda:"):
        index, count = device[5:], torch.cuda.device_count()
        if not index.isdigit() or int(index) >= count:
            raise FedheadError(
                f"The '--device' parameter is {device!r} but this machine has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}). Use one of them, or --device cuda."
            )
    return torch.device(device)


def transfers(device) -> tuple[bool, bool]:
    """``(pinned, channels_last)`` for feeding images to an encoder on ``device``: page-locked host batches copied
    without blocking, and convolutions in NHWC memory, on CUDA only (on CPU, pinning needs an accelerator and
    channels-last convolutions were measured no faster for the extraction's batch sizes)."""
    cuda = getattr(device, "type", str(device)) == "cuda"
    return cuda, cuda


def mixed_precision(device):
    """The autocast dtype of the scratch engine's forward on ``device``, or None for float32.

    CUDA: bfloat16 where the GPU has it. Not float16 on older GPUs: without loss scaling, small gradients underflow
    to zero in float16 (a model then stops learning without an error), and the engine's stacked optimizer has no
    scaler, so those GPUs train in float32. CPU: float32 (autocast there would only add casts)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def autocast(device, dtype=None):
    """An autocast context on ``device`` in ``dtype`` (e.g. :func:`mixed_precision`'s); None: a disabled context."""
    import torch

    kind = getattr(device, "type", str(device))
    if dtype is None:
        return torch.autocast(kind, enabled=False)
    return torch.autocast(kind, dtype=dtype)


DENORMALS_ENV = "FEDHEAD_DENORMALS"  # "keep": leave subnormal arithmetic on (bench speed's comparison)
_FLUSH_STATE: dict = {}  # (thread, torch.get_num_threads()) -> whether every intra-op thread flushes


def _pool_flushes() -> bool:
    """Whether every intra-op thread flushes a subnormal result to zero, probed by values: normal numbers whose
    product is subnormal, in a tensor large enough to reach every thread, must multiply to exact zeros. (The
    result is read as integers: a float comparison would itself treat a subnormal as zero on a flushing thread.)"""
    import torch

    n = 65536 * max(1, torch.get_num_threads()) * 2
    x = torch.full((n,), 1e-30, dtype=torch.float32)
    return not bool(torch.mul(x, 1e-9).view(torch.int32).ne(0).any())


def _flush_omp_threads() -> None:
    """Set flush-to-zero on every thread of torch's OpenMP pool: a parallel region of libgomp (the runtime torch
    loaded) in which each thread sets its own floating-point control word. Threads started later copy the
    control word of the thread that starts them, so one call covers the pool as it grows."""
    import ctypes

    import torch

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and line.rstrip().endswith((".so", ".1"))}
    except OSError:
        return
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        callback = callback_type(lambda _: torch.set_flush_denormal(True))
        lib.GOMP_parallel.argtypes = [callback_type, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
        lib.GOMP_parallel(callback, None, 0, 0)


def flush_denormals() -> bool:
    """Flush subnormal floats to zero on this thread and on torch's intra-op threads (x86: FTZ and DAZ).

    A decaying optimizer state (squares of tiny gradients, momentum of classes a client never sees) falls into
    the subnormal range, which x86 CPUs compute about ten times slower: measured at paper scale, 2.9 s a round
    instead of 0.68 s. Flushed, such a number is 0, which a head's training cannot tell from it (an AdamW step
    divides by sqrt(v) + 1e-8; 1e-38 is far below both). The engines call this before they train; the setting
    stays for the process (as TensorFlow sets it on its own threads). Returns whether every thread flushes (False
    where the CPU has no such mode, or with ``FEDHEAD_DENORMALS=keep``, which leaves subnormals on for
    ``fedhead bench speed``'s comparison)."""
    import torch

    if os.environ.get(DENORMALS_ENV, "") == "keep":
        return False
    import threading

    key = (threading.get_ident(), torch.get_num_threads())  # each thread starts its own OpenMP pool
    if _FLUSH_STATE.get(key):
        return True
    if not torch.set_flush_denormal(True):
        _FLUSH_STATE[key] = False
        return False
    ok = _pool_flushes()
    if not ok:  # the pool started before this thread flushed: set it in each of its threads
        with contextlib.suppress(OSError, AttributeError):
            _flush_omp_threads()
        ok = _pool_flushes()
    _FLUSH_STATE[key] = ok
    return ok


ALLOCATOR_ENV = "FEDHEAD_MALLOC"  # "default": leave glibc's policy as it is (bench speed's comparison)
_KEEP_FREED: list[bool] = []


def keep_freed_memory() -> bool:
    """Let glibc's malloc serve large tensors from its heap and keep freed memory for the next one.

    By default glibc maps every block over 32 MB afresh from the kernel and unmaps it when freed, so a loop that
    allocates its step's tensors (a tile's logits, gradients, gathered rows: tens to hundreds of MB) pays page
    faults that zero each page on every step. Measured at 10,000 clients x 1,203 classes on 2 cores: 16 s of a
    38 s process in the kernel, and a softmax round of 11.1 s that takes 8.3 s with this set (the process's peak
    memory is its largest working set either way; what is freed is reused instead of returned). Sets
    ``M_MMAP_THRESHOLD`` to 2 GiB and ``M_TRIM_THRESHOLD`` to its maximum, once per process; a no-op (False)
    off glibc or with ``FEDHEAD_MALLOC=default``. The engines call it with :func:`flush_denormals`."""
    if _KEEP_FREED:
        return _KEEP_FREED[0]
    ok = False
    if os.environ.get(ALLOCATOR_ENV, "") != "default":
        import ctypes
        import platform

        if platform.libc_ver()[0] == "glibc":
            with contextlib.suppress(OSError, AttributeError):
                mallopt = ctypes.CDLL(None).mallopt
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
                ok = bool(mallopt(m_mmap_threshold, 2**31 - 1)) and bool(mallopt(m_trim_threshold, 2**31 - 1))
    _KEEP_FREED.append(ok)
    return ok


def busy_cores(window: float = 0.1) -> float:
    """Cores that other processes keep busy right now: ``/proc/stat`` sampled ``window`` seconds apart (this
    process sleeps meanwhile), else the 1-minute load average. The load average alone lags by a minute, so
    a job started right after another one of ours took the finished job's core as busy."""
    import time

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]), v[3] + v[4]  # total and idle+iowait jiffies (user..steal)

    try:
        t0, i0 = sample()
        time.sleep(window)
        t1, i1 = sample()
        if t1 > t0:
            return (os.cpu_count() or 1) * (1.0 - (i1 - i0) / (t1 - t0))
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (``MemAvailable`` on Linux; free pages elsewhere), or None when
    the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def size_text(n: int) -> str:
    """A byte count as people read it: ``12.3 MB`` (``850 kB`` below a megabyte)."""
    return f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n / 1e3:,.0f} kB"


BUDGET_ENV = "FEDHEAD_MEMORY_BUDGET"
FALLBACK_BUDGET = 8 << 30  # where the system does not say how much memory it can give
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_budget() -> tuple[int, str]:
    """Bytes a reader may allocate for a file's arrays and where that figure comes from: ``FEDHEAD_MEMORY_BUDGET``
    (bytes, or with a K/M/G/T suffix), else the memory the system can still give, else 8 GiB."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if text:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", text, re.IGNORECASE)
        if m is None or float(m.group(1)) <= 0:
            raise FedheadError(
                f"The {BUDGET_ENV} environment variable must be a size in bytes, e.g. 8G or 512M. Got {text!r} "
                f"instead. Set it so, or unset it to use the available memory."
            )
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()]), f"{BUDGET_ENV}={text}"
    free = available_memory()
    if free is None:
        return FALLBACK_BUDGET, f"the default {size_text(FALLBACK_BUDGET)} (the system does not say what is free)"
    return free, f"the {size_text(free)} of memory available"


def check_budget(need: int, what: str, fix: str = "") -> None:
    """Refuse, before allocating, ``need`` bytes above :func:`memory_budget` (``what`` names the file and why)."""
    budget, source = memory_budget()
    if need > budget:
        raise FedheadError(
            f"{what} needs about {size_text(need)} of memory, more than {source}. {fix}If the file is trusted and the "
            f"memory is there, raise {BUDGET_ENV} (e.g. {BUDGET_ENV}={-(-need // (1 << 30)) + 1}G)."
        )


def set_cpu_threads(n: int | None = None) -> int:
    """Intra-op threads on CPU: ``n``, else ``FEDHEAD_THREADS`` if set, else the cores not already busy.

    OpenMP threads that must share cores with other busy processes wait on each other: measured here, a
    round took 2-4x longer with 2 threads than with 1 when the 2 cores were already loaded. So the default
    leaves out the cores that other processes use now (:func:`busy_cores`; at least one thread)."""
    import torch

    if n is None:
        n = int(os.environ.get("FEDHEAD_THREADS", "0"))
    if not n:
        cores = os.cpu_count() or 1
        n = max(1, cores - int(busy_cores() + 0.5))
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()
