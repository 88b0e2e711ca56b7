// What the sm_90a GEMM kernels share (grouped_wgrad.cu, grouped_rows.cu): the ring of shared-memory
// stages a producer warpgroup fills through the Tensor Memory Accelerator, mbarriers, the FP8 wgmma
// of one 64 x 128 x 128 step, the turns the two consumer warpgroups take at the tensor cores, and
// BF16 tiles written out through shared memory. Compiled by NVRTC as part of each kernel's source.

typedef unsigned int u32;
typedef unsigned long long u64;

// Set by the host (grouped_gemm_sm90.build): pipeline stages, output columns of a tile (128 or 256),
// row tiles side by side in the tile order (GROUP_M: so that their column tiles are read from L2),
// and the size of the per-expert tables in shared memory.
#if !defined(STAGES) || !defined(BLOCK_N) || !defined(GROUP_M) || !defined(MAX_EXPERTS)
#error "compile with -DSTAGES=... -DBLOCK_N=... -DGROUP_M=... -DMAX_EXPERTS=... (grouped_gemm_sm90.build)"
#endif

struct alignas(64) TensorMap { u64 opaque[16]; };  // a CUtensorMap, built by the host

constexpr int TILE = 128;                   // output rows and columns of a tile, and K per step
constexpr int OPERAND_BYTES = TILE * TILE;  // one FP8 operand tile
constexpr int CONSUMER_WARPS = 8;
// A tile's columns are multiplied 128 at a time (one wgmma accumulator of 64 registers per part): wider
// tiles read fewer operand bytes per product from L2.
constexpr int COLUMN_PARTS = BLOCK_N / TILE;
constexpr int B_TILE_BYTES = BLOCK_N * TILE;  // the B operand's BLOCK_N rows of 128 bytes
constexpr int OUT_BOX_BYTES = TILE * 128;     // 64 BF16 columns of a tile's 128 rows, 128-byte swizzled rows
constexpr int OUT_TILE_BYTES = (BLOCK_N / 64) * OUT_BOX_BYTES;

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

// Named barriers of the consumer warpgroups, their ids immediate (a register would hold them): one
// consumer's turn at the tensor cores (256 threads: one waits, the other arrives), and one consumer's
// own staging of its output rows (128 threads).
__device__ __forceinline__ void take_turn(int consumer) {
    if (consumer == 0) asm volatile("bar.sync 3, 256;" ::: "memory");
    else asm volatile("bar.sync 4, 256;" ::: "memory");
}

__device__ __forceinline__ void pass_turn(int consumer) {  // to the other consumer
    if (consumer == 0) asm volatile("bar.arrive 4, 256;" ::: "memory");
    else asm volatile("bar.arrive 3, 256;" ::: "memory");
}

__device__ __forceinline__ void sync_own_warpgroup(int consumer) {
    if (consumer == 0) asm volatile("bar.sync 1, 128;" ::: "memory");
    else asm volatile("bar.sync 2, 128;" ::: "memory");
}

// A box of a tensor map at (column, row) into shared memory, completing on bar.
__device__ __forceinline__ void load_tile(u32 dst, const TensorMap* map, int column, int row, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(column), "r"(row), "r"(bar) : "memory");
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

// Two fp32 values as BF16 bits, rounded to nearest even, NaN as 0x7FC0: the rule of the Triton kernels
// (_bits.fp32_to_bf16_bits), so that both write the same bits.
__device__ __forceinline__ u32 bf16x2_rounded(float low, float high) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    if (low != low) packed = (packed & 0xFFFF0000u) | 0x7FC0u;
    if (high != high) packed = (packed & 0x0000FFFFu) | 0x7FC00000u;
    return packed;
}

// The same without the NaN rule, for values known to hold no NaN.
__device__ __forceinline__ u32 bf16x2_rounded_no_nan(float low, float high) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

// A consumer's 64 rows of one 128-column part (the wgmma accumulator's layout: thread (warp w, lane l)
// holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) (+1), j = 0..15) rounded to BF16 into shared
// memory, in the layout of the output map's boxes: two boxes of 64 columns, rows of 128 bytes whose
// 16-byte chunks are swizzled by row % 8 (so the 8 rows a warp writes at once fall on different banks).
template <bool MAY_HOLD_NAN>
__device__ __forceinline__ void stage_bf16_of(const float (&acc)[64], unsigned char* out_tile, int first_row,
                                              int lane) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = first_row + lane / 4 + 8 * h;
            const int chunk = (j % 8) ^ (row % 8);
            const float low = acc[4 * j + 2 * h], high = acc[4 * j + 2 * h + 1];
            *reinterpret_cast<u32*>(out_tile + (j / 8) * OUT_BOX_BYTES + row * 128 + chunk * 16 + (lane % 4) * 4) =
                MAY_HOLD_NAN ? bf16x2_rounded(low, high) : bf16x2_rounded_no_nan(low, high);
        }
    }
}

