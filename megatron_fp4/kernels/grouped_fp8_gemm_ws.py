"""The forward / data-gradient grouped FP8 GEMM as a warp-specialized Gluon kernel (Hopper only).

The same sums as `grouped_fp8_gemm._grouped_gemm_rows_kernel` with two row halves, in the same order,
so the same bits: every 128-wide K step's tensor-core product times its row scale times its weight
block's scale, added to an fp32 accumulator. What differs is who does what:

- one producer warp issues the TMA copies of each K step's two 64-row A tiles and its 128 x 128
  weight tile into a ring of shared-memory stages, and waits for a stage to be released before
  refilling it;
- two consumer warpgroups each own one 64-row half: wait for a stage, start the product, wait for
  it, release the stage, and scale it into their accumulator. Each copies its rows' scales four K
  steps ahead into shared memory (cp.async), so no step waits for a load from L2.

The consumers synchronise only through the stage barriers, so one scales its product while the
other's is on the tensor cores. (Overlapping the scaling with the same warpgroup's next product is
not possible: ptxas serialises every wgmma of a kernel that reads a product while a later one is in
flight, "C7514".) The kernel is persistent, one program per SM, so that a tile's store overlaps the
next tile's loads. Gluon has no interpreter: CPU runs compile it for sm_90 (sm90_build) and the GPU
tests compare its bits with the Triton kernel's.

Not the default: on H200 it ran at 0.80x-0.96x of the Triton kernel's rate by GEMM and made the MoE
layer 1.5% slower (commit 044947b; docs/kernels.md, "Grouped FP8 GEMMs"; bench_grouped_gemm sweeps it
every run).
"""

from typing import List

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..formats import FP8_BLOCK
from ..tensors import padded_scale_columns
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec
from ._bits import store_rounded
from ._tile_order import swizzled, tile_of_expert

