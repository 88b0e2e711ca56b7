// Grouped FP8 weight gradient for Hopper (sm_90a), compiled at run time by NVRTC (sm90_cuda.py).
//
// For every expert e and every 128 x 128 tile of its gradient dW_e [N, K]:
//   dW_e[n, k] = sum over e's 128-token blocks b of  sa[b, n] * sb[b, k] * sum_{t in b} A[n, t] B[k, t]
// A = dY^T [N, capacity] and B = X^T [K, capacity], both FP8 E4M3 with one fp32 scale per 128 tokens
// (sa [capacity / 128, N], sb [capacity / 128, K]); expert e owns token columns
// [offsets[e], offsets[e + 1]), a multiple of 128. The sums are the Triton kernel's: each block's
// tensor-core product, accumulated in fp32, is multiplied by sa * sb and added to an fp32 accumulator.
//
// Why CUDA C++: a weight-gradient tile sums only ~1000 tokens (8-11 steps of 128 at 32 experts), so
// the pipeline's fill and the tile's store cost as much as its products. Here one persistent CTA per
// SM runs three warpgroups: a producer that keeps loading (Tensor Memory Accelerator tiles and bulk
// copies of the scales, into a ring of STAGES shared-memory stages) straight on into the next tile
// while two consumer warpgroups, 64 output rows each, scale their products and store the previous
// tile. Triton could not express that overlap (docs/kernels.md). BF16 tiles are written through
// shared memory by the Tensor Memory Accelerator, so a consumer goes on to its next tile while the
// copy runs.

typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef STAGES
#define STAGES 5
#endif

struct alignas(64) TensorMap { u64 opaque[16]; };  // a CUtensorMap, built by the host

constexpr int TILE = 128;               // output rows and columns of a tile, and tokens per step
constexpr int OPERAND_BYTES = TILE * TILE;  // one FP8 operand tile
constexpr int SCALE_BYTES = TILE * 4;   // one step's fp32 scales of one operand
constexpr int STEP_BYTES = 2 * OPERAND_BYTES + 2 * SCALE_BYTES;  // what one stage receives
constexpr int GROUP_M = 8;              // row tiles side by side, so their column tiles are read from L2
constexpr int CONSUMER_WARPS = 8;
constexpr int OUT_HALF_BYTES = TILE * 128;  // a tile's 64 BF16 columns, 128-byte swizzled rows
constexpr int MAX_EXPERTS = 1024;           // the segment offsets are copied to shared memory
// Named barriers: 0 is __syncthreads, 1 + c consumer c's output staging, MAY_ISSUE + c "consumer c
// may issue its next products".
constexpr int MAY_ISSUE = 3;

enum OutputMode { STORE_BF16 = 0, STORE_FP32 = 1, ACCUMULATE_FP32 = 2 };

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
    return address;
}

__device__ __forceinline__ void barrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void barrier_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

__device__ __forceinline__ void barrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Named barriers of 256 threads, the two consumer warpgroups: one arrives, the other waits.
__device__ __forceinline__ void named_barrier_sync(int id) {
    asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id) {
    asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}

// A [rows, 128 tokens] box of a tensor map at (token, row), completing on bar.
__device__ __forceinline__ void load_tile(u32 dst, const TensorMap* map, int token, int row, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(token), "r"(row), "r"(bar) : "memory");
}

__device__ __forceinline__ void load_bytes(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// A [rows, 64 columns] box of BF16 from shared memory to the tensor map's (column, row).
__device__ __forceinline__ void store_tile_async(const TensorMap* map, u32 src, int column, int row) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"(reinterpret_cast<u64>(map)), "r"(column), "r"(row), "r"(src) : "memory");
}

// A wgmma shared-memory descriptor of a K-major tile with 128-byte rows in the 128-byte swizzle (the
// layout the tensor maps write): 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 operand_descriptor(u32 address) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void keep_in_registers(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (+)= A[64 x 32] B[128 x 32]^T on the tensor cores, asynchronously; accumulate = 0 overwrites d.
__device__ __forceinline__ void wgmma_64x128x32(float (&d)[64], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

struct Tile {
    int expert, row_tile, col_tile;
};

// Tile t of the flat order: experts one after another; within one, GROUP_M row tiles side by side.
__device__ __forceinline__ Tile tile_at(int t, int row_tiles, int col_tiles) {
    const int per_expert = row_tiles * col_tiles;
    const int local = t % per_expert;
    const int per_group = GROUP_M * col_tiles;
    const int first_row_tile = (local / per_group) * GROUP_M;
    const int group_size = min(row_tiles - first_row_tile, GROUP_M);
    const int in_group = local % per_group;
    return Tile{t / per_expert, first_row_tile + in_group % group_size, in_group / group_size};
}

struct Ring {  // where the next step goes in the ring of stages, and the parity of its round
    int stage = 0;
    u32 parity = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == STAGES) {
            stage = 0;
            parity ^= 1;
        }
    }
};

