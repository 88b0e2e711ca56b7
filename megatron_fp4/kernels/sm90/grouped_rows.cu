// Grouped FP8 GEMM of the experts' rows by their weights (forward and data gradient) for Hopper
// (sm_90a), compiled at run time by NVRTC (grouped_gemm_sm90.py).
//
// Y[rows of expert e] = X[rows of e] W_e^T: X [M, K] FP8 E4M3 with one fp32 scale per row and 128
// columns (sa [K / 128, M]), W [E, N, K] FP8 with one scale per 128 x 128 block (sw [E, N / 128, S]).
// Expert e owns rows [offsets[e], offsets[e + 1]); its rows form ceil(n_e / 128) row tiles of one flat
// tile space, so a small expert costs one tile. A tile's rows past its expert's end belong to the next
// expert (or lie past M, read as zeros): their products are computed and never stored. The sums are
// the Triton kernel's: each 128-column step's tensor-core product, accumulated in fp32, is multiplied
// by sa * sw and added to an fp32 accumulator.
//
// The CTA is the weight gradient's (grouped_wgrad.cu, common.cuh): persistent, a producer warpgroup
// loading both operand tiles through the Tensor Memory Accelerator into a ring of stages, two
// consumer warpgroups of 64 rows taking turns at the tensor cores. Each consumer loads its rows' scales
// and the scales of the tile's weight blocks (one per 128 columns) one step ahead, from L2 (a tile's
// row scales start at any row, too unaligned for a bulk copy).
//
// Compiled with A_MXFP4=1, X comes as MXFP4 rows instead (packed E2M1 codes [M, K / 2] and E8M0 block
// scales [M, K / 32], the dispatch's wire rows): the producer copies each step's codes and block scales
// into the stage, the producer warpgroup's other three warps convert them there into the E4M3 tile and
// its row scales (mxfp4_operand.cuh), and the consumers read both from the stage. The products are the
// bits of mxfp4_to_fp8_rows followed by the FP8 kernel, without the FP8 copy of X in global memory.

#include "common.cuh"

#if !defined(A_MXFP4)
#error "compile with -DA_MXFP4=0 or 1 (grouped_gemm_sm90.build)"
#endif
#if A_MXFP4
#include "mxfp4_operand.cuh"
constexpr int STEP_BYTES = B_TILE_BYTES;  // what the producer's copies of the weights bring; the A tile is converted
constexpr u32 FULL_ARRIVALS = 1 + CONVERTER_WARPS;
#else
constexpr int STEP_BYTES = OPERAND_BYTES + B_TILE_BYTES;
constexpr u32 FULL_ARRIVALS = 1;
#endif

struct Tile {
    int expert, first_row, end_row, col_tile;  // end_row: the expert's end, at most M
};

// Tile t: GROUP_M row tiles side by side over every column tile, the row tile's expert found in the
// running tile counts.
__device__ __forceinline__ Tile tile_at(int t, int row_tiles, int col_tiles, const int* tile_ends,
                                        const long long* segment, int num_experts, int m) {
    const int per_group = GROUP_M * col_tiles;
    const int first_row_tile = (t / per_group) * GROUP_M;
    const int group_size = min(row_tiles - first_row_tile, GROUP_M);
    const int row_tile = first_row_tile + (t % per_group) % group_size;
    int lo = 0, hi = num_experts - 1;  // the first expert whose tiles end past row_tile
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (tile_ends[mid] > row_tile) hi = mid; else lo = mid + 1;
    }
    const int tiles_before = lo > 0 ? tile_ends[lo - 1] : 0;
    const int first_row = (int)segment[lo] + (row_tile - tiles_before) * TILE;
    return Tile{lo, first_row, (int)min(segment[lo + 1], (long long)m), (t % per_group) / group_size};
}

// The running row-tile counts of the experts (tile_ends[e] = tiles of experts 0..e), by the first warp.
__device__ __forceinline__ void count_tiles(const long long* segment, int num_experts, int* tile_ends) {
    const int lane = threadIdx.x % 32;
    int carry = 0;
    for (int first = 0; first < num_experts; first += 32) {
        const int e = first + lane;
        int tiles = e < num_experts ? (int)max((segment[e + 1] - segment[e] + TILE - 1) / TILE, 0LL) : 0;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            const int below = __shfl_up_sync(0xffffffffu, tiles, d);
            if (lane >= d) tiles += below;
        }
        if (e < num_experts) tile_ends[e] = carry + tiles;
        carry += __shfl_sync(0xffffffffu, tiles, 31);
    }
}