# Registers per thread of the worker partitions: the second consumer warpgroup holds a 64 x 128
# fp32 accumulator and a product (128 registers) plus addresses; the producer warp only addresses.
CONSUMER_REGISTERS = gl.constexpr(232)
PRODUCER_REGISTERS = gl.constexpr(40)
HALF_ROWS = 64  # a warpgroup's product is 64 rows
SCALE_STAGES = gl.constexpr(4)  # K steps whose scales are copied ahead of their use
# A barrier of the calling partition's warps (Triton 3.7 renamed thread_barrier to barrier).
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _tile(tile, offsets_ptr, num_experts, num_tiles_m, N: gl.constexpr, EXPERTS_POW2: gl.constexpr,
          GROUP_M: gl.constexpr, WARPS: gl.constexpr):
    """(expert, first row, end row, column tile) of output tile `tile` in the Triton kernel's order;
    expert == num_experts for a spare tile. Every partition derives it itself (WARPS: its warps)."""
    tile_m, tile_n = swizzled(tile, num_tiles_m, N // 128, GROUP_M)
    expert_ids = gl.arange(0, EXPERTS_POW2, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    expert, first_row, end_row = tile_of_expert(offsets_ptr, num_experts, tile_m, expert_ids, 128)
    return expert, first_row, end_row, tile_n


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, released, offsets_ptr, num_experts, num_tiles_m,
              N: gl.constexpr, K: gl.constexpr, EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    """For each of the program's tiles and K steps, in order: fill the next stage of the ring with
    the step's two A tiles and its weight tile once both consumers have released it."""
    HALF: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    step = 0  # K steps loaded so far, over all tiles: the ring position
    for tile in range(gl.program_id(0), num_tiles_m * (N // 128), gl.num_programs(0)):
        expert, first_row, end_row, tile_n = _tile(tile, offsets_ptr, num_experts, num_tiles_m, N, EXPERTS_POW2,
                                                   GROUP_M, 1)
        if expert < num_experts:
            row = first_row.to(gl.int32)
            b_row = (expert * N + tile_n * 128).to(gl.int32)
            for k_block in range(K // BLOCK_K):
                stage = step % STAGES
                # Parity of the stage's previous release; the first pass through the ring waits for none.
                mbarrier.wait(released.index(stage), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                k0 = k_block * BLOCK_K
                tma.async_copy_global_to_shared(a_desc, [row, k0], bar, a_bufs.index(2 * stage))
                tma.async_copy_global_to_shared(a_desc, [row + HALF, k0], bar, a_bufs.index(2 * stage + 1))
                tma.async_copy_global_to_shared(b_desc, [b_row, k0], bar, b_bufs.index(stage))
                step += 1


@gluon.jit
def _fetch_scales(row_scale_slots, block_scale_slots, slot, a_scale_ptrs, b_scale_ptrs, k_block, num_rows,
                  NUM_K: gl.constexpr):
    """Start copying K step k_block's row scales and weight block scale (the latter once per row)
    into the slot's shared memory, as one commit group (empty past the last step)."""
    if k_block < NUM_K:
        async_copy.async_copy_global_to_shared(row_scale_slots.index(slot), a_scale_ptrs + k_block * num_rows)
        async_copy.async_copy_global_to_shared(block_scale_slots.index(slot), b_scale_ptrs + k_block)
    async_copy.commit_group()


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, released, row_scale_slots, block_scale_slots, a_scales_ptr, b_scales_ptr,
              offsets_ptr, c_ptr, num_rows,
              num_experts, num_tiles_m, HALF_INDEX: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
              B_SCALE_STRIDE: gl.constexpr, EXPERTS_POW2: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, OUT_BF16: gl.constexpr):
    """One warpgroup's 64-row half of each of the program's tiles: the promoted sum over K, then
    its store (while the producer already loads the next tile). row_scale_slots / block_scale_slots:
    this warpgroup's [SCALE_STAGES, 64] rings of scales."""
    HALF: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    NUM_K: gl.constexpr = K // BLOCK_N
    products: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    per_row: gl.constexpr = gl.SliceLayout(1, products)
    step = 0  # K steps consumed so far, over all tiles: the ring position
    for tile in range(gl.program_id(0), num_tiles_m * (N // BLOCK_N), gl.num_programs(0)):
        expert, first_row, end_row, tile_n = _tile(tile, offsets_ptr, num_experts, num_tiles_m, N, EXPERTS_POW2,
                                                   GROUP_M, 4)
        if expert < num_experts:
            rows = first_row + HALF_INDEX * HALF + gl.arange(0, HALF, layout=per_row)
            # Rows past the expert's end are computed and not stored (as in the Triton kernel);
            # past M the scales are read from the last row and TMA reads zeros.
            a_scale_ptrs = a_scales_ptr + gl.minimum(rows, num_rows - 1).to(gl.int64)
            b_scale_ptr = b_scales_ptr + (expert.to(gl.int64) * (N // BLOCK_N) + tile_n) * B_SCALE_STRIDE
            b_scale_ptrs = b_scale_ptr + gl.zeros([HALF], gl.int64, per_row)
            acc = gl.zeros([HALF, BLOCK_N], gl.float32, products)
            # Each step's scales are new cache lines, whose latency from L2 is longer than a step's
            # products: they are copied SCALE_STAGES steps ahead into a ring of shared memory.
            for k_block in gl.static_range(SCALE_STAGES):
                _fetch_scales(row_scale_slots, block_scale_slots, k_block, a_scale_ptrs, b_scale_ptrs, k_block,
                              num_rows, NUM_K)
            for k_block in range(NUM_K):
                stage = step % STAGES
                slot = k_block % SCALE_STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                product = warpgroup_mma(a_bufs.index(2 * stage + HALF_INDEX), b_bufs.index(stage).permute((1, 0)),
                                        gl.zeros([HALF, BLOCK_N], gl.float32, products), use_acc=False, is_async=True)
                async_copy.wait_group(SCALE_STAGES - 1)  # this step's copies are the oldest group
                _partition_barrier()  # (a row's scale may be copied by another thread of the warpgroup)
                scale = row_scale_slots.index(slot).load(per_row) * block_scale_slots.index(slot).load(per_row)
                product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
                mbarrier.arrive(released.index(stage), count=1)
                acc = acc + product * scale[:, None]
                # Every thread has read the slot before it is refilled, in this tile or the next.
                _partition_barrier()
                if NUM_K > SCALE_STAGES:
                    _fetch_scales(row_scale_slots, block_scale_slots, slot, a_scale_ptrs, b_scale_ptrs,
                                  k_block + SCALE_STAGES, num_rows, NUM_K)
                else:
                    # Every step's scales were copied before the loop; the empty group keeps the
                    # wait above counting one group per step. (Triton 3.6 fails to compile the
                    # refill in a loop of one step.)
                    async_copy.commit_group()
                step += 1
            cols = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, products))
            out = c_ptr + rows[:, None].to(gl.int64) * N + cols[None, :]
            store_rounded(out, acc, (rows < end_row)[:, None], OUT_BF16)


@gluon.jit
def _grouped_gemm_rows_ws_kernel(
    a_desc,  # fp8 [M, K]: descriptor of 64 x 128 tiles
    a_scales_ptr,  # fp32 [K / 128, M]
    b_desc,  # fp8 [E * N, K] (the experts' [N, K] stacked): descriptor of 128 x 128 tiles
    b_scales_ptr,  # fp32 [E, N / 128, B_SCALE_STRIDE]
    offsets_ptr,  # int64 [E + 1]
    c_ptr,  # [M, N] of the output dtype (BF16 as int16: store_rounded)
    num_rows,
    num_experts,
    num_tiles_m,  # an upper bound: ceil(M / 128) + E
    N: gl.constexpr,
    K: gl.constexpr,
    B_SCALE_STRIDE: gl.constexpr,
    EXPERTS_POW2: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    OUT_BF16: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Persistent: program p takes tiles p, p + P, p + 2P, ... (P programs, one per SM), so that a
    tile's store overlaps the next tile's loads and the ring's barriers are set up once."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    released = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Each consumer's rings of scales.
    scale_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a slot's layout
    scale_ring: gl.constexpr = [SCALE_STAGES, a_desc.block_type.shape[0]]
    row_scales_top = gl.allocate_shared_memory(gl.float32, scale_ring, scale_layout)
    block_scales_top = gl.allocate_shared_memory(gl.float32, scale_ring, scale_layout)
    row_scales_bottom = gl.allocate_shared_memory(gl.float32, scale_ring, scale_layout)
    block_scales_bottom = gl.allocate_shared_memory(gl.float32, scale_ring, scale_layout)
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(released.index(stage), count=2)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, released, row_scales_top, block_scales_top,
                     a_scales_ptr, b_scales_ptr, offsets_ptr, c_ptr, num_rows, num_experts, num_tiles_m, 0, N, K,
                     B_SCALE_STRIDE, EXPERTS_POW2, GROUP_M, STAGES, OUT_BF16)),
        (_consumer, (a_bufs, b_bufs, ready, released, row_scales_bottom, block_scales_bottom,
                     a_scales_ptr, b_scales_ptr, offsets_ptr, c_ptr, num_rows, num_experts, num_tiles_m, 1, N, K,
                     B_SCALE_STRIDE, EXPERTS_POW2, GROUP_M, STAGES, OUT_BF16)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, released, offsets_ptr, num_experts, num_tiles_m, N, K,
                     EXPERTS_POW2, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def operand_layouts():
    """The shared-memory layouts of the A (64 x 128) and B (128 x 128) FP8 tiles."""
    return (gl.NVMMASharedLayout.get_default_for([HALF_ROWS, FP8_BLOCK], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([FP8_BLOCK, FP8_BLOCK], gl.float8e4nv))


def launch_rows(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                offsets: torch.Tensor, out_bits: torch.Tensor, num_tiles_m: int, num_tiles_n: int, n: int, k: int,
                experts_pow2: int, group_m: int, stages: int, out_bf16: bool) -> None:
    """Launch over checked operands (grouped_fp8_gemm.grouped_gemm_by_weight checks them): a fp8
    [M, K] and b fp8 [E * N, K], contiguous and 16-byte aligned."""
    a_layout, b_layout = operand_layouts()
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [HALF_ROWS, FP8_BLOCK], a_layout)
    b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [FP8_BLOCK, FP8_BLOCK], b_layout)
    programs = min(num_tiles_m * num_tiles_n, torch.cuda.get_device_properties(a.device).multi_processor_count)
    _grouped_gemm_rows_ws_kernel[(programs,)](
        a_desc, a_scales, b_desc, b_scales, offsets, out_bits, a.shape[0], offsets.numel() - 1, num_tiles_m,
        N=n, K=k, B_SCALE_STRIDE=b_scales.shape[2], EXPERTS_POW2=experts_pow2, GROUP_M=group_m, STAGES=stages,
        OUT_BF16=out_bf16, num_warps=4,
    )


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel for fc1's shape at the variant's hidden size (N = 4096, K = hidden), as sm90_build
    compiles it."""
    a_layout, b_layout = operand_layouts()
    n, k = 2 * 2048, variant.hidden
    return [KernelSpec(
        "grouped_gemm_by_weight_ws", _grouped_gemm_rows_ws_kernel,
        {"a_desc": f"tensordesc<fp8e4nv[{HALF_ROWS}, {FP8_BLOCK}],{a_layout!r}>", "a_scales_ptr": "*fp32",
         "b_desc": f"tensordesc<fp8e4nv[{FP8_BLOCK}, {FP8_BLOCK}],{b_layout!r}>", "b_scales_ptr": "*fp32",
         "offsets_ptr": "*i64", "c_ptr": "*i16", "num_rows": "i32", "num_experts": "i32", "num_tiles_m": "i32"},
        {"N": n, "K": k, "B_SCALE_STRIDE": padded_scale_columns(k), "EXPERTS_POW2": EXPERTS_POW2, "GROUP_M": 8,
         "STAGES": 5, "OUT_BF16": True, "num_warps": 4},
        4, 2 * HALF_ROWS * FP8_BLOCK, 5)]
