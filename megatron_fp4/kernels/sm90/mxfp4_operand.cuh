// The forward GEMM's A operand made from MXFP4 rows inside the kernel (grouped_rows.cu with A_MXFP4):
// converter warps turn one step's packed E2M1 codes and E8M0 block scales, which the producer has
// copied into the stage, into the 128 x 128 E4M3 tile the consumers multiply and one fp32 scale per
// row, by the rule of DESIGN §4 that mxfp4_to_fp8_rows applies (so the products are the same bits):
// per row and 128 columns, S = the largest finite scale byte of the 4 blocks, the row's scale
// 2^(S - 133), and each element of a block with byte e the E4M3 byte of its E2M1 value times
// 2^(6 - (S - e)); a NaN block (byte 255) gives E4M3 NaN (0x7F). No FP8 copy of the rows is written
// to global memory.
//
// The E4M3 bytes of the 8 E2M1 magnitudes at each gap d = S - e come from a table the host builds
// (kernels/_e4m3_table.py, held to megatron_fp4.reference by the tests): 2 words per gap, magnitudes
// 0-3 and 4-7.

constexpr int CODES_BOX_BYTES = TILE / 2;     // a row's packed codes of one step: 128 elements
constexpr int SCALES_BOX_BYTES = 16;          // a TMA box row: 4 steps' E8M0 bytes of a row
constexpr int CODES_BYTES = TILE * CODES_BOX_BYTES;
constexpr int BLOCK_SCALE_BYTES = TILE * SCALES_BOX_BYTES;
constexpr int ROW_SCALE_BYTES = TILE * 4;     // the step's fp32 scale of each row
constexpr int MXFP4_STEP_BYTES = CODES_BYTES + BLOCK_SCALE_BYTES;  // what the producer copies per step
constexpr int GAPS = 256;                     // table rows: every gap a byte can make
constexpr int CONVERTER_WARPS = 3;            // the producer warpgroup's warps 1-3
constexpr int BLOCKS_PER_ROW_STEP = TILE / 32;
constexpr u32 E4M3_NAN_WORD = 0x7F7F7F7Fu;
constexpr int FP4_TO_FP8_SCALE_BIAS = 127 + 6;

// The first column of the 16-byte scale box holding a step's 4 bytes: on H200 a box starting at the
// step's own bytes (4-byte aligned) stopped the kernel with an illegal instruction; this one runs.
__device__ __forceinline__ int scales_box_column(int step) {
    return (step * BLOCKS_PER_ROW_STEP) & ~(SCALES_BOX_BYTES - 1);
}

// 8 E2M1 codes (element i in bits 4i..4i+3) -> their 8 E4M3 bytes, elements 0-3 in .x and 4-7 in .y.
// The table word pair gives the magnitudes' bytes (prmt picks a byte by a 3-bit selector); the sign
// comes from a second prmt whose selector's bit 3 replicates the sign of byte 0x80: 0xFF for a
// negative code, 0x80 for a positive one, so bit 0 of each byte is the code's sign.
__device__ __forceinline__ uint2 e4m3_of_codes(u32 codes, uint2 table) {
    const u32 high = codes >> 16;
    u32 magnitude_low, magnitude_high, sign_low, sign_high;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(magnitude_low) : "r"(table.x), "r"(table.y), "r"(codes & 0x7777u));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(magnitude_high) : "r"(table.x), "r"(table.y), "r"(high & 0x7777u));
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(sign_low) : "r"(0x80u), "r"(codes & 0x8888u));
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(sign_high) : "r"(0x80u), "r"(high & 0x8888u));
    return make_uint2(magnitude_low | ((sign_low << 7) & 0x80808080u), magnitude_high | ((sign_high << 7) & 0x80808080u));
}

// 2^x as fp32 from its bits for x in [-149, 127] (subnormals too): the rule of _bits.pow2_fp32.
__device__ __forceinline__ float pow2_fp32(int x) {
    return __uint_as_float(x >= -126 ? (u32)(x + 127) << 23 : 1u << (x + 149));
}

// The largest of a row's 4 block scale bytes that is not NaN (255); 0 if all are.
__device__ __forceinline__ int largest_finite_byte(u32 bytes) {
    int largest = 0;
#pragma unroll
    for (int b = 0; b < BLOCKS_PER_ROW_STEP; ++b) {
        const int byte = (bytes >> (8 * b)) & 0xFF;
        if (byte != 255) largest = max(largest, byte);
    }
    return largest;
}

