"""CUDA C++ kernels without a build step: NVRTC compiles the source to an sm_90a cubin at first use
(also on a machine without a GPU, which is how CI checks that it compiles), the driver API loads and
launches it, and builds the Tensor Memory Accelerator's tensor maps. Both libraries are reached
through ctypes, so nothing depends on the version of a binding package or of torch's C++ ABI."""

import ctypes
import glob
import os
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from functools import lru_cache
from typing import Dict, Sequence, Tuple

import torch

SM90_ARCH = "sm_90a"  # wgmma and setmaxnreg exist only in the sm_90a target
SOURCES = os.path.join(os.path.dirname(__file__), "sm90")  # the kernels and the header they share


def _find_library(patterns: Sequence[str]) -> str:
    """The first file matching one of `patterns` in the CUDA libraries pip installs next to torch, in
    torch's own folder or in CUDA_HOME."""
    folders = []
    for entry in sys.path:
        folders += glob.glob(os.path.join(entry, "nvidia", "*", "lib")) + [os.path.join(entry, "torch", "lib")]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    folders += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]
    for folder in folders:
        for pattern in patterns:
            found = sorted(glob.glob(os.path.join(folder, pattern)))
            if found:
                return found[-1]
    raise RuntimeError(f"no CUDA library matching {list(patterns)} in {folders}: install torch's CUDA build "
                       "(it brings NVRTC) or set CUDA_HOME, or run the grouped GEMMs' Triton kernels "
                       "(GemmBackend.TRITON; ExpertGemms.GROUPED_TRITON for the experts)")


@lru_cache(maxsize=None)
def _nvrtc() -> ctypes.CDLL:
    lib = ctypes.CDLL(_find_library(["libnvrtc.so.1[0-9]", "libnvrtc.so.1[0-9].*", "libnvrtc.so"]))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check_nvrtc(result: int, what: str) -> None:
    if result:
        raise RuntimeError(f"NVRTC {what} failed: {_nvrtc().nvrtcGetErrorString(result).decode()}")


@lru_cache(maxsize=None)
def compile_cubin(source_path: str, defines: Tuple[Tuple[str, int], ...] = ()) -> Tuple[bytes, str]:
    """(cubin, ptxas's report) of a CUDA source file for sm_90a, its includes found in SOURCES; a compile
    error raises with NVRTC's log."""
    with open(source_path) as f:
        source = f.read()
    lib = _nvrtc()
    program = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), os.path.basename(source_path).encode(),
                                        0, None, None), "create")
    try:
        options = [f"--gpu-architecture={SM90_ARCH}", "-std=c++17", "--ptxas-options=-v", f"--include-path={SOURCES}"] + [
            f"-D{name}={value}" for name, value in defines]
        option_array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        compiled = lib.nvrtcCompileProgram(program, len(options), option_array)
        log_size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetProgramLogSize(program, ctypes.byref(log_size)), "log size")
        log = ctypes.create_string_buffer(log_size.value)
        _check_nvrtc(lib.nvrtcGetProgramLog(program, log), "log")
        if compiled:
            raise RuntimeError(f"NVRTC could not compile {source_path} for {SM90_ARCH} with {defines}:\n"
                               f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(program, cubin), "cubin")
        return cubin.raw, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise RuntimeError(f"the CUDA driver (libcuda.so.1) is not loadable: {error}") from None
    return lib


def _check_driver(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"CUDA driver call {what} failed: {name.value.decode() if name.value else result}")


# CUfunction_attribute: the dynamic shared memory a launch may ask for.
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# CUtensorMap enums: the element types by size in bytes (the copies move bits, whatever they encode).
_TENSOR_MAP_TYPES = {1: 0, 2: 1, 4: 2}
_SWIZZLE_NONE, _SWIZZLE_128B = 0, 3
_L2_PROMOTION_256B = 3