// The NaN rule costs six instructions a pair, on the epilogue's path while the tensor cores wait (the
// weight gradient's tiles sum only 8-11 steps at 32 experts): a sum of the 64 values, NaN if any is
// (or if infinities cancel), picks it only where it can matter. Measured on H200 (devdiag A/B, 32
// experts, 4 stages): fc2's weight gradient 689 TFLOP/s with the rule on every pair, 728 this way.
__device__ __forceinline__ void stage_bf16(const float (&acc)[64], unsigned char* out_tile, int first_row, int lane) {
    float partial[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) partial[i] = acc[i];
#pragma unroll
    for (int i = 8; i < 64; ++i) partial[i % 8] += acc[i];
    const float total = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                        ((partial[4] + partial[5]) + (partial[6] + partial[7]));
    if (total != total) stage_bf16_of<true>(acc, out_tile, first_row, lane);
    else stage_bf16_of<false>(acc, out_tile, first_row, lane);
}


// The shared-memory ring's barriers: `full` completes when a stage's bytes have arrived (and
// full_arrivals - 1 other arrivals), `empty` when every consumer warp is done with it.
__device__ __forceinline__ void init_ring(u32 full, u32 empty, u32 full_arrivals = 1) {
    for (int s = 0; s < STAGES; ++s) {
        barrier_init(full + 8 * s, full_arrivals);
        barrier_init(empty + 8 * s, CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The consumers take turns at the tensor cores, one step each: were both to issue a step's products
// at once, they would finish together and then both scale while the tensor cores idle. In turns, one
// scales while the other's products run. Consumer 0 goes first; after the last step, it takes
// consumer 1's last hand-over so that no arrival is left pending.
__device__ __forceinline__ void start_turns(int consumer) {
    if (consumer == 1) pass_turn(consumer);
}

__device__ __forceinline__ void end_turns(int consumer) {
    if (consumer == 0) take_turn(consumer);
}

// In the consumer's turn: product = its 64 rows of the stage's A tile times one 128-row part of the
// stage's B tile (K = 128 in four wgmma of 32), fp32. The caller has waited for the stage, scales the
// product and releases the stage after its last use of it.
__device__ __forceinline__ void multiply_part(float (&product)[64], u32 a_rows, u32 b_part, int consumer) {
    const u64 a = operand_descriptor(a_rows), b = operand_descriptor(b_part);
    take_turn(consumer);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int step = 0; step < TILE / 32; ++step) {  // 32 bytes of K each: 2 in the descriptor's units
        wgmma_64x128x32(product, a + 2 * step, b + 2 * step, step);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    pass_turn(consumer);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    keep_in_registers(product);
}

// The warp is done with a stage (its products and scale reads): one arrival of CONSUMER_WARPS.
__device__ __forceinline__ void release_stage(int lane, u32 empty_bar) {
    __syncwarp();
    if (lane == 0) barrier_arrive(empty_bar);
}

// A consumer's 64 rows of a BF16 tile out through shared memory and the output map (boxes of 64 x 64)
// at (column, row): the consumer goes on while the copies run, and waits for its previous copies only
// before it overwrites their rows. One thread of the warpgroup (`issues`) starts the copies.
__device__ __forceinline__ void store_bf16_async(const float (&acc)[COLUMN_PARTS][64], unsigned char* out_tile,
                                                 u32 out_tile_at, const TensorMap* map, int consumer, int warp,
                                                 int lane, bool issues, int column, int row) {
    if (issues) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    sync_own_warpgroup(consumer);
#pragma unroll
    for (int part = 0; part < COLUMN_PARTS; ++part) {
        stage_bf16(acc[part], out_tile + part * 2 * OUT_BOX_BYTES, consumer * 64 + warp * 16, lane);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the copy engine
    sync_own_warpgroup(consumer);
    if (issues) {
        for (int box = 0; box < BLOCK_N / 64; ++box) {
            store_tile_async(map, out_tile_at + box * OUT_BOX_BYTES + consumer * 64 * 128, column + box * 64, row);
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}

// Before the CTA's shared memory goes away: its copies out have read it.
__device__ __forceinline__ void finish_stores(bool issues) {
    if (issues) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The layout ending at shared-space address `end` fits the dynamic shared memory the host gave (its
// size formula is grouped_gemm_sm90.Sm90Gemm.shared_bytes): a mismatch stops the kernel instead of
// corrupting memory.
__device__ __forceinline__ void check_layout(unsigned char* raw, u32 end) {
    u32 size;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(size));
    if (end > shared_address(raw) + size) __trap();
}

// The dynamic shared memory from a 1024-byte boundary (swizzled tiles need it): its shared-space address.
__device__ __forceinline__ u32 aligned_shared_base(unsigned char* raw, unsigned char** aligned) {
    const u32 address = shared_address(raw);
    const u32 base = (address + 1023) & ~1023u;
    *aligned = raw + (base - address);
    return base;
}