__device__ __forceinline__ u32 bf16x2_rounded(float low, float high) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

// One consumer warpgroup's 64 x 128 half of a tile in fp32, written or added from registers: thread
// (warp w, lane l) holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1), j = 0..15, the wgmma
// accumulator's layout.
__device__ __forceinline__ void store_fp32(const float (&acc)[64], void* out, int mode, Tile tile, int first_row,
                                           int lane, int n, int k) {
    const u64 row0 = (u64)tile.row_tile * TILE + first_row + lane / 4;
    const u64 col0 = (u64)tile.col_tile * TILE + 2 * (lane % 4);
    if (mode == ACCUMULATE_FP32) {
        float* dst = reinterpret_cast<float*>(reinterpret_cast<const long long*>(out)[tile.expert]);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float2* p = reinterpret_cast<float2*>(dst + (row0 + 8 * h) * k + col0 + 8 * j);
                float2 v = *p;
                v.x += acc[4 * j + 2 * h];
                v.y += acc[4 * j + 2 * h + 1];
                *p = v;
            }
        }
        return;
    }
    const u64 base = (u64)tile.expert * n * k;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u64 at = base + (row0 + 8 * h) * k + col0 + 8 * j;
            reinterpret_cast<float2*>(out)[at / 2] = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
    }
}