// A consumer's 64 rows of a 128-column part from registers, only those before end_row: rounded to BF16
// or in fp32.
__device__ __forceinline__ void store_rows(const float (&acc)[64], void* out, int mode, int first_row, int end_row,
                                           int column, int lane, int n) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = first_row + lane / 4 + 8 * h;
        if (row < 0 || row >= end_row) continue;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const u64 at = (u64)row * n + column + 8 * j + 2 * (lane % 4);
            if (mode == STORE_BF16) {
                reinterpret_cast<u32*>(out)[at / 2] = bf16x2_rounded(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            } else {
                reinterpret_cast<float2*>(out)[at / 2] = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_rows_sm90(
    const __grid_constant__ TensorMap rows_map,    // X [M, K], boxes of [128 rows, 128 columns]; A_MXFP4: its
                                                   // codes [M, K / 2], boxes of [128 rows, 64 bytes]
    const __grid_constant__ TensorMap block_scale_map,  // A_MXFP4: X's E8M0 bytes [M, K / 32], boxes of [128, 16]
    const __grid_constant__ TensorMap weight_map,  // W as [E * N, K], boxes of [BLOCK_N rows, 128 columns]
    const __grid_constant__ TensorMap out_map,     // STORE_BF16: Y [M, N], boxes of [64, 64]
    const float* row_scales,                       // [K / 128, M]; A_MXFP4: unused
    const uint2* e4m3_table,                       // A_MXFP4: [GAPS] (mxfp4_operand.cuh); else unused
    const float* weight_scales,                    // [E, N / 128, weight_scale_stride]
    const long long* offsets,                      // [E + 1]
    void* out,                                     // Y [M, N], BF16 or fp32
    int mode, int num_experts, int m, int n, int k, int weight_scale_stride) {
    extern __shared__ unsigned char shared_raw[];
    unsigned char* shared;
    const u32 base = aligned_shared_base(shared_raw, &shared);
    const u32 a_tiles = base, b_tiles = base + STAGES * OPERAND_BYTES;
    const u32 out_tile_at = b_tiles + STAGES * B_TILE_BYTES;
#if A_MXFP4
    // Per stage: the step's codes and block scales as copied (1024-byte aligned, as the tiles), and the
    // row scales the converters write; then the E4M3 table.
    const u32 codes_at = out_tile_at + OUT_TILE_BYTES;
    const u32 block_scales_at = codes_at + STAGES * CODES_BYTES;
    const u32 stage_row_scales_at = block_scales_at + STAGES * BLOCK_SCALE_BYTES;
    const u32 table_at = stage_row_scales_at + STAGES * ROW_SCALE_BYTES;
    const u32 offsets_at = table_at + GAPS * 8;
#else
    const u32 offsets_at = out_tile_at + OUT_TILE_BYTES;
#endif
    const u32 tile_ends_at = offsets_at + 8 * (MAX_EXPERTS + 1);
#if A_MXFP4
    const u32 copied = tile_ends_at + 4 * MAX_EXPERTS;  // barriers: the step's codes and block scales have arrived
    const u32 full = copied + STAGES * 8;
    uint2* const table = reinterpret_cast<uint2*>(shared + (table_at - base));
    const float* const stage_row_scales = reinterpret_cast<const float*>(shared + (stage_row_scales_at - base));
#else
    const u32 full = tile_ends_at + 4 * MAX_EXPERTS;
#endif
    const u32 empty = full + STAGES * 8;
    unsigned char* const out_tile = shared + (out_tile_at - base);
    long long* const segment = reinterpret_cast<long long*>(shared + (offsets_at - base));
    int* const tile_ends = reinterpret_cast<int*>(shared + (tile_ends_at - base));

    const int warpgroup = threadIdx.x / 128;
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) segment[e] = offsets[e];
#if A_MXFP4
    for (int g = threadIdx.x; g < GAPS; g += blockDim.x) table[g] = e4m3_table[g];
#endif
    __syncthreads();
    if (threadIdx.x < 32) count_tiles(segment, num_experts, tile_ends);
    if (threadIdx.x == 0) {
        check_layout(shared_raw, empty + 8 * STAGES);
        init_ring(full, empty, FULL_ARRIVALS);
#if A_MXFP4
        for (int s = 0; s < STAGES; ++s) barrier_init(copied + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
    }
    __syncthreads();

    const int row_tiles = tile_ends[num_experts - 1], col_tiles = n / BLOCK_N, k_steps = k / TILE;
    const int num_tiles = row_tiles * col_tiles;
    Ring ring;
    if (warpgroup == 0) {  // the producer
        // Each role is one branch of this if / else, so that ptxas gives each its register budget.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {  // one thread issues every copy
            for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
                const Tile tile = tile_at(t, row_tiles, col_tiles, tile_ends, segment, num_experts, m);
                const int weight_row = tile.expert * n + tile.col_tile * BLOCK_N;
                for (int step = 0; step < k_steps; ++step) {
                    barrier_wait(empty + 8 * ring.stage, ring.parity ^ 1);
                    const u32 bar = full + 8 * ring.stage;
#if A_MXFP4
                    const u32 codes_bar = copied + 8 * ring.stage;
                    barrier_expect_bytes(codes_bar, MXFP4_STEP_BYTES);
                    load_tile(codes_at + ring.stage * CODES_BYTES, &rows_map, step * CODES_BOX_BYTES, tile.first_row,
                              codes_bar);
                    load_tile(block_scales_at + ring.stage * BLOCK_SCALE_BYTES, &block_scale_map,
                              scales_box_column(step), tile.first_row, codes_bar);
#else
                    load_tile(a_tiles + ring.stage * OPERAND_BYTES, &rows_map, step * TILE, tile.first_row, bar);
#endif
                    barrier_expect_bytes(bar, STEP_BYTES);
                    load_tile(b_tiles + ring.stage * B_TILE_BYTES, &weight_map, step * TILE, weight_row, bar);
                    ring.advance();
                }
            }
        }
#if A_MXFP4
        else if (threadIdx.x >= 32) {  // the converters: each step's A tile and row scales into its stage
            const int converter = threadIdx.x - 32;
            for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
                for (int step = 0; step < k_steps; ++step) {
                    barrier_wait(copied + 8 * ring.stage, ring.parity);
                    convert_step(shared + (codes_at - base) + ring.stage * CODES_BYTES,
                                 shared + (block_scales_at - base) + ring.stage * BLOCK_SCALE_BYTES,
                                 shared + (a_tiles - base) + ring.stage * OPERAND_BYTES,
                                 const_cast<float*>(stage_row_scales) + ring.stage * TILE, table,
                                 step * BLOCKS_PER_ROW_STEP - scales_box_column(step), converter);
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the tensor cores
                    __syncwarp();
                    if (threadIdx.x % 32 == 0) barrier_arrive(full + 8 * ring.stage);
                    ring.advance();
                }
            }
        }
#endif
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int consumer = warpgroup - 1;  // its 64 rows of each tile
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const bool issues_stores = threadIdx.x % 128 == 0;  // the warpgroup's thread that starts its copies out
        start_turns(consumer);
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const Tile tile = tile_at(t, row_tiles, col_tiles, tile_ends, segment, num_experts, m);
            const int my_first_row = tile.first_row + consumer * 64 + warp * 16;
            // This thread's two rows' scales (clamped to [0, M): rows outside are never stored)
            // and the weight blocks' of the tile's parts, walked a step at a time, each loaded a step before
            // its use. A_MXFP4: the row scales are the converters', in the stage.
#if A_MXFP4
            const int my_tile_row = consumer * 64 + warp * 16 + lane / 4;  // and + 8
#else
            const float* my_scales[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) my_scales[h] = row_scales + max(min(my_first_row + lane / 4 + 8 * h, m - 1), 0);
            float next_row_scale[2] = {my_scales[0][0], my_scales[1][0]};
#endif
            const float* weight_scale =
                weight_scales + ((u64)tile.expert * (n / TILE) + tile.col_tile * COLUMN_PARTS) * weight_scale_stride;
            float next_weight_scale[COLUMN_PARTS];
#pragma unroll
            for (int part = 0; part < COLUMN_PARTS; ++part) next_weight_scale[part] = weight_scale[part * weight_scale_stride];
            float acc[COLUMN_PARTS][64], product[64];
#pragma unroll
            for (int part = 0; part < COLUMN_PARTS; ++part) {
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[part][i] = 0.0f;
            }
            for (int step = 0; step < k_steps; ++step) {
                float scale[COLUMN_PARTS][2];
                const int ahead = min(step + 1, k_steps - 1);
#if A_MXFP4
                float weight_scale_now[COLUMN_PARTS];
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    weight_scale_now[part] = next_weight_scale[part];
                    next_weight_scale[part] = weight_scale[part * weight_scale_stride + ahead];
                }
                barrier_wait(full + 8 * ring.stage, ring.parity);
                const float* row_scale = stage_row_scales + ring.stage * TILE + my_tile_row;
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    scale[part][0] = row_scale[0] * weight_scale_now[part];
                    scale[part][1] = row_scale[8] * weight_scale_now[part];
                }
