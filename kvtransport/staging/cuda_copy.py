"""CUDA through the driver API (``libcuda.so.1`` with ctypes; no torch, no toolkit): the copy
engine of the staged path, and the few calls ``cuda-local`` and the GPU tests need.

With unified addressing one ``cuMemcpyAsync`` copies device to host, host to device, device
to device or between devices (peer copies). The staging pipeline's gather thread and scatter
thread each get their own non-blocking stream, so a copy-out and a copy-in run at the same
time; ``copy`` returns once its stream has drained. The ring is page-locked
(``cuMemHostRegister``) so those copies are asynchronous DMA; memory already registered (by the
engine that allocated it) is left as it is.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtransport.spi.errors import DriverUnavailable, EngineError
from kvtransport.staging.copy import Pieces, as_u64, strided_groups

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
IPC_HANDLE_BYTES = 64


#: ``CUmemorytype``: the driver tells host from device memory by the (unified) address.
CU_MEMORYTYPE_UNIFIED = 4
#: The largest row step of one 2-D copy (``CU_DEVICE_ATTRIBUTE_MAX_PITCH`` is 2**31 - 1 on every
#: GPU this serves); a larger step goes as one copy a row.
MAX_PITCH = (1 << 31) - 1


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``: ``Height`` rows of ``WidthInBytes``, ``srcPitch``/``dstPitch`` apart."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaDriver:
    """The CUDA driver API on one device's primary context (the one PyTorch uses too)."""

    def __init__(self, device: int) -> None:
        try:
            lib: Any = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DriverUnavailable(f"CUDA: libcuda.so.1 cannot be loaded ({exc})") from exc
        self.lib = lib
        u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        lib.cuMemcpyAsync.argtypes = [u64, u64, sz, vp]
        lib.cuMemcpy.argtypes = [u64, u64, sz]
        lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy2D), vp]
        lib.cuMemsetD8_v2.argtypes = [u64, ctypes.c_ubyte, sz]
        lib.cuMemHostRegister_v2.argtypes = [vp, sz, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [vp]
        lib.cuStreamSynchronize.argtypes = [vp]
        lib.cuStreamDestroy_v2.argtypes = [vp]
        lib.cuEventRecord.argtypes = [vp, vp]
        lib.cuEventQuery.argtypes = [vp]
        lib.cuEventSynchronize.argtypes = [vp]
        lib.cuEventDestroy_v2.argtypes = [vp]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuMemFree_v2.argtypes = [u64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(sz), u64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), u64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [u64]
        self.check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
        self.device = device
        self._dev = dev
        self._ctx = ctypes.c_void_p()
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev), "cuDevicePrimaryCtxRetain")
        self._released = False

    def check(self, rc: int, what: str) -> None:
        if rc != CUDA_SUCCESS:
            raise EngineError(f"CUDA {what} failed: {self.error_name(rc)}")

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        return f"{(name.value or b'?').decode()} ({rc})"

    def bind(self) -> None:
        """Make the primary context current on the calling thread."""
        self.check(self.lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    # -- streams and events --------------------------------------------------------------------

    def stream(self) -> ctypes.c_void_p:
        self.bind()
        s = ctypes.c_void_p()
        self.check(self.lib.cuStreamCreate(ctypes.byref(s), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return s

    def copy_async(self, dst: int, src: int, n: int, stream: ctypes.c_void_p) -> None:
        rc = self.lib.cuMemcpyAsync(dst, src, n, stream)
        if rc != CUDA_SUCCESS:
            self.check(rc, f"cuMemcpyAsync({n} bytes)")

    def copy_2d_async(
        self, dst: int, dst_step: int, src: int, src_step: int, n: int, rows: int, stream: ctypes.c_void_p
    ) -> None:
        """``rows`` rows of ``n`` bytes, ``src_step`` apart at the source and ``dst_step`` apart
        at the destination (host or device, either side), as one copy on ``stream``."""
        spec = _Memcpy2D(
            srcMemoryType=CU_MEMORYTYPE_UNIFIED,
            srcDevice=src,
            srcPitch=src_step,
            dstMemoryType=CU_MEMORYTYPE_UNIFIED,
            dstDevice=dst,
            dstPitch=dst_step,
            WidthInBytes=n,
            Height=rows,
        )
        rc = self.lib.cuMemcpy2DAsync_v2(ctypes.byref(spec), stream)
        if rc != CUDA_SUCCESS:
            self.check(rc, f"cuMemcpy2DAsync({rows} rows of {n} bytes)")

    def record(self, stream: ctypes.c_void_p) -> ctypes.c_void_p:
        event = ctypes.c_void_p()
        self.check(self.lib.cuEventCreate(ctypes.byref(event), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.check(self.lib.cuEventRecord(event, stream), "cuEventRecord")
        return event

    def event_done(self, event: ctypes.c_void_p) -> bool:
        """``True`` once the work before the event finished; raises if it failed."""
        rc = self.lib.cuEventQuery(event)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.check(rc, "cuEventQuery")
        return True

    def destroy_event(self, event: ctypes.c_void_p) -> None:
        self.lib.cuEventDestroy_v2(event)

    def destroy_stream(self, stream: ctypes.c_void_p) -> None:
        self.lib.cuStreamSynchronize(stream)
        self.lib.cuStreamDestroy_v2(stream)

    # -- memory --------------------------------------------------------------------------------

    def alloc(self, size: int) -> int:
        self.bind()
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), f"cuMemAlloc({size})")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self.bind()
        self.lib.cuMemFree_v2(ptr)

    def memcpy(self, dst: int, src: int, n: int) -> None:
        self.bind()
        self.check(self.lib.cuMemcpy(dst, src, n), f"cuMemcpy({n} bytes)")

    def memset(self, ptr: int, value: int, n: int) -> None:
        self.bind()
        self.check(self.lib.cuMemsetD8_v2(ptr, value, n), "cuMemsetD8")

    def pin(self, ptr: int, size: int) -> bool:
        """Page-lock host memory; ``False`` if it was registered already (not ours to undo)."""
        self.bind()
        rc = self.lib.cuMemHostRegister_v2(ptr, size, CU_MEMHOSTREGISTER_PORTABLE)
        if rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            return False
        self.check(rc, f"cuMemHostRegister({size} bytes)")
        return True

    def unpin(self, ptr: int) -> None:
        self.lib.cuMemHostUnregister(ptr)

    def allocation_of(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding ``ptr`` (IPC handles name whole allocations)."""
        self.bind()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(
            self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange"
        )
        return int(base.value), int(size.value)

    def ipc_handle(self, base: int) -> bytes:
        self.bind()
        handle = _IpcHandle()
        self.check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        return bytes(handle.reserved)

    def ipc_open(self, handle: bytes) -> int:
        self.bind()
        raw = _IpcHandle()
        raw.reserved = handle
        ptr = ctypes.c_uint64()
        self.check(
            self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            "cuIpcOpenMemHandle",
        )
        return int(ptr.value)

    def ipc_close(self, ptr: int) -> None:
        self.bind()
        self.lib.cuIpcCloseMemHandle(ptr)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.lib.cuDevicePrimaryCtxRelease(self._dev)


class CudaCopyEngine:
    """The staging pipeline's copy engine for device KV: a stream per calling thread."""

    name = "cuda"
    #: Its streams and the bound context are per thread: copies stay on the stage threads.
    any_thread = False

    def __init__(self, device: int) -> None:
        self.cuda = CudaDriver(device)
        self._local = threading.local()
        self._streams: list[ctypes.c_void_p] = []
        self._pinned: list[int] = []
        self._lock = threading.Lock()

    def _stream(self) -> ctypes.c_void_p:
        stream: ctypes.c_void_p | None = getattr(self._local, "stream", None)
        if stream is None:
            stream = self.cuda.stream()
            self._local.stream = stream
            with self._lock:
                self._streams.append(stream)
        return stream

    def pin(self, ptr: int, size: int) -> None:
        if self.cuda.pin(ptr, size):
            self._pinned.append(ptr)

    def copy(self, dst: Pieces, src: Pieces, length: Pieces) -> None:
        """Each strided group of rows (a head slice of a page's tokens, unequal TP) that lies in
        one allocation on both sides as one 2-D copy, the rest one copy each; then the stream
        is synchronised. Pieces are not merged across pieces' borders: two regions adjacent in
        the address space are still two allocations, which one CUDA copy must not span."""
        dst, src, length = as_u64(dst), as_u64(src), as_u64(length)
        stream = self._stream()
        start = 0
        for first, count in strided_groups(dst, src, length):
            d0, s0, n = int(dst[first]), int(src[first]), int(length[first])
            d_step, s_step = int(dst[first + 1]) - d0, int(src[first + 1]) - s0
            if max(d_step, s_step) > MAX_PITCH or not (
                self._one_allocation(d0, d_step * (count - 1) + n)
                and self._one_allocation(s0, s_step * (count - 1) + n)
            ):
                continue  # copied one row each with the pieces around it
            self._each(dst[start:first], src[start:first], length[start:first], stream)
            self.cuda.copy_2d_async(d0, d_step, s0, s_step, n, count, stream)
            start = first + count
        self._each(dst[start:], src[start:], length[start:], stream)
        self.cuda.check(self.cuda.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def _one_allocation(self, ptr: int, span: int) -> bool:
        """Whether ``[ptr, ptr + span)`` lies in one allocation: device memory by its address
        range; host memory (the pinned ring, one buffer) is taken as is."""
        try:
            base, size = self.cuda.allocation_of(ptr)
        except EngineError:
            return True  # not device memory: the ring, which the pipeline hands out in slots
        return base <= ptr and ptr + span <= base + size

    def _each(
        self, dst: npt.NDArray[np.uint64], src: npt.NDArray[np.uint64], length: npt.NDArray[np.uint64], stream: Any
    ) -> None:
        for d, s, n in zip(dst.tolist(), src.tolist(), length.tolist(), strict=True):
            self.cuda.copy_async(d, s, n, stream)

    def close(self) -> None:
        self.cuda.bind()
        with self._lock:
            for stream in self._streams:
                self.cuda.destroy_stream(stream)
            self._streams.clear()
        for ptr in self._pinned:
            self.cuda.unpin(ptr)
        self._pinned.clear()
        self.cuda.release()


CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_MEMORYTYPE_DEVICE = 2


def is_device_pointer(ptr: int) -> bool:
    """Whether ``ptr`` is CUDA device memory (``False`` for host memory, and without CUDA)."""
    try:
        lib: Any = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    if lib.cuInit(0) != CUDA_SUCCESS:
        return False
    kind = ctypes.c_uint()
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    rc = lib.cuPointerGetAttribute(ctypes.byref(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    return rc == CUDA_SUCCESS and kind.value == CU_MEMORYTYPE_DEVICE