@lru_cache(maxsize=None)
def _primary_context(index: int) -> int:
    """The primary context of CUDA device `index`: the one torch's runtime uses."""
    lib = _driver()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check_driver(lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    _check_driver(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context.value


@contextmanager
def _current_context(index: int):
    """Device `index`'s primary context current on this thread for the driver calls inside, the previous
    one put back after. A thread can have none, or another device's: torch's device guard does not bind
    a context where the device already matches, and autograd's device threads start with none."""
    lib = _driver()
    previous = ctypes.c_void_p()
    _check_driver(lib.cuCtxGetCurrent(ctypes.byref(previous)), "cuCtxGetCurrent")
    wanted = _primary_context(index)
    if previous.value == wanted:
        yield
        return
    _check_driver(lib.cuCtxSetCurrent(ctypes.c_void_p(wanted)), "cuCtxSetCurrent")
    try:
        yield
    finally:
        if previous.value:
            lib.cuCtxSetCurrent(previous)


class CudaKernel:
    """One kernel of a compiled cubin, loaded into each device's primary context at its first launch
    there."""

    def __init__(self, cubin: bytes, name: str, shared_bytes: int):
        self.cubin, self.name, self.shared_bytes = cubin, name, shared_bytes
        self._functions: Dict[int, ctypes.c_void_p] = {}

    def _function(self, index: int) -> ctypes.c_void_p:
        """The kernel in device `index`'s context (the caller has made it current)."""
        function = self._functions.get(index)
        if function is None:
            lib = _driver()
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check_driver(lib.cuModuleLoadData(ctypes.byref(module), self.cubin), "cuModuleLoadData")
            _check_driver(lib.cuModuleGetFunction(ctypes.byref(function), module, self.name.encode()),
                          f"cuModuleGetFunction({self.name})")
            _check_driver(lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, self.shared_bytes),
                          "cuFuncSetAttribute")
            self._functions[index] = function
        return function

    def launch(self, device: torch.device, grid: int, threads: int, args: Sequence[ctypes._SimpleCData]) -> None:
        """Launch on the current stream of `device`; args are ctypes values in the kernel's order (a
        tensor map is passed as its 128 bytes)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream(index).cuda_stream)
        with _current_context(index):
            _check_driver(_driver().cuLaunchKernel(self._function(index), grid, 1, 1, threads, 1, 1,
                                                   self.shared_bytes, stream, pointers, None),
                          f"cuLaunchKernel({self.name})")


class TensorMap(ctypes.Structure):
    """A CUtensorMap: 128 opaque bytes (encoded where the driver wants them, 64-byte aligned, then copied)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_ELEMENT_STRIDES = (ctypes.c_uint32 * 2)(1, 1)
# A tensor map depends only on the matrix's address, shape and element size and the box: encoded maps
# are kept by those (a model's weights keep their addresses; activations often return to the same
# ones), so most launches skip the encoding. Bounded.
_tile_maps: "OrderedDict[tuple, TensorMap]" = OrderedDict()
_MAX_TILE_MAPS = 512
_tile_maps_lock = threading.Lock()  # several threads may launch (one per GPU)


def tile_map(matrix: torch.Tensor, box_rows: int, box_cols: int, swizzled: bool = True) -> TensorMap:
    """A tensor map of a 2-D matrix (rows `stride(0)` elements apart) copied in [box_rows, box_cols]
    boxes; out-of-bounds reads are zeros, writes dropped. swizzled: boxes of 128-byte rows in the
    128-byte swizzle (the wgmma operand layout); else rows of whole 16 bytes, as in memory."""
    rows, cols = matrix.shape
    size = matrix.element_size()
    address = matrix.data_ptr()
    row_bytes = matrix.stride(0) * size
    if (size not in _TENSOR_MAP_TYPES or matrix.stride(1) != 1 or address % 16 or row_bytes % 16
            or (cols * size) % 16 or row_bytes < cols * size):
        raise ValueError(f"tile_map: needs a 2-D matrix of 1, 2 or 4-byte elements, 16-byte aligned with rows of "
                         f"whole 16 bytes, got {matrix.dtype} {tuple(matrix.shape)} with strides {matrix.stride()} "
                         f"at {address:#x}")
    if swizzled and box_cols * size != 128:
        raise ValueError(f"tile_map: 128-byte swizzled boxes have rows of 128 bytes, got {box_cols} x {size} bytes")
    if (box_cols * size) % 16 or not 0 < box_rows <= 256 or not 0 < box_cols <= 256:
        raise ValueError(f"tile_map: boxes of at most 256 x 256 with rows of whole 16 bytes, got {box_rows} x "
                         f"{box_cols} of {size} bytes")
    swizzle = _SWIZZLE_128B if swizzled else _SWIZZLE_NONE
    # Everything the encoding below reads.
    key = (address, rows, cols, row_bytes, size, box_rows, box_cols, swizzle, _L2_PROMOTION_256B)
    with _tile_maps_lock:
        found = _tile_maps.get(key)
        if found is not None:
            _tile_maps.move_to_end(key)
            return found
    buffer = ctypes.create_string_buffer(ctypes.sizeof(TensorMap) + 64)
    aligned = (ctypes.addressof(buffer) + 63) // 64 * 64
    dims = (ctypes.c_uint64 * 2)(cols, rows)  # innermost first
    strides = (ctypes.c_uint64 * 1)(row_bytes)  # bytes between rows (the innermost stride is implied)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    _check_driver(_driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(aligned), _TENSOR_MAP_TYPES[size], 2, ctypes.c_void_p(address), dims, strides, box,
        _ELEMENT_STRIDES, 0, swizzle, _L2_PROMOTION_256B, 0), "cuTensorMapEncodeTiled")
    encoded = TensorMap()
    ctypes.memmove(ctypes.addressof(encoded), aligned, ctypes.sizeof(TensorMap))
    with _tile_maps_lock:
        _tile_maps[key] = encoded
        if len(_tile_maps) > _MAX_TILE_MAPS:
            _tile_maps.popitem(last=False)
    return encoded
