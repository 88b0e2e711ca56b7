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

#include "common.cuh"

constexpr int STEP_BYTES = OPERAND_BYTES + B_TILE_BYTES;
constexpr u32 FULL_ARRIVALS = 1;

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
    const __grid_constant__ TensorMap rows_map,    // X [M, K], boxes of [128 rows, 128 columns]
    const __grid_constant__ TensorMap weight_map,  // W as [E * N, K], boxes of [BLOCK_N rows, 128 columns]
    const __grid_constant__ TensorMap out_map,     // STORE_BF16: Y [M, N], boxes of [64, 64]
    const float* row_scales,                       // [K / 128, M]
    const float* weight_scales,                    // [E, N / 128, weight_scale_stride]
    const long long* offsets,                      // [E + 1]
    void* out,                                     // Y [M, N], BF16 or fp32
    int mode, int num_experts, int m, int n, int k, int weight_scale_stride) {
    extern __shared__ unsigned char shared_raw[];
    unsigned char* shared;
    const u32 base = aligned_shared_base(shared_raw, &shared);
    const u32 a_tiles = base, b_tiles = base + STAGES * OPERAND_BYTES;
    const u32 out_tile_at = b_tiles + STAGES * B_TILE_BYTES;
    const u32 offsets_at = out_tile_at + OUT_TILE_BYTES;
    const u32 tile_ends_at = offsets_at + 8 * (MAX_EXPERTS + 1);
    const u32 full = tile_ends_at + 4 * MAX_EXPERTS;
    const u32 empty = full + STAGES * 8;
    unsigned char* const out_tile = shared + (out_tile_at - base);
    long long* const segment = reinterpret_cast<long long*>(shared + (offsets_at - base));
    int* const tile_ends = reinterpret_cast<int*>(shared + (tile_ends_at - base));

    const int warpgroup = threadIdx.x / 128;
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) segment[e] = offsets[e];
    __syncthreads();
    if (threadIdx.x < 32) count_tiles(segment, num_experts, tile_ends);
    if (threadIdx.x == 0) {
        check_layout(shared_raw, empty + 8 * STAGES);
        init_ring(full, empty, FULL_ARRIVALS);
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
                    load_tile(a_tiles + ring.stage * OPERAND_BYTES, &rows_map, step * TILE, tile.first_row, bar);
                    barrier_expect_bytes(bar, STEP_BYTES);
                    load_tile(b_tiles + ring.stage * B_TILE_BYTES, &weight_map, step * TILE, weight_row, bar);
                    ring.advance();
                }
            }
        }
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
            // its use.
            const float* my_scales[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) my_scales[h] = row_scales + max(min(my_first_row + lane / 4 + 8 * h, m - 1), 0);
            float next_row_scale[2] = {my_scales[0][0], my_scales[1][0]};
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