// The same half rounded to BF16 into shared memory, in the layout of the output map's boxes: two
// halves of 64 columns, rows of 128 bytes whose 16-byte chunks are swizzled by row % 8 (so the 8 rows
// a warp writes at once fall on different banks).
__device__ __forceinline__ void stage_bf16(const float (&acc)[64], unsigned char* out_tile, int first_row, int lane) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = first_row + lane / 4 + 8 * h;
            const int chunk = (j % 8) ^ (row % 8);
            *reinterpret_cast<u32*>(out_tile + (j / 8) * OUT_HALF_BYTES + row * 128 + chunk * 16 + (lane % 4) * 4) =
                bf16x2_rounded(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_wgrad_sm90(
    const __grid_constant__ TensorMap grad_map,   // dY^T [N, capacity], boxes of [128 rows, 128 tokens]
    const __grid_constant__ TensorMap input_map,  // X^T [K, capacity], the same boxes
    const __grid_constant__ TensorMap out_map,    // STORE_BF16: the output as [E * N, K], boxes of [64, 64]
    const float* grad_scales,                     // [capacity / 128, N]
    const float* input_scales,                    // [capacity / 128, K]
    const long long* offsets,                     // [E + 1]
    void* out,  // [E, N, K] BF16 or fp32; with ACCUMULATE_FP32 int64 [E]: each expert's fp32 [N, K]
    int mode, int num_experts, int n, int k) {
    extern __shared__ unsigned char shared_raw[];
    // Swizzled tiles must start at 1024-byte boundaries.
    const u32 raw = shared_address(shared_raw);
    const u32 base = (raw + 1023) & ~1023u;
    unsigned char* const shared = shared_raw + (base - raw);
    const u32 a_tiles = base, b_tiles = base + STAGES * OPERAND_BYTES;
    const u32 a_scales_at = base + 2 * STAGES * OPERAND_BYTES;
    const u32 b_scales_at = a_scales_at + STAGES * SCALE_BYTES;
    const u32 out_tile_at = b_scales_at + STAGES * SCALE_BYTES;  // 1024-aligned: STAGES * 1024 bytes of scales
    const u32 offsets_at = out_tile_at + 2 * OUT_HALF_BYTES;
    const u32 full = offsets_at + 8 * (MAX_EXPERTS + 1);  // a stage's bytes have arrived
    const u32 empty = full + STAGES * 8;                  // every consumer warp is done with a stage
    const float* const scales = reinterpret_cast<const float*>(shared + (a_scales_at - base));
    unsigned char* const out_tile = shared + (out_tile_at - base);
    long long* const segment = reinterpret_cast<long long*>(shared + (offsets_at - base));

    const int warpgroup = threadIdx.x / 128;
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) segment[e] = offsets[e];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(full + 8 * s, 1);
            barrier_init(empty + 8 * s, CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int row_tiles = n / TILE, col_tiles = k / TILE;
    const int num_tiles = num_experts * row_tiles * col_tiles;
    Ring ring;
    if (warpgroup == 0) {  // the producer: one thread issues every copy
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 0) return;
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const Tile tile = tile_at(t, row_tiles, col_tiles);
            const int first = (int)segment[tile.expert], end = (int)segment[tile.expert + 1];
            for (int token = first; token < end; token += TILE) {
                barrier_wait(empty + 8 * ring.stage, ring.parity ^ 1);
                const u32 bar = full + 8 * ring.stage;
                barrier_expect_bytes(bar, STEP_BYTES);
                load_tile(a_tiles + ring.stage * OPERAND_BYTES, &grad_map, token, tile.row_tile * TILE, bar);
                load_tile(b_tiles + ring.stage * OPERAND_BYTES, &input_map, token, tile.col_tile * TILE, bar);
                const u64 block = token / TILE;
                load_bytes(a_scales_at + ring.stage * SCALE_BYTES, grad_scales + block * n + tile.row_tile * TILE,
                           SCALE_BYTES, bar);
                load_bytes(b_scales_at + ring.stage * SCALE_BYTES, input_scales + block * k + tile.col_tile * TILE,
                           SCALE_BYTES, bar);
                ring.advance();
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;  // its 64 rows of each tile
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int my_row = consumer * 64 + warp * 16 + lane / 4;  // and my_row + 8
    const bool issues_stores = threadIdx.x % 128 == 0;  // the warpgroup's thread that starts its copies out
    // The consumers take turns at the tensor cores, one step each: were both to issue a step's products
    // at once, they would finish together and then both scale while the tensor cores idle. In turns,
    // one scales while the other's products run. Consumer 0 goes first.
    if (consumer == 1) named_barrier_arrive(MAY_ISSUE);
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const Tile tile = tile_at(t, row_tiles, col_tiles);
        const int first = (int)segment[tile.expert], end = (int)segment[tile.expert + 1];
        float acc[64], product[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
        for (int token = first; token < end; token += TILE) {
            barrier_wait(full + 8 * ring.stage, ring.parity);
            const float* a_scale = scales + ring.stage * TILE;
            const float* b_scale = scales + STAGES * TILE + ring.stage * TILE;
            const float row_scale[2] = {a_scale[my_row], a_scale[my_row + 8]};
            float2 col_scale[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) col_scale[j] = reinterpret_cast<const float2*>(b_scale)[4 * j + lane % 4];
            const u64 a = operand_descriptor(a_tiles + ring.stage * OPERAND_BYTES + consumer * 64 * TILE);
            const u64 b = operand_descriptor(b_tiles + ring.stage * OPERAND_BYTES);
            named_barrier_sync(MAY_ISSUE + consumer);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int step = 0; step < TILE / 32; ++step) {  // 32 bytes of K each: 2 in the descriptor's units
                wgmma_64x128x32(product, a + 2 * step, b + 2 * step, step);
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            named_barrier_arrive(MAY_ISSUE + 1 - consumer);
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            keep_in_registers(product);
            __syncwarp();
            if (lane == 0) barrier_arrive(empty + 8 * ring.stage);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    acc[4 * j + 2 * h] = fmaf(product[4 * j + 2 * h], row_scale[h] * col_scale[j].x, acc[4 * j + 2 * h]);
                    acc[4 * j + 2 * h + 1] =
                        fmaf(product[4 * j + 2 * h + 1], row_scale[h] * col_scale[j].y, acc[4 * j + 2 * h + 1]);
                }
            }
            ring.advance();
        }
        if (mode == ACCUMULATE_FP32 && first == end) continue;  // nothing to add
        if (mode != STORE_BF16) {
            store_fp32(acc, out, mode, tile, consumer * 64 + warp * 16, lane, n, k);
            continue;
        }
        // This warpgroup's rows of the shared tile are free once its previous copy has read them.
        if (issues_stores) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        asm volatile("bar.sync %0, 128;" ::"r"(1 + consumer) : "memory");
        stage_bf16(acc, out_tile, consumer * 64 + warp * 16, lane);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the copy engine
        asm volatile("bar.sync %0, 128;" ::"r"(1 + consumer) : "memory");
        if (issues_stores) {
            const int row = tile.expert * n + tile.row_tile * TILE + consumer * 64;
            for (int half = 0; half < 2; ++half) {
                store_tile_async(&out_map, out_tile_at + half * OUT_HALF_BYTES + consumer * 64 * 128,
                                 tile.col_tile * TILE + half * 64, row);
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    }
    if (consumer == 0) named_barrier_sync(MAY_ISSUE);  // consumer 1's arrival after its last step
    if (issues_stores) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // before the CTA's memory goes
}