#else
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    scale[part][0] = next_row_scale[0] * next_weight_scale[part];
                    scale[part][1] = next_row_scale[1] * next_weight_scale[part];
                }
                next_row_scale[0] = my_scales[0][(u64)ahead * m];
                next_row_scale[1] = my_scales[1][(u64)ahead * m];
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    next_weight_scale[part] = weight_scale[part * weight_scale_stride + ahead];
                }
                barrier_wait(full + 8 * ring.stage, ring.parity);
#endif
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    multiply_part(product, a_tiles + ring.stage * OPERAND_BYTES + consumer * 64 * TILE,
                                  b_tiles + ring.stage * B_TILE_BYTES + part * OPERAND_BYTES, consumer);
                    if (part == COLUMN_PARTS - 1) release_stage(lane, empty + 8 * ring.stage);
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            acc[part][4 * j + i] = fmaf(product[4 * j + i], scale[part][i / 2], acc[part][4 * j + i]);
                        }
                    }
                }
                ring.advance();
            }
            const int half_first_row = tile.first_row + consumer * 64;
            if (mode == STORE_BF16 && half_first_row + 64 <= tile.end_row) {
                store_bf16_async(acc, out_tile, out_tile_at, &out_map, consumer, warp, lane, issues_stores,
                                 tile.col_tile * BLOCK_N, half_first_row);
            } else {
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    store_rows(acc[part], out, mode, my_first_row, tile.end_row, tile.col_tile * BLOCK_N + part * TILE,
                               lane, n);
                }
            }
        }
        end_turns(consumer);
        finish_stores(issues_stores);
    }
}
