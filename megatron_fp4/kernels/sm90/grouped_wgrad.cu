// Grouped FP8 weight gradient for Hopper (sm_90a), compiled at run time by NVRTC (grouped_gemm_sm90.py).
//
// For every expert e and every 128 x 128 tile of its gradient dW_e [N, K]:
//   dW_e[n, k] = sum over e's 128-token blocks b of  sa[b, n] * sb[b, k] * sum_{t in b} A[n, t] B[k, t]
// A = dY^T [N, capacity] and B = X^T [K, capacity], both FP8 E4M3 with one fp32 scale per 128 tokens
// (sa [capacity / 128, N], sb [capacity / 128, K]); expert e owns token columns
// [offsets[e], offsets[e + 1]), a multiple of 128. The sums are the Triton kernel's: each block's
// tensor-core product, accumulated in fp32, is multiplied by sa * sb and added to an fp32 accumulator.
//
// Why CUDA C++: a weight-gradient tile sums only ~1000 tokens (8-11 steps of 128 at 32 experts), and
// each step's product needs a scale per row and per column. One persistent CTA per SM runs a producer
// warpgroup that keeps loading (operand tiles and the scales, into a ring of STAGES shared-memory
// stages) straight on into the next tile, and two consumer warpgroups, 64 output rows each, that take
// turns at the tensor cores so that one scales while the other's products run (common.cuh). Triton
// could express neither (docs/kernels.md).

#include "common.cuh"

constexpr int A_SCALE_BYTES = TILE * 4;     // one step's fp32 scales of the tile's rows
constexpr int B_SCALE_BYTES = BLOCK_N * 4;  // and of its columns
constexpr int STEP_BYTES = OPERAND_BYTES + B_TILE_BYTES + A_SCALE_BYTES + B_SCALE_BYTES;  // what one stage receives

struct Tile {
    int expert, row_tile, col_tile;
};

// Expert e's token columns: the first, and its whole 128-token steps (none if the offsets are bad).
// Producer and consumers take their loop bounds from here, so they always agree.
struct Segment {
    int first, steps;
};

__device__ __forceinline__ Segment segment_of(const long long* segment, int expert) {
    const long long first = segment[expert], tokens = segment[expert + 1] - first;
    return first >= 0 && tokens > 0 ? Segment{(int)first, (int)(tokens / TILE)} : Segment{0, 0};
}

// Tile t of the flat order (tiles of 128 rows and BLOCK_N columns): experts one after another; within
// one, GROUP_M row tiles side by side.
__device__ __forceinline__ Tile tile_at(int t, int row_tiles, int col_tiles) {
    const int per_expert = row_tiles * col_tiles;
    const int local = t % per_expert;
    const int per_group = GROUP_M * col_tiles;
    const int first_row_tile = (local / per_group) * GROUP_M;
    const int group_size = min(row_tiles - first_row_tile, GROUP_M);
    const int in_group = local % per_group;
    return Tile{t / per_expert, first_row_tile + in_group % group_size, in_group / group_size};
}

// One consumer warpgroup's 64 rows of a 128-column part of a tile in fp32, written or added from
// registers (the wgmma accumulator's layout, common.cuh's stage_bf16).
__device__ __forceinline__ void store_fp32(const float (&acc)[64], void* out, int mode, Tile tile, int part,
                                           int first_row, int lane, int n, int k) {
    const u64 row0 = (u64)tile.row_tile * TILE + first_row + lane / 4;
    const u64 col0 = (u64)tile.col_tile * BLOCK_N + part * TILE + 2 * (lane % 4);
    float* const dst = mode == ACCUMULATE_FP32
                           ? reinterpret_cast<float*>(reinterpret_cast<const long long*>(out)[tile.expert])
                           : reinterpret_cast<float*>(out) + (u64)tile.expert * n * k;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float2* p = reinterpret_cast<float2*>(dst + (row0 + 8 * h) * k + col0 + 8 * j);
            float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            if (mode == ACCUMULATE_FP32) {
                const float2 before = *p;
                v = make_float2(before.x + v.x, before.y + v.y);
            }
            *p = v;
        }
    }
}