// The E4M3 bytes of the 8 magnitudes at gap d: for d <= 11 every nonzero product is an E4M3 normal,
// (m << 2) + ((12 - d) << 3) for magnitude code m >= 2 and (12 - d) << 3 for 0.5, computed without a
// memory access; larger gaps read the table. (The test of every code at every gap holds both
// to the reference.)
__device__ __forceinline__ uint2 magnitude_bytes(int gap, const uint2* table) {
    if (gap > 11) return table[gap];
    const u32 base = (u32)(12 - gap) << 3;
    return make_uint2(base * 0x01010100u + 0x0C080000u, base * 0x01010101u + 0x1C181410u);
}

constexpr int CONVERTER_THREADS = 32 * CONVERTER_WARPS;
constexpr int STEP_BLOCKS = TILE * BLOCKS_PER_ROW_STEP;  // a step's MXFP4 blocks: 128 rows x 4

struct BlockInput {  // one MXFP4 block of a step as read from the stage
    uint4 codes;
    u32 row_bytes;  // the row's 4 scale bytes of the step
};

__device__ __forceinline__ BlockInput read_block(const unsigned char* codes, const unsigned char* block_scales,
                                                 int scale_offset, int item) {
    const int row = item / BLOCKS_PER_ROW_STEP, block = item % BLOCKS_PER_ROW_STEP;
    return BlockInput{*reinterpret_cast<const uint4*>(codes + row * CODES_BOX_BYTES + block * 16),
                      *reinterpret_cast<const u32*>(block_scales + row * SCALES_BOX_BYTES + scale_offset)};
}

// Block `item` (row item / 4, block item % 4) into the stage's E4M3 tile (128-byte rows in the 128-byte
// swizzle, as TMA writes the FP8 operand) and, for block 0, the row's scale.
__device__ __forceinline__ void write_block(const BlockInput& in, unsigned char* a_tile, float* row_scales,
                                            const uint2* table, int item) {
    const int row = item / BLOCKS_PER_ROW_STEP, block = item % BLOCKS_PER_ROW_STEP;
    const int largest = largest_finite_byte(in.row_bytes);
    const int byte = (in.row_bytes >> (8 * block)) & 0xFF;
    uint4 first, second;  // elements 0-15 and 16-31 of the block
    if (byte == 255) {
        first = second = make_uint4(E4M3_NAN_WORD, E4M3_NAN_WORD, E4M3_NAN_WORD, E4M3_NAN_WORD);
    } else {
        const uint2 entry = magnitude_bytes(largest - byte, table);
        const uint2 e0 = e4m3_of_codes(in.codes.x, entry), e1 = e4m3_of_codes(in.codes.y, entry);
        const uint2 e2 = e4m3_of_codes(in.codes.z, entry), e3 = e4m3_of_codes(in.codes.w, entry);
        first = make_uint4(e0.x, e0.y, e1.x, e1.y);
        second = make_uint4(e2.x, e2.y, e3.x, e3.y);
    }
    // The block's 32 bytes are 16-byte chunks 2 * block and 2 * block + 1 of the row, swizzled by row % 8.
    unsigned char* line = a_tile + row * TILE;
    *reinterpret_cast<uint4*>(line + ((2 * block) ^ (row % 8)) * 16) = first;
    *reinterpret_cast<uint4*>(line + ((2 * block + 1) ^ (row % 8)) * 16) = second;
    if (block == 0) row_scales[row] = pow2_fp32(largest - FP4_TO_FP8_SCALE_BIAS);
}

// One step's A operand: converter thread `converter` (0 .. CONVERTER_THREADS - 1) takes the step's blocks
// (row, block) in turn, two at a time so that the second's reads overlap the first's conversion. codes:
// [128 rows][64 bytes]; block_scales: [128 rows][16 bytes], the step's 4 bytes at scale_offset;
// row_scales: [128] fp32.
__device__ __forceinline__ void convert_step(const unsigned char* codes, const unsigned char* block_scales,
                                             unsigned char* a_tile, float* row_scales, const uint2* table,
                                             int scale_offset, int converter) {
    for (int item = converter; item < STEP_BLOCKS; item += 2 * CONVERTER_THREADS) {
        const int next = item + CONVERTER_THREADS;
        const BlockInput first = read_block(codes, block_scales, scale_offset, item);
        const BlockInput second = read_block(codes, block_scales, scale_offset, min(next, STEP_BLOCKS - 1));
        write_block(first, a_tile, row_scales, table, item);
        if (next < STEP_BLOCKS) write_block(second, a_tile, row_scales, table, next);
    }
}
