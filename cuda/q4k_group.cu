// The first CUDA port of a specula kernel: the Q4_K matmul against int8 activations with
// super-block scales, reading the same repacked group layout as the CPU (packed_k.rs: eight rows
// per group, quants interleaved four bytes per row, scales and mins unpacked to bytes) and doing
// the same arithmetic in the same order (exact i32 sums per super-block, then two fused
// multiply-adds), so it must give the CPU's bits. Not part of the build: cuda/run_device_check.sh
// compiles and runs it on a machine with nvcc, against a case written by
// `cargo run --release -p specula-kernels --example device_case`.
//
// Status: written on 2026-11-28 in a session whose GPU loan was refused ("no new device machine is
// lent at present"), so NOT YET COMPILED OR RUN. The next session with a GPU: write the cases
// (cuda/cases/, ignored by git), run `bash cuda/run_device_check.sh` there with cuda/cases carried,
// and record here what it printed.
//
//   q4k_group CASE [copies]   -> checks every output bit, then times a matvec over `copies`
//                                copies of the matrix (weights streamed from memory, as decode)
//                                beside a device-to-device copy of as many bytes.
#include <cuda_fp16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(2); } } while (0)

struct Act {  // BlockQ8 as device_case writes it: 44 bytes
    float d, s;
    int8_t qs[32];
    int16_t h[2];
};
static_assert(sizeof(Act) == 44, "activation block layout");

// offsets inside a Q4_K group block (packed_k.rs `off`)
constexpr int K_DMIN = 16, K_SC = 32, K_MN = 96, Q4K_QS = 160, GBB = 1184;

// One thread per weight row: lane `row % 8` of group `row / 8`; eight neighbouring threads read
// one 32-byte vector of their group together.
__global__ void q4k_super(const uint8_t* __restrict__ packed, const Act* __restrict__ act, int rows, int blocks,
                          float* __restrict__ out) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int lane = r % 8;
    const uint8_t* grp = packed + (size_t)(r / 8) * blocks * GBB;
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t* blk = grp + (size_t)b * GBB;
        float d = __half2float(*reinterpret_cast<const __half*>(blk + 2 * lane));
        float dmin = __half2float(*reinterpret_cast<const __half*>(blk + K_DMIN + 2 * lane));
        float d_a = act[8 * b].d;
        int t = 0, m = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const Act& ab = act[8 * b + j];
            int s = 0;
#pragma unroll
            for (int v = 0; v < 8; v++) {
                uint32_t x = *reinterpret_cast<const uint32_t*>(blk + Q4K_QS + 32 * (8 * (j / 2) + v) + 4 * lane);
                uint32_t q = (j % 2) ? (x >> 4) & 0x0f0f0f0fu : x & 0x0f0f0f0fu;
                s = __dp4a((int)q, *reinterpret_cast<const int*>(ab.qs + 4 * v), s);
            }
            t += (int)blk[K_SC + 8 * j + lane] * s;
            m += (int)blk[K_MN + 8 * j + lane] * ((int)ab.h[0] + (int)ab.h[1]);
        }
        // the CPU's order and roundings: (d * d_a) * T + acc, then -(dmin * d_a) * M + acc
        acc = __fmaf_rn(__fmul_rn(d, d_a), __int2float_rn(t), acc);
        acc = __fmaf_rn(-__fmul_rn(dmin, d_a), __int2float_rn(m), acc);
    }
    out[r] = acc;
}

int main(int argc, char** argv) {
    if (argc < 2) { fprintf(stderr, "usage: q4k_group CASE [copies]\n"); return 2; }
    int copies = argc > 2 ? atoi(argv[2]) : 200;
    FILE* f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 2; }
    char magic[4];
    uint32_t hdr[4];
    if (fread(magic, 1, 4, f) != 4 || memcmp(magic, "SPQ4", 4) != 0 || fread(hdr, 4, 4, f) != 4) { fprintf(stderr, "not a case file\n"); return 2; }
    int rows = hdr[0], cols = hdr[1], blocks = hdr[2];
    if ((int)hdr[3] != GBB) { fprintf(stderr, "group block of %u bytes, expected %d\n", hdr[3], GBB); return 2; }
    size_t pbytes = (size_t)((rows + 7) / 8) * blocks * GBB;
    std::vector<uint8_t> packed(pbytes);
    std::vector<Act> act(cols / 32);
    std::vector<float> want(rows);
    if (fread(packed.data(), 1, pbytes, f) != pbytes || fread(act.data(), sizeof(Act), act.size(), f) != act.size() ||
        fread(want.data(), 4, rows, f) != (size_t)rows) { fprintf(stderr, "short case file\n"); return 2; }
    fclose(f);
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs; case %d x %d Q4_K (%zu packed bytes), %d copies (%.2f GB)\n", prop.name, prop.multiProcessorCount, rows, cols,
           pbytes, copies, copies * (double)pbytes / 1e9);

    // every copy is the same matrix: rows of copy c are rows c*rows.. of one long matrix
    uint8_t* dw;
    Act* da;
    float* dy;
    CHECK(cudaMalloc(&dw, pbytes * copies));
    CHECK(cudaMalloc(&da, act.size() * sizeof(Act)));
    CHECK(cudaMalloc(&dy, sizeof(float) * rows * (size_t)copies));
    for (int c = 0; c < copies; c++) CHECK(cudaMemcpy(dw + c * pbytes, packed.data(), pbytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(da, act.data(), act.size() * sizeof(Act), cudaMemcpyHostToDevice));
    int total = rows * copies, threads = 256;
    q4k_super<<<(total + threads - 1) / threads, threads>>>(dw, da, total, blocks, dy);
    CHECK(cudaGetLastError());
    std::vector<float> got((size_t)total);
    CHECK(cudaMemcpy(got.data(), dy, sizeof(float) * total, cudaMemcpyDeviceToHost));
    size_t differ = 0, first = (size_t)-1;
    for (size_t i = 0; i < (size_t)total; i++) {
        uint32_t a, b;
        memcpy(&a, &got[i], 4);
        memcpy(&b, &want[i % rows], 4);
        if (a != b) { if (first == (size_t)-1) first = i; differ++; }
    }
    if (differ) {
        printf("MISMATCH: %zu of %d outputs differ from the CPU's bits (first at %zu: %.9g vs %.9g)\n", differ, total, first, got[first], want[first % rows]);
    } else {
        printf("bitwise equal to the CPU kernel: %d outputs (%d copies x %d rows)\n", total, copies, rows);
    }

    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    float ms = 0;
    const int reps = 20;
    CHECK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++) q4k_super<<<(total + threads - 1) / threads, threads>>>(dw, da, total, blocks, dy);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    double kernel_gbs = reps * (double)pbytes * copies / (ms / 1e3) / 1e9;
    // the same bytes moved by the copy engine path (read + write counted)
    uint8_t* dc;
    CHECK(cudaMalloc(&dc, pbytes * copies));
    CHECK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++) CHECK(cudaMemcpy(dc, dw, pbytes * copies, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float cms = 0;
    CHECK(cudaEventElapsedTime(&cms, e0, e1));
    double copy_gbs = reps * 2.0 * pbytes * copies / (cms / 1e3) / 1e9;
    printf("q4k_super matvec: %.3f ms per pass over %.2f GB of weights = %.0f GB/s read\n", ms / reps, copies * (double)pbytes / 1e9, kernel_gbs);
    printf("device-to-device copy of the same bytes: %.0f GB/s (read + write); kernel at %.0f%% of it\n", copy_gbs, 100.0 * kernel_gbs / copy_gbs);
    return differ ? 1 : 0;
}