// The column scales of this thread's columns 8j + 2(lane % 4) (+1) of a 128-column part.
__device__ __forceinline__ void read_column_scales(float2 (&col_scale)[16], const float* part_scales, int lane) {
#pragma unroll
    for (int j = 0; j < 16; ++j) col_scale[j] = reinterpret_cast<const float2*>(part_scales)[4 * j + lane % 4];
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_wgrad_sm90(
    const __grid_constant__ TensorMap grad_map,   // dY^T [N, capacity], boxes of [128 rows, 128 tokens]
    const __grid_constant__ TensorMap input_map,  // X^T [K, capacity], boxes of [BLOCK_N rows, 128 tokens]
    const __grid_constant__ TensorMap out_map,    // STORE_BF16: the output as [E * N, K], boxes of [64, 64]
    const float* grad_scales,                     // [capacity / 128, N]
    const float* input_scales,                    // [capacity / 128, K]
    const long long* offsets,                     // [E + 1]
    void* out,  // [E, N, K] BF16 or fp32; with ACCUMULATE_FP32 int64 [E]: each expert's fp32 [N, K]
    int mode, int num_experts, int n, int k) {
    extern __shared__ unsigned char shared_raw[];
    unsigned char* shared;
    const u32 base = aligned_shared_base(shared_raw, &shared);
    const u32 a_tiles = base, b_tiles = base + STAGES * OPERAND_BYTES;
    const u32 out_tile_at = b_tiles + STAGES * B_TILE_BYTES;
    const u32 a_scales_at = out_tile_at + OUT_TILE_BYTES;
    const u32 b_scales_at = a_scales_at + STAGES * A_SCALE_BYTES;
    const u32 offsets_at = b_scales_at + STAGES * B_SCALE_BYTES;
    const u32 full = offsets_at + 8 * (MAX_EXPERTS + 1);
    const u32 empty = full + STAGES * 8;
    const float* const row_scales_at = reinterpret_cast<const float*>(shared + (a_scales_at - base));
    const float* const col_scales_at = reinterpret_cast<const float*>(shared + (b_scales_at - base));
    unsigned char* const out_tile = shared + (out_tile_at - base);
    long long* const segment = reinterpret_cast<long long*>(shared + (offsets_at - base));

    const int warpgroup = threadIdx.x / 128;
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) segment[e] = offsets[e];
    if (threadIdx.x == 0) {
        check_layout(shared_raw, empty + 8 * STAGES);
        init_ring(full, empty);
    }
    __syncthreads();

    const int row_tiles = n / TILE, col_tiles = k / BLOCK_N;
    const int num_tiles = num_experts * row_tiles * col_tiles;
    Ring ring;
    if (warpgroup == 0) {  // the producer
        // Each role is one branch of this if / else, so that ptxas gives each its register budget.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {  // one thread issues every copy
            for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
                const Tile tile = tile_at(t, row_tiles, col_tiles);
                const Segment tokens = segment_of(segment, tile.expert);
                for (int step = 0; step < tokens.steps; ++step) {
                    const int token = tokens.first + step * TILE;
                    barrier_wait(empty + 8 * ring.stage, ring.parity ^ 1);
                    const u32 bar = full + 8 * ring.stage;
                    barrier_expect_bytes(bar, STEP_BYTES);
                    load_tile(a_tiles + ring.stage * OPERAND_BYTES, &grad_map, token, tile.row_tile * TILE, bar);
                    load_tile(b_tiles + ring.stage * B_TILE_BYTES, &input_map, token, tile.col_tile * BLOCK_N, bar);
                    const u64 block = token / TILE;
                    load_bytes(a_scales_at + ring.stage * A_SCALE_BYTES, grad_scales + block * n + tile.row_tile * TILE,
                               A_SCALE_BYTES, bar);
                    load_bytes(b_scales_at + ring.stage * B_SCALE_BYTES, input_scales + block * k + tile.col_tile * BLOCK_N,
                               B_SCALE_BYTES, bar);
                    ring.advance();
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int consumer = warpgroup - 1;  // its 64 rows of each tile
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int my_row = consumer * 64 + warp * 16 + lane / 4;  // and my_row + 8
        const bool issues_stores = threadIdx.x % 128 == 0;  // the warpgroup's thread that starts its copies out
        start_turns(consumer);
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const Tile tile = tile_at(t, row_tiles, col_tiles);
            const Segment tokens = segment_of(segment, tile.expert);
            float acc[COLUMN_PARTS][64], product[64];
#pragma unroll
            for (int part = 0; part < COLUMN_PARTS; ++part) {
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[part][i] = 0.0f;
            }
            for (int step = 0; step < tokens.steps; ++step) {
                barrier_wait(full + 8 * ring.stage, ring.parity);
                const float* a_scale = row_scales_at + ring.stage * TILE;
                const float* b_scale = col_scales_at + ring.stage * BLOCK_N;
                const float row_scale[2] = {a_scale[my_row], a_scale[my_row + 8]};
                // One 128-column part: its column scales are read before its products (off the path from
                // product to sum) and the stage released right after them. Two parts: each part's are read
                // as its sums use them, so that none are held while the other part's sums and the product
                // fill the registers, and the stage is released after the last part's sums.
                float2 col_scale[16];
                if constexpr (COLUMN_PARTS == 1) read_column_scales(col_scale, b_scale, lane);
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    multiply_part(product, a_tiles + ring.stage * OPERAND_BYTES + consumer * 64 * TILE,
                                  b_tiles + ring.stage * B_TILE_BYTES + part * OPERAND_BYTES, consumer);
                    if constexpr (COLUMN_PARTS == 1) release_stage(lane, empty + 8 * ring.stage);
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        const float2 scale_j =
                            COLUMN_PARTS == 1 ? col_scale[j]
                                              : reinterpret_cast<const float2*>(b_scale + part * TILE)[4 * j + lane % 4];
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            float* sum = &acc[part][4 * j + 2 * h];
                            sum[0] = fmaf(product[4 * j + 2 * h], row_scale[h] * scale_j.x, sum[0]);
                            sum[1] = fmaf(product[4 * j + 2 * h + 1], row_scale[h] * scale_j.y, sum[1]);
                        }
                    }
                    if (COLUMN_PARTS > 1 && part == COLUMN_PARTS - 1) release_stage(lane, empty + 8 * ring.stage);
                }
                ring.advance();
            }
            // An expert without tokens leaves its buffer as it was (the Triton kernel adds +0.0 to it, which
            // differs only where the buffer holds -0.0).
            if (mode == ACCUMULATE_FP32 && tokens.steps == 0) continue;
            if (mode == STORE_BF16) {
                store_bf16_async(acc, out_tile, out_tile_at, &out_map, consumer, warp, lane, issues_stores,
                                 tile.col_tile * BLOCK_N, tile.expert * n + tile.row_tile * TILE + consumer * 64);
            } else {
#pragma unroll
                for (int part = 0; part < COLUMN_PARTS; ++part) {
                    store_fp32(acc[part], out, mode, tile, part, consumer * 64 + warp * 16, lane, n, k);
                }
            }
        }
        end_turns(consumer);
        finish_stores(issues_stores);
    }
}
