"""The zero-copy view of pinned host memory from a CUDA device (unified virtual addressing).

Pinned memory from ``cudaHostAlloc`` (torch's ``pin_memory``) is mapped into every device's
address space; the CUDA driver's ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``
gives that address (:func:`device_pointer`). :func:`uva_view` wraps it in a DLPack capsule (the
array interchange standard) describing the pinned pages as CUDA memory, so torch kernels on the
GPU read and write the host memory in place over PCIe.
"""

from __future__ import annotations

import ctypes

import torch


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DLDeleter)]
#: DLPack's device type of CUDA memory and type code of unsigned ints
_DL_KCUDA, _DL_UINT = 2, 1
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
#: address of a live capsule's struct -> (struct, shape array, pinned tensor it aliases)
_UVA_LIVE: dict[int, tuple] = {}


@_DLDeleter
def _uva_release(managed) -> None:  # called by torch (GIL held) when the view's storage dies
    _UVA_LIVE.pop(ctypes.addressof(managed.contents), None)


def device_pointer(pinned: torch.Tensor, device: torch.device) -> int | None:
    """The address (an int) at which kernels on the CUDA ``device`` reach the first byte of
    the pinned host tensor ``pinned`` (``cuPointerGetAttribute``), or ``None`` where there is
    none (not pinned, ROCm, no CUDA driver library)."""
    if torch.version.hip is not None or not pinned.is_pinned():
        return None
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        get_attr = libcuda.cuPointerGetAttribute
    except (OSError, AttributeError):
        return None
    get_attr.restype = ctypes.c_int
    get_attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    dev_ptr = ctypes.c_uint64(0)
    with torch.cuda.device(device):
        rc = get_attr(ctypes.byref(dev_ptr), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER, pinned.data_ptr())
    return dev_ptr.value if rc == 0 and dev_ptr.value else None


def uva_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` aliasing the contiguous pinned host tensor ``pinned`` (same
    shape and dtype): kernels read and write it over PCIe, no copy engine, no host work.

    The view keeps ``pinned`` alive. Returns ``None`` where this is not available (no CUDA
    driver library, ROCm, memory the driver does not know as pinned).
    """
    if not pinned.is_contiguous():
        return None
    dev_ptr = device_pointer(pinned, device)
    if dev_ptr is None:
        return None
    shape = (ctypes.c_int64 * 1)(pinned.numel() * pinned.element_size())
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(dev_ptr, _DLDevice(_DL_KCUDA, device.index), 1,
                                  _DLDataType(_DL_UINT, 8, 1), shape, None, 0)
    managed.deleter = _uva_release
    _UVA_LIVE[ctypes.addressof(managed)] = (managed, shape, pinned)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    raw = torch.from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))
    return raw.view(pinned.dtype).view(pinned.shape)
