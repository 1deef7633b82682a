"""Calls into the CUDA runtime that torch loaded, for what torch does not expose or
exposes at a cost: a strided (2-D) host-to-device copy, a plain one from raw addresses
(torch's ``copy_`` spends tens of microseconds of Python on each), and resetting CUDA's
last error after a failed call of ours. Used by ``client.memory.device_pages``' CUDA copier only, on a GPU.

The runtime is the one already mapped into this process (``/proc/self/maps``), so its
streams and contexts are torch's."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger(__name__)
_HOST_TO_DEVICE = 1  # cudaMemcpyKind (driver_types.h)


def loaded_cudart() -> list[ctypes.CDLL]:
    """The CUDA runtime libraries mapped into this process (torch's), else one the
    loader finds by name (a torch linked with the runtime statically); none without."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        paths = []
    libs = []
    for path in paths or ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            libs.append(ctypes.CDLL(path))
        except OSError as exc:
            log.debug("could not open %s: %s", path, exc)
    return libs


class Memcpy2D:
    """``cudaMemcpy2DAsync`` host to device: ``height`` rows of ``width`` bytes, a row
    every ``spitch`` bytes from ``src`` (host memory, registered for DMA) and every
    ``dpitch`` bytes into ``dst`` (device memory), queued on ``stream`` (a
    ``cudaStream_t`` as an int). One call lands one layer of a run of pages that lie back
    to back (``client.memory.layer_feed``). ``copy``: ``cudaMemcpyAsync`` of ``nbytes``
    from ``src`` to ``dst``, the same way. Raises ``OSError`` when no runtime is loaded."""

    def __init__(self) -> None:
        libs = loaded_cudart()
        if not libs:
            raise OSError("no CUDA runtime is loaded in this process")
        self._lib = libs[0]
        fn = self._lib.cudaMemcpy2DAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        fn.argtypes += [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn = fn
        one = self._lib.cudaMemcpyAsync
        one.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        one.argtypes += [ctypes.c_void_p]
        one.restype = ctypes.c_int
        self._one = one

    def __call__(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
    ) -> None:
        err = self._fn(dst, dpitch, src, spitch, width, height, _HOST_TO_DEVICE, stream)
        self._check(err, "cudaMemcpy2DAsync")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._one(dst, src, nbytes, _HOST_TO_DEVICE, stream), "cudaMemcpyAsync")

    def _check(self, err: int, call: str) -> None:
        if err:
            self._lib.cudaGetLastError()  # else torch's next launch check raises it
            raise RuntimeError(f"{call} failed with CUDA error {err}")


def clear_last_error(cudart: Any) -> None:
    """Reset CUDA's last error after a failed runtime call of ours: torch checks it after
    its own kernel launches and would raise ours there. torch's cudart module may lack
    the call; then the loaded libcudart is asked directly."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        get()
        return
    for lib in loaded_cudart():
        lib.cudaGetLastError()
